"""Tokenizer (HF `tokenizer.json` through the `tokenizers` library), chat template, streaming detokenizer."""
from __future__ import annotations

import json
import os
from typing import Any

from .config import regular_file
from .errors import CheckpointError


class Tokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        tj = os.path.join(path, "tokenizer.json")
        if not regular_file(tj):
            raise CheckpointError(f"no tokenizer.json in {path}")
        try:
            self.tok = _Tok.from_file(tj)
        except Exception as e:
            raise CheckpointError(f"cannot read {tj}: {e}") from None
        # the special added tokens (`<|im_end|>`, ...): what skip_special_tokens leaves out of the text
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        self.config: dict[str, Any] = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if regular_file(tc):
            try:
                with open(tc, encoding="utf-8") as f:
                    self.config = json.load(f)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{tc} is not valid JSON: {e}") from None
        self.chat_template: str | None = self.config.get("chat_template")
        ct = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and regular_file(ct):
            with open(ct, encoding="utf-8") as f:
                self.chat_template = f.read()
        self.eos_ids: list[int] = []
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            i = self.tok.token_to_id(eos)
            if i is not None:
                self.eos_ids.append(i)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        """Render messages with the checkpoint's Jinja chat template (ChatML when it has none)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = self.chat_template or CHATML
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token="", eos_token="", **kw)


def _raise(msg: str) -> None:
    raise ValueError(f"chat template: {msg}")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character and never drops one: text is
    released only once the decoded tail no longer ends in U+FFFD (an incomplete byte sequence)."""

    def __init__(self, tok: Tokenizer, prompt_tail: list[int] | None = None):
        self.tok = tok
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix = 0                 # start of the window decoded for context
        self.read = len(self.ids)       # ids before this are already emitted
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        cur = self.tok.decode(self.ids[self.prefix:])
        if cur.endswith("\ufffd") or len(cur) < len(prev):
            return ""
        delta = cur[len(prev):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, release whatever is left (a dangling partial byte included)."""
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        cur = self.tok.decode(self.ids[self.prefix:])
        delta = cur[len(prev):]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
