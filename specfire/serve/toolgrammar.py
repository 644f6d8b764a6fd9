"""tool_choice "required" and a named function as a grammar over the call form the chat template
teaches, so the model can only write calls (one or more; exactly one of the named function) whose
arguments follow each tool's JSON schema; the assistant parser then returns them as tool_calls.

- `qwen3_xml` (Qwen3.5 / 3.6): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  ...</function>\\n</tool_call>`; the parameters in the schema's order, the required ones always, the
  others optional; a VALUE in the text form serve/toolcalls.py `convert` reads back: text for a
  string (no closing tag inside; `minLength`, `maxLength`, `pattern` as JSON Schema means them, a
  `const`; a `format` is refused, since the text form cannot enforce it), an enum's values (strings as themselves, others as JSON),
  and for every other type JSON that follows the sub-schema (bounds, enums, nested objects);
- `qwen3_json` (earlier Qwen): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, the
  object a JSON schema of its own (the name a const, the arguments the tool's parameters, no
  undeclared ones unless the schema's `additionalProperties` allows them).

A tag the tokenizer has as one added token (`<tool_call>` in Qwen's) is written as that token: the
grammar engine sees added tokens as special, never as their text.
"""
from __future__ import annotations

import json
from typing import Any, Collection, NamedTuple

from ..grammar import JSON_WHITESPACE, GrammarSpec
from .schema import RequestError
from .toolcalls import param_types

NO_CLOSER = r"""~/(?s:.*)<\/(parameter|function|tool_call)>(?s:.*)/"""
STRING = f"(/(?s:.*)/ & {NO_CLOSER})"
ANY = "(?s:.*)"
LEAD = r"/[ \n]{0,4}/"          # what a template or the think block's end leaves before the first call


def lit(s: str) -> str:
    """A Lark string literal of `s`."""
    return json.dumps(s, ensure_ascii=False)


def _json(schema: Any) -> str:
    s = dict(schema) if isinstance(schema, dict) else {}
    s.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
    return "%json " + json.dumps(s, ensure_ascii=False)


def _branches(pattern: str) -> list[str]:
    """`pattern` split at its top-level `|` (outside groups, classes and escapes)."""
    out, cur, depth, cls, i = [], "", 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            cur += pattern[i:i + 2]
            i += 2
            continue
        if cls:
            cls = c != "]"
        elif c == "[":
            cls = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            out.append(cur)
            cur, i = "", i + 1
            continue
        cur += c
        i += 1
    return out + [cur]


def _ends_with_anchor(b: str) -> bool:
    """`b` ends with an unescaped `$`."""
    if not b.endswith("$"):
        return False
    n = len(b) - 1 - len(b[:-1].rstrip("\\"))      # backslashes before it
    return n % 2 == 0


def _search(pattern: str) -> str:
    """A JSON Schema `pattern` (a search: it may match anywhere unless anchored) as a regex the
    whole text must match, in llguidance's Lark syntax (\\d and \\w ASCII, as in ECMAScript)."""
    import llguidance

    parts = []
    for b in _branches(pattern):
        lead, body = ("", b[1:]) if b.startswith("^") else (ANY, b)
        body, trail = (body[:-1], "") if _ends_with_anchor(body) else (body, ANY)
        parts.append(f"{lead}(?:{body}){trail}")
    return llguidance.regex_to_lark("|".join(parts), "dw")


class Where(NamedTuple):
    """A parameter's place in the request, for the 400 that refuses its schema."""

    path: str
    tool: str
    key: str

    def refuse(self, why: str) -> RequestError:
        return RequestError(f"'{self.path}' (tool {self.tool!r}, parameter {self.key!r}): {why}", self.path)


def _xml_string(schema: dict[str, Any], where: Where) -> str:
    """A string parameter's text as one regex terminal: its length bounds and pattern, and no
    closing tag inside; a keyword the text form cannot enforce is a 400 naming the parameter."""
    import llguidance

    if "format" in schema:
        raise where.refuse(f"'format' {schema['format']!r} cannot be enforced on a string parameter in "
                           f"this model's XML tool-call form; use 'pattern' or drop it")
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    for key, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (type(v) is not int or v < 0):
            raise where.refuse(f"'{key}' must be a non-negative integer, got {v!r}")
    lo = lo or 0
    if hi is not None and lo > hi:
        raise where.refuse(f"'minLength' {lo} is above 'maxLength' {hi}: no text fits")
    # (a complement alone is not a terminal llguidance closes: a call could never end)
    parts = [f"/(?s:.{{{lo},{'' if hi is None else hi}}})/" if lo or hi is not None else "/(?s:.*)/"]
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise where.refuse(f"'pattern' must be a string, got {pattern!r}")
        parts.append(f"/{_search(pattern)}/")
        err = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", f"start: X\nX: {parts[-1]}\n"))
        if err and not err.startswith("WARNING"):
            why = next((ln.strip() for ln in err.splitlines() if ln.strip().startswith("error:")), err.splitlines()[0])
            raise where.refuse(f"'pattern' {pattern!r} cannot be enforced: {why}")
    return f"({' & '.join(parts + [NO_CLOSER])})"


def _xml_value(schema: Any, name: str, rules: list[str], where: Where) -> str:
    """The grammar of one parameter's text and the closing tag after it: a terminal or rule named
    `name`, added to `rules`. A string's text and its closing tag are one terminal (the lexer then
    knows where the text ends: at the first closing tag, which the text cannot hold)."""
    types = param_types(schema)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and isinstance(schema.get("const"), str):
        enum = [schema["const"]]
    close = lit("\n</parameter>\n")
    if isinstance(enum, list) and enum:      # a string value is written as itself, any other as JSON
        rules.append(f"{name}: ({' | '.join(lit(v if isinstance(v, str) else json.dumps(v)) for v in enum)}) {close}")
    elif not types or "string" in types:
        text = _xml_string(schema, where) if isinstance(schema, dict) else STRING
        rules.append(f"{name.upper()}: {text} {close}")
        return name.upper()
    else:
        rules.append(f"{name}: {_json(schema)} {close}")
    return name


def _xml_function(i: int, fn: dict[str, Any], rules: list[str], where: str) -> str:
    params = fn.get("parameters") or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ()) if isinstance(params.get("required"), list) else set()
    parts = [lit(f"<function={fn['name']}>\n")]
    for j, (key, sub) in enumerate(props.items()):
        value = _xml_value(sub, f"v{i}_{j}", rules, Where(f"{where}.function.parameters.properties.{key}",
                                                          fn["name"], key))
        rules.append(f"p{i}_{j}: {lit(f'<parameter={key}>' + chr(10))} {value}")
        parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
    parts.append(lit("</function>\n"))
    rules.append(f"f{i}: " + " ".join(parts))
    return f"f{i}"


def _json_call(fn: dict[str, Any]) -> dict[str, Any]:
    """The call object; its arguments hold the declared parameters only, as the XML form's do,
    unless the schema says `additionalProperties` itself."""
    params = dict(fn.get("parameters") or {"type": "object"})
    params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[dict[str, Any]], form: str, named: str | None = None,
                 added: Collection[str] = ()) -> GrammarSpec:
    """The grammar for tool_choice "required" (one or more calls of any tool) or a named function
    (exactly one call of it), in `form` ("qwen3_xml" or "qwen3_json"); `added`: the tokenizer's
    added tokens. Where the calls start when the model reasons is the chat's (serve/chat.py)."""
    picked = [(k, t["function"]) for k, t in enumerate(tools) if named is None or t["function"]["name"] == named]
    fns = [fn for _, fn in picked]
    rules: list[str] = []
    open_, close = (t if t in added else lit(t) for t in ("<tool_call>", "</tool_call>"))
    if form == "qwen3_xml":
        names = [_xml_function(i, fn, rules, f"tools[{k}]") for i, (k, fn) in enumerate(picked)]
        rules.append("fn: " + " | ".join(names))
        rules.append(f"call: {open_} {lit(chr(10))} fn {close}")
    else:
        body = _json_call(fns[0]) if len(fns) == 1 else {"anyOf": [_json_call(f) for f in fns]}
        rules.append(f"call: {open_} {lit(chr(10))} {_json(body)} {lit(chr(10))} {close}")
    more = "" if named is not None else f" ({lit(chr(10))} call)*"
    start = f"start: LEAD call{more}\nLEAD: {LEAD}"
    return GrammarSpec("grammar", "\n".join([start] + rules) + "\n", "tool_choice")
