"""Incremental tool-call parsing of the two forms Qwen templates teach:

- `qwen3_xml` (Qwen3.5 / 3.6): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`, each value converted by the tool's JSON-schema type for KEY;
- `qwen3_json` (earlier Qwen): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`.

Events come out as soon as the text decides them: a call's name when `<function=NAME>` closes,
its arguments as pieces of one JSON object text (a string value streams as it is written; other
types when their value ends). Pieces concatenate to json.dumps of the arguments, and any split of
the same text gives the same events joined. A `<tool_call>` that turns out malformed before a name
is known goes back out as content."""
from __future__ import annotations

import ast
import json
from typing import Any, Callable

from .reasoning import held_prefix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
FORMS = ("qwen3_xml", "qwen3_json", "auto")
MAX_NAME = 256

# events: ("content", text) | ("boundary", "") | ("call", name) | ("args", fragment) | ("end", "");
# a boundary comes before and after each call: the content either side is trimmed there
Event = tuple[str, str]


def param_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty when it says none)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= param_types(sub)
    if not types and "enum" in schema:
        types = {type_of(v) for v in schema["enum"]}
    return types


def type_of(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
            dict: "object", list: "array"}.get(type(v), "string")


def streams_as_string(types: set[str]) -> bool:
    return not types or "string" in types


def convert(value: str, types: set[str]) -> Any:
    """A parameter's text as its schema's type; text that does not parse as that type stays a string."""
    if streams_as_string(types):
        return value
    text = value.strip()
    if text.lower() in ("null", "none") and ("null" in types or types <= {"object", "array"}):
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"integer", "number"}:
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            v = None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if "integer" in types and isinstance(v, float) and v.is_integer() and "number" not in types:
                return int(v)
            return v
    if types & {"object", "array"}:
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(v, (dict, list)):
                return v
    return value


def _str_piece(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


class ToolCallParser:
    """feed(text) / finish() -> events. `tools` maps a function name to its `parameters` schema."""

    def __init__(self, form: str, tools: dict[str, Any] | None = None):
        if form not in FORMS:
            raise ValueError(f"tool-call form must be one of {', '.join(FORMS)}, got {form!r}")
        self.form, self.tools = form, tools or {}
        self.state, self.buf = "text", ""
        self.raw = ""            # the text since <tool_call>, while the call may still be content
        self.name = ""
        self.n_params = 0
        self.value: list[str] = []
        self.types: set[str] = set()
        self.value_start = True

    # ---- feeding ----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self.buf and getattr(self, "_" + self.state)(out):
            pass
        return out

    def _text(self, out: list[Event]) -> bool:
        i = self.buf.find(CALL_OPEN)
        if i < 0:
            keep = held_prefix(self.buf, (CALL_OPEN,))
            out.append(("content", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        out.append(("content", self.buf[:i]))
        self.buf, self.raw, self.state = self.buf[i + len(CALL_OPEN):], CALL_OPEN, "open"
        return True

    def _open(self, out: list[Event]) -> bool:
        head = self.buf.lstrip()
        xml, js = self.form in ("qwen3_xml", "auto"), self.form in ("qwen3_json", "auto")
        if xml and head.startswith(FN_OPEN):
            end = head.find(">")
            if end < 0:
                if len(head) - len(FN_OPEN) > MAX_NAME or "\n" in head:
                    return self._not_a_call(out)
                return False
            name = head[len(FN_OPEN):end].strip()
            if not name or "\n" in name or len(name) > MAX_NAME:
                return self._not_a_call(out)
            out += [("boundary", ""), ("call", name)]
            self.name, self.n_params, self.buf, self.state = name, 0, head[end + 1:], "body"
            return True
        if js and head.startswith("{"):
            self.raw += self.buf[:len(self.buf) - len(head)]
            self.buf, self.state = head, "json"
            return True
        if not head or (xml and FN_OPEN.startswith(head)):
            return False
        return self._not_a_call(out)

    def _not_a_call(self, out: list[Event]) -> bool:
        out.append(("content", self.raw))
        self.state = "text"
        return True

    def _body(self, out: list[Event]) -> bool:
        head = self.buf.lstrip()
        if head.startswith(PARAM_OPEN):
            end = head.find(">")
            if end < 0:
                return False
            key = head[len(PARAM_OPEN):end].strip()
            schema = (self.tools.get(self.name) or {}).get("properties", {}) if isinstance(
                self.tools.get(self.name), dict) else {}
            self.types = param_types(schema.get(key) if isinstance(schema, dict) else None)
            sep = "{" if self.n_params == 0 else ", "
            self.n_params += 1
            out.append(("args", sep + json.dumps(key, ensure_ascii=False) + ": "
                        + ('"' if streams_as_string(self.types) else "")))
            self.value, self.value_start = [], True
            self.buf, self.state = head[end + 1:], "value"
            return True
        if head.startswith(FN_CLOSE):
            self.buf, self.state = head[len(FN_CLOSE):], "after"
            return True
        if head.startswith(CALL_CLOSE):
            self._end(out)
            self.buf = head[len(CALL_CLOSE):]
            return True
        if not head or any(t.startswith(head) for t in (PARAM_OPEN, FN_CLOSE, CALL_CLOSE)):
            self.buf = head
            return False
        nxt = head.find("<", 1)                 # stray text between parameters: skipped
        self.buf = head[nxt:] if nxt > 0 else ""
        return bool(self.buf)

    def _value(self, out: list[Event]) -> bool:
        if self.value_start:
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
            self.value_start = False
        ends = [(i, t) for t in (PARAM_CLOSE, FN_CLOSE, CALL_CLOSE) if (i := self.buf.find(t)) >= 0]
        if not ends:
            keep = held_prefix(self.buf, (PARAM_CLOSE, FN_CLOSE, CALL_CLOSE))
            if self.buf[:len(self.buf) - keep].endswith("\n"):
                keep += 1                        # a newline just before </parameter> is not the value's
            self._value_text(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        i, tag = min(ends)
        text = self.buf[:i]
        self._value_text(out, text[:-1] if text.endswith("\n") else text)
        self._value_end(out)
        self.buf = self.buf[i + len(tag):]
        if tag == PARAM_CLOSE:
            self.state = "body"
        elif tag == FN_CLOSE:
            self.state = "after"
        else:
            self._end(out)
        return True

    def _value_text(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if streams_as_string(self.types):
            out.append(("args", _str_piece(text)))
        else:
            self.value.append(text)

    def _value_end(self, out: list[Event]) -> None:
        if streams_as_string(self.types):
            out.append(("args", '"'))
        else:
            out.append(("args", json.dumps(convert("".join(self.value), self.types), ensure_ascii=False)))

    def _after(self, out: list[Event]) -> bool:
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            self.buf = self.buf[len(self.buf) - held_prefix(self.buf, (CALL_CLOSE,)):]
            return False
        self._end(out)
        self.buf = self.buf[i + len(CALL_CLOSE):]
        return True

    def _end(self, out: list[Event]) -> None:
        out += [("args", "}" if self.n_params else "{}"), ("end", ""), ("boundary", "")]
        self.state = "text"

    def _json(self, out: list[Event]) -> bool:
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            return False
        body, self.buf = self.buf[:i], self.buf[i + len(CALL_CLOSE):]
        if not self._json_call(out, body):
            out.append(("content", self.raw + body + CALL_CLOSE))
            self.state = "text"
        return True

    def _json_call(self, out: list[Event], body: str) -> bool:
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return False
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return False
        if not isinstance(args, dict):
            return False
        self.name = call["name"]
        out += [("boundary", ""), ("call", self.name), ("args", json.dumps(args, ensure_ascii=False)), ("end", ""), ("boundary", "")]
        self.state = "text"
        return True

    # ---- the end of the output --------------------------------------------------------------------
    def finish(self) -> list[Event]:
        """Close what the text left open: a started call keeps what it has, an unnamed one is content."""
        out: list[Event] = []
        buf, self.buf = self.buf, ""
        if self.state == "text":
            out.append(("content", buf))
        elif self.state == "open":
            out.append(("content", self.raw + buf))
        elif self.state == "json":
            if not self._json_call(out, buf):
                out.append(("content", self.raw + buf))
        else:
            if self.state == "value":
                if self.value_start and buf.startswith("\n"):
                    buf = buf[1:]
                self._value_text(out, buf[:-1] if buf.endswith("\n") else buf)
                self._value_end(out)
            self._end(out)
        self.state = "text"
        return [e for e in out if e[1] or e[0] not in ("content", "args")]


def new_call_id() -> str:
    import uuid

    return "call_" + uuid.uuid4().hex[:24]


IdFactory = Callable[[], str]
