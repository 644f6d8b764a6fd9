"""The checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it, and
its output tokenized so that only the control tokens the template itself wrote become control
tokens: text from the request that spells one (`<|im_end|>` in a user message) stays text.

How: before rendering, every control token inside a request string is wrapped in two private-use
markers; after rendering, the marked spans are encoded as plain text and the rest normally (the
scheme of transformers' `sanitize_control_tokens` with its `chat_control_tokens` list empty unless
the checkpoint gives one; the marked spans match no added token at all, special or not)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from jinja2 import Template

MARK_OPEN, MARK_CLOSE = "\U000f0000", "\U000f0001"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
GENERIC_ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatInputError(ValueError):
    """A message the template cannot be given; `param` names the field (`messages[2].role`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _raise(msg: str) -> None:
    raise ValueError(f"chat template: {msg}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


class ChatTemplate:
    """One compiled template with what the request checks need to know about it."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None,
                 added_tokens: list[AddedToken] | None = None, control_tokens: list[str] | None = None):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or CHATML
        self.special_tokens = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.env = env
        self.template: Template = env.from_string(self.source)
        ast = env.parse(self.source)
        from jinja2 import meta, nodes

        self.variables = frozenset(meta.find_undeclared_variables(ast))
        literals = {n.data for n in ast.find_all(nodes.TemplateData)}
        literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
        self.literal_text = "\0".join(sorted(literals))
        # the four every chat template reads, plus `developer` where the template names it
        self.roles: tuple[str, ...] = tuple(r for r in KNOWN_ROLES if r in GENERIC_ROLES or r in literals)
        added = added_tokens or []
        # the special tokens, plus any the checkpoint lists in `chat_control_tokens`; the non-special
        # tags (<think>, <tool_call>) are left to match, since templates split and test content on them
        chosen = set(control_tokens or ())
        self.control_tokens = tuple(t.content for t in added if t.special or t.content in chosen)
        self.added = tuple(t.content for t in added)

    # ---- what the template teaches ---------------------------------------------------------------
    @property
    def renders_tools(self) -> bool:
        return "tools" in self.variables

    @cached_property
    def tool_call_form(self) -> str | None:
        """`qwen3_xml` when the template teaches `<function=NAME>` calls, `qwen3_json` when it teaches
        `<tool_call>` with a JSON object, None when it teaches no tool calls."""
        if "<function=" in self.literal_text:
            return "qwen3_xml"
        if "<tool_call>" in self.literal_text:
            return "qwen3_json"
        return None

    @property
    def thinks(self) -> bool:
        return "<think>" in self.literal_text and "</think>" in self.literal_text

    # ---- rendering --------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None,
               mark: bool = False) -> str:
        """The template over `messages` (checked and normalised by `prepare_messages`), with the
        variables transformers passes: messages, tools, add_generation_prompt, the named special
        tokens, then `kwargs` (chat_template_kwargs: enable_thinking, ...). With `mark`, control
        tokens inside every request string are wrapped in markers for `encode_marked`."""
        msgs = prepare_messages(messages, self.roles)
        kw = dict(kwargs or {})
        for name in RESERVED:
            if name in kw:
                raise ChatInputError(f"'chat_template_kwargs.{name}' is set by the server, not the request",
                                     f"chat_template_kwargs.{name}")
        if mark:
            mark_fn = self._marker()
            msgs, tools, kw = mark_fn(msgs), mark_fn(tools), mark_fn(kw)
        return self.template.render(**{**self.special_tokens, "messages": msgs, "tools": tools,
                                       "documents": None, "add_generation_prompt": add_generation_prompt, **kw})

    def generation_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          kwargs: dict[str, Any] | None = None) -> str:
        """What `add_generation_prompt` appends (`<|im_start|>assistant\\n<think>\\n`), found by rendering
        without it; the reasoning parser reads it to know whether the output starts inside a think block."""
        full = self.render(messages, tools, True, kwargs)
        base = self.render(messages, tools, False, kwargs)
        return full[len(base):] if full.startswith(base) else full

    def _marker(self) -> Callable[[Any], Any]:
        pattern = _alternation(self.control_tokens)

        def mark(obj: Any) -> Any:
            if isinstance(obj, str):
                obj = obj.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
                return pattern.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, obj) if self.control_tokens else obj
            if isinstance(obj, dict):
                return {k: mark(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [mark(v) for v in obj]
            return obj
        return mark

    def split_marked(self, rendered: str) -> list[tuple[str, bool]]:
        """(piece, as_text) in order: marked control tokens as text, everything else as written.
        A lone marker (a template `split()` cut a marked token) is dropped but still ends the piece,
        so the text either side cannot join into a control token."""
        pattern = re.compile(MARK_OPEN + "(" + _alternation(self.added or ("\0",)).pattern + ")" + MARK_CLOSE
                             + f"|[{MARK_OPEN}{MARK_CLOSE}]")
        parts = pattern.split(rendered)
        out = [(parts[0], False)]
        for i, piece in enumerate(parts[1:], start=1):
            if piece:
                out.append((piece, i % 2 == 1))
        return out


def _alternation(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """Any of `tokens`, longest first (a token wins over the tokens it contains)."""
    if not tokens:
        return re.compile("(?!)")
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


# ---- messages ---------------------------------------------------------------------------------------

def prepare_messages(messages: list[dict[str, Any]], roles: tuple[str, ...] = GENERIC_ROLES) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: keys whose value is null dropped, a reasoning
    field under every name templates read, assistant `tool_calls` arguments as objects (clients
    send JSON strings; Qwen templates iterate them), roles limited to the template's."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatInputError(f"'{where}' must be an object with a string 'role'", where)
        if m["role"] not in roles:
            raise ChatInputError(f"'{where}.role' is {m['role']!r}; this model's chat template takes the roles "
                                 f"{', '.join(roles)}", f"{where}.role")
        msg = {k: v for k, v in m.items() if v is not None}
        if "content" not in msg and not msg.get("tool_calls"):
            raise ChatInputError(f"'{where}' needs 'content' (or, from the assistant, 'tool_calls')", where)
        msg.setdefault("content", "")
        reasoning = next((msg[k] for k in REASONING_FIELDS if isinstance(msg.get(k), str)), None)
        if reasoning is not None:
            msg.update({k: reasoning for k in REASONING_FIELDS})
        if "tool_calls" in msg:
            if m["role"] != "assistant":
                raise ChatInputError(f"'{where}.tool_calls' is only for assistant messages", f"{where}.tool_calls")
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(_array(msg["tool_calls"], f"{where}.tool_calls"))]
        out.append(msg)
    return out


def _array(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise ChatInputError(f"'{where}' must be an array", where)
    return v


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise ChatInputError(f"'{where}' must be an object {{\"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}", where)
    f = dict(c["function"])
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise ChatInputError(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatInputError(f"'{where}.function.arguments' is not valid JSON: {e}",
                                 f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise ChatInputError(f"'{where}.function.arguments' must be a JSON object", f"{where}.function.arguments")
    f["arguments"] = args
    return {**c, "function": f}
