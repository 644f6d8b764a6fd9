"""What arrives on the wire, before any shape: one JSON document checked once (nesting depth,
valid Unicode) and RequestError, the 400 that names the offending field (`param`).

Parsing walks the decoded JSON once (iteratively) before anything else touches it, so a deeply
nested body or a lone surrogate is a 400 naming where it is, not a RecursionError or a tokenizer
TypeError later."""
from __future__ import annotations

import json
from typing import Any


MAX_DEPTH = 32          # nesting levels a request may use (real bodies need about 5)


class RequestError(Exception):
    """A request the server refuses; rendered in the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def short(v: Any) -> str:
    """A value as repr writes it, cut to 60 characters, for an error message."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# ---- raw JSON -------------------------------------------------------------------------------------

def check_tree(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth` and strings that are not valid Unicode (lone
    surrogates from `\\ud800` escapes), naming the path of the first offender."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise RequestError(f"'{path or 'body'}' is nested more than {max_depth} levels deep", path or None)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_text(k, path or "body")
                stack.append((x, _join(path, k), depth + 1))


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _check_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{path}' has a lone surrogate {s[e.start]!r} at character {e.start}; strings must "
                           f"be valid Unicode", path or None) from None


def parse_json(raw: bytes | str, what: str = "request body") -> Any:
    """Decode and parse one JSON document, with every failure a 400 (param null)."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{what} is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    check_tree(value)
    return value


def parse_object(raw: bytes | str, what: str = "request body") -> dict[str, Any]:
    value = parse_json(raw, what)
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, got {type_name(value)}")
    return value
