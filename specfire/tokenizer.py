"""Tokenizer (HF `tokenizer.json` through the `tokenizers` library), chat template, streaming detokenizer."""
from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any

from .chat_template import SPECIAL_TOKEN_NAMES, AddedToken, ChatTemplate
from .config import regular_file
from .errors import CheckpointError


class ChatIds(list):
    """A chat prompt's token ids (a list of ints to any reader) and its turn ends: for each earlier
    assistant message the length of the prompt that answered it and of the messages before it,
    where those ids start these, then where this prompt's messages end, then its length. Its prefill ends a forward at each, so the next turn resumes from this one's end on the
    bits of a cold prefill (runtime/prefix.py)."""

    def __init__(self, ids: Any = (), ends: Any = ()):
        super().__init__(ids)
        self.ends: tuple[int, ...] = tuple(ends)


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
        # chat_template.jinja wins over tokenizer_config.json's template, as in transformers
        self.chat_template: str | None = _default_template(self.config.get("chat_template"))
        ct = os.path.join(path, "chat_template.jinja")
        if regular_file(ct):
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

    @cached_property
    def template(self) -> ChatTemplate:
        """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's, else ChatML)."""
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            v = self.config.get(name)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[name] = v
        added = [AddedToken(t.content, bool(t.special)) for _, t in sorted(self.tok.get_added_tokens_decoder().items())]
        control = self.config.get("chat_control_tokens")
        return ChatTemplate(self.chat_template, special, added, control if isinstance(control, list) else None)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **kw: Any) -> str:
        """Messages rendered with the checkpoint's Jinja chat template (ChatML when it has none)."""
        return self.template.render(messages, tools, add_generation_prompt, kw)

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
                 allow_special: bool = False) -> "ChatIds":
        """Token ids of the rendered chat, with its turn ends (ChatIds). Control tokens spelled
        inside the request's strings are encoded as text unless `allow_special` (then the rendered
        text is encoded as one string)."""
        t = self.template
        text = t.render(messages, tools, add_generation_prompt, template_kwargs, mark=not allow_special)
        ids = self._rendered_ids(text, allow_special)
        if not add_generation_prompt:
            return ChatIds(ids)
        ends = set()
        for i in range(1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            for gen in (True, False):      # the prompt that answered it, and where its messages end
                n = self._head_len(messages[:i], tools, template_kwargs, allow_special, text, ids, gen)
                if n is not None:
                    ends.add(n)
        # this prompt's messages end before its generation prompt: the next turn's prompt starts with
        # them where its template renders this answer unlike the prompt that asked for it (Qwen3.5's
        # drops the think block the generation prompt opened)
        own = self._head_len(messages, tools, template_kwargs, allow_special, text, ids, False)
        if own is not None:
            ends.add(own)
        return ChatIds(ids, sorted(ends) + [len(ids)])

    def _head_len(self, head: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None, allow_special: bool, text: str, ids: list[int],
                  gen: bool = True) -> int | None:
        """The length of the prompt that answered the assistant message after `head` (rendered with
        the generation prompt; `gen` False: without it, where head's messages end), or None where
        its ids do not start `ids` (or are all of them)."""
        from jinja2 import TemplateError

        try:     # a template may refuse a head the whole chat passes (one that wants a user message last)
            h = self.template.render(head, tools, gen, template_kwargs, mark=not allow_special)
        except (ValueError, TypeError, TemplateError):
            return None
        if not text.startswith(h):
            return None
        hids = self._rendered_ids(h, allow_special)
        return len(hids) if len(hids) < len(ids) and ids[:len(hids)] == hids else None

    def _rendered_ids(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            return self.encode(text)
        pieces = self.template.split_marked(text)
        ids = self.encode(pieces[0][0])
        for piece, as_text in pieces[1:]:
            ids += self._encode_piece(piece, as_text)
        return ids

    @cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        """Byte-level BPE (Qwen's, GPT-2's): each of a piece's characters stands for one byte."""
        if type(self.tok.decoder).__name__ != "ByteLevel":
            return None
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        table, extra = {}, 0
        for b in range(256):
            if b in printable:
                table[chr(b)] = b
            else:
                table[chr(256 + extra)] = b
                extra += 1
        return table

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.tok.get_added_tokens_decoder())

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character included), as OpenAI's
        logprobs report them; an added token's are its text's."""
        table = self._byte_alphabet
        piece = self.tok.id_to_token(token)
        if table is not None and piece is not None and token not in self._added_ids:
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                pass
        return self.decode([token]).encode("utf-8")

    def encode_plain(self, text: str) -> list[int]:
        """`text` through normalizer, pre-tokenizer and model only: no added token, special or not, is matched."""
        t = self.tok
        if t.normalizer is not None:
            text = t.normalizer.normalize_str(text)
        words = t.pre_tokenizer.pre_tokenize_str(text) if t.pre_tokenizer is not None else [(text, (0, len(text)))]
        return [tok.id for w, _ in words for tok in t.model.tokenize(w)]

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        """A piece from the middle of a chat, encoded after a newline that is then removed, so a
        tokenizer that marks the start of a string (a SentencePiece prefix space) does not here."""
        encode = self.encode_plain if as_text else self.encode
        nl = self.encode("\n")
        ids = encode("\n" + piece)
        return ids[len(nl):] if ids[:len(nl)] == nl else encode(piece)


def _default_template(v: Any) -> str | None:
    """tokenizer_config.json's template: a string, or named templates (the one named "default")."""
    if isinstance(v, list):
        v = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
    if isinstance(v, dict):
        v = v.get("default")
    return v if isinstance(v, str) else None


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
