"""tool_choice "required" and a named function as a grammar over the call form the chat template
teaches, so the model can only write calls (one or more; exactly one of the named function) whose
arguments follow each tool's JSON schema; the assistant parser then returns them as tool_calls.

- `qwen3_xml` (Qwen3.5 / 3.6): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  ...</function>\\n</tool_call>`; the parameters in the schema's order, the required ones always, the
  others optional; a VALUE in the text form serve/toolcalls.py `convert` reads back: free text for
  a string (no closing tag inside; its other keywords are not enforced), a string enum's values,
  and for every other type JSON that follows the sub-schema (bounds, enums, nested objects);
- `qwen3_json` (earlier Qwen): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, the
  object a JSON schema of its own (the name a const, the arguments the tool's parameters, no
  undeclared ones unless the schema's `additionalProperties` allows them).

A tag the tokenizer has as one added token (`<tool_call>` in Qwen's) is written as that token: the
grammar engine sees added tokens as special, never as their text.
"""
from __future__ import annotations

import json
from typing import Any, Collection

from ..grammar import JSON_WHITESPACE, GrammarSpec
from .toolcalls import param_types

STRING = r"""(/(?s:.*)/ & ~/(?s:.*)<\/(parameter|function|tool_call)>(?s:.*)/)"""
LEAD = r"/[ \n]{0,4}/"          # what a template or the think block's end leaves before the first call


def lit(s: str) -> str:
    """A Lark string literal of `s`."""
    return json.dumps(s, ensure_ascii=False)


def _json(schema: Any) -> str:
    s = dict(schema) if isinstance(schema, dict) else {}
    s.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
    return "%json " + json.dumps(s, ensure_ascii=False)


def _xml_value(schema: Any, name: str, rules: list[str]) -> str:
    """The grammar of one parameter's text and the closing tag after it: a terminal or rule named
    `name`, added to `rules`. Free text and its closing tag are one terminal (the lexer then knows
    where the text ends: at the first closing tag, which the text cannot hold)."""
    types = param_types(schema)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    close = lit("\n</parameter>\n")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        rules.append(f"{name}: ({' | '.join(lit(v) for v in enum)}) {close}")
    elif not types or "string" in types:
        rules.append(f"{name.upper()}: {STRING} {close}")
        return name.upper()
    else:
        rules.append(f"{name}: {_json(schema)} {close}")
    return name


def _xml_function(i: int, fn: dict[str, Any], rules: list[str]) -> str:
    params = fn.get("parameters") or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ()) if isinstance(params.get("required"), list) else set()
    parts = [lit(f"<function={fn['name']}>\n")]
    for j, (key, sub) in enumerate(props.items()):
        value = _xml_value(sub, f"v{i}_{j}", rules)
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
    added tokens."""
    fns = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    rules: list[str] = []
    open_, close = (t if t in added else lit(t) for t in ("<tool_call>", "</tool_call>"))
    if form == "qwen3_xml":
        names = [_xml_function(i, fn, rules) for i, fn in enumerate(fns)]
        rules.append("fn: " + " | ".join(names))
        rules.append(f"call: {open_} {lit(chr(10))} fn {close}")
    else:
        body = _json_call(fns[0]) if len(fns) == 1 else {"anyOf": [_json_call(f) for f in fns]}
        rules.append(f"call: {open_} {lit(chr(10))} {_json(body)} {lit(chr(10))} {close}")
    more = "" if named is not None else f" ({lit(chr(10))} call)*"
    start = f"start: LEAD call{more}\nLEAD: {LEAD}"
    return GrammarSpec("grammar", "\n".join([start] + rules) + "\n", "tool_choice")
