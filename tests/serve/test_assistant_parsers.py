"""Reasoning and tool-call parsing of assistant output: answers in the forms Qwen3.5 / 3.6 (XML calls,
think opened by the prompt) and earlier Qwen3 (JSON calls) emit, fed whole, character by character,
token by token and split at every pair of points: the same final message every time, and the
stream's deltas concatenate to it."""
from __future__ import annotations

import json

import pytest

from qwenstyle import build_qwen_tokenizer
from specfire.serve.assistant import AssistantOutput
from specfire.serve.toolcalls import convert, param_types

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "opts": {"type": "object"}}, "required": ["city"]}
TYPED = {"type": "object", "properties": {
    "i": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "a": {"type": "array"},
    "o": {"type": "object"}, "n": {"type": ["integer", "null"]}, "bad": {"type": "integer"},
    "code": {"type": "string"}, "e": {"enum": [1, 2]}}}
TOOLS = {"get_weather": WEATHER, "typed": TYPED}

# (name, parser settings, model output, expected content, reasoning, calls [(name, arguments)])
CASES = [
    ("xml_two_calls", dict(in_think=True, tool_form="qwen3_xml"),
     "The user wants two cities.\n</think>\n\nChecking both.\n\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nParis \"rive gauche\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
     "</tool_call>",
     "Checking both.", "The user wants two cities.",
     [("get_weather", {"city": 'Paris "rive gauche"', "days": 3}), ("get_weather", {"city": "Rome"})]),
    ("xml_call_inside_think_is_not_a_call", dict(in_think=True, tool_form="qwen3_xml"),
     "Maybe <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
     " no.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBergen\n</parameter>\n</function>\n"
     "</tool_call>",
     None, "Maybe <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
           "</tool_call> no.",
     [("get_weather", {"city": "Bergen"})]),
    ("xml_types", dict(in_think=False, tool_form="qwen3_xml"),
     "<think>\nok\n</think>\n\n<tool_call>\n<function=typed>\n<parameter=i>\n 42 \n</parameter>\n<parameter=x>\n2.5"
     "\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=a>\n[1, \"two\"]\n</parameter>\n<parameter=o>\n"
     "{'k': [1, None]}\n</parameter>\n<parameter=n>\nnull\n</parameter>\n<parameter=bad>\nthree\n</parameter>\n"
     "<parameter=code>\n\ndef f(x):\n    return x < 1  # </param\n\n</parameter>\n<parameter=e>\n2\n</parameter>\n"
     "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
     None, "ok",
     [("typed", {"i": 42, "x": 2.5, "b": True, "a": [1, "two"], "o": {"k": [1, None]}, "n": None, "bad": "three",
                 "code": "\ndef f(x):\n    return x < 1  # </param\n", "e": 2, "extra": "7"})]),
    ("xml_missing_closers", dict(in_think=True, tool_form="qwen3_xml"),
     "short\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</function>\n</tool_call>",
     None, "short", [("get_weather", {"city": "Lima"})]),
    ("xml_cut_off_mid_value", dict(in_think=True, tool_form="qwen3_xml"),
     "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr",
     None, None, [("get_weather", {"city": "San Fr"})]),
    ("json_form", dict(in_think=False, tool_form="qwen3_json"),
     "<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Kyiv\","
     " \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Lviv\\\"}\"}"
     "\n</tool_call>",
     None, "Need the tool.",
     [("get_weather", {"city": "Kyiv", "days": 2}), ("get_weather", {"city": "Lviv"})]),
    ("auto_form_takes_both", dict(in_think=False, tool_form="auto"),
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call><tool_call><function=get_weather>"
     "</function></tool_call>",
     None, None, [("get_weather", {}), ("get_weather", {})]),
    ("malformed_call_is_content", dict(in_think=False, tool_form="qwen3_xml"),
     "See: <tool_call>\nnot a call\n</tool_call> and a < b, <tool_cal",
     "See: <tool_call>\nnot a call\n</tool_call> and a < b, <tool_cal", None, []),
    ("json_malformed_is_content", dict(in_think=False, tool_form="qwen3_json"),
     "<tool_call>\n{\"name\": 1}\n</tool_call>", "<tool_call>\n{\"name\": 1}\n</tool_call>", None, []),
    ("reasoning_cut_off", dict(in_think=True, tool_form="qwen3_xml"),
     "Let me think about <tool_call> and </thin", None, "Let me think about <tool_call> and </thin", []),
    ("thinking_off_plain", dict(in_think=False, tool_form="qwen3_xml"),
     "Hello!  Two  spaces.\n\n", "Hello!  Two  spaces.\n\n", None, []),
    ("late_think_is_text", dict(in_think=False, tool_form=None),
     "Text first <think>not reasoning</think> after", "Text first <think>not reasoning</think> after", None, []),
]
IDS = [c[0] for c in CASES]


def run(settings: dict, pieces: list[str], reasoning: bool = True):
    n = iter(range(1000))
    out = AssistantOutput(reasoning=reasoning, tools=TOOLS, new_id=lambda: f"call_{next(n)}", **settings)
    deltas = []
    for p in pieces:
        deltas += out.feed(p)
    deltas += out.finish()
    return out, deltas


def joined(deltas: list[dict]) -> dict:
    """What a client gets by concatenating stream deltas (the openai SDK's accumulation)."""
    msg: dict = {"content": None, "reasoning_content": None, "reasoning": None, "tool_calls": []}
    for d in deltas:
        for key in ("content", "reasoning_content", "reasoning"):
            if key in d:
                msg[key] = (msg[key] or "") + d[key]
        for tc in d.get("tool_calls", []):
            calls = msg["tool_calls"]
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "type": tc["type"], "function": {"name": tc["function"]["name"],
                                                                               "arguments": ""}})
            assert "id" not in tc or tc["index"] == len(calls) - 1
            calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return msg


def check(case, pieces):
    _, settings, text, content, reasoning, calls = case
    out, deltas = run(settings, pieces)
    msg = out.message()
    assert (msg["content"], msg["reasoning_content"], msg["reasoning"]) == (content, reasoning, reasoning)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls
    for c in msg.get("tool_calls", []):
        assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
    stream = joined(deltas)
    assert {k: stream[k] for k in ("content", "reasoning_content", "reasoning")} == \
        {k: msg[k] for k in ("content", "reasoning_content", "reasoning")}
    assert stream["tool_calls"] == msg.get("tool_calls", [])
    assert out.finish_reason("stop") == ("tool_calls" if calls else "stop") and out.finish_reason("length") == "length"
    return msg


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_and_char_by_char(case):
    assert check(case, [case[2]]) == check(case, list(case[2]))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_split_pair(case):
    text = case[2]
    whole = check(case, [text])
    step = 1 if len(text) <= 120 else 3        # every pair of the shorter answers; a third of the rest
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            out, _ = run(case[1], [text[:i], text[i:j], text[j:]])
            assert out.message() == whole, (i, j)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_by_token(case):
    tok = build_qwen_tokenizer()
    ids = tok.encode(case[2], add_special_tokens=False).ids
    pieces, prev = [], ""
    for n in range(1, len(ids) + 1):
        cur = tok.decode(ids[:n], skip_special_tokens=False)
        if not cur.endswith("\ufffd"):
            pieces.append(cur[len(prev):])
            prev = cur
    assert "".join(pieces) == case[2]
    check(case, pieces)


def test_name_comes_before_arguments_and_strings_stream():
    case = CASES[0]
    text = case[2]
    _, deltas = run(case[1], list(text))
    first = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert deltas[first]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[first + 1:] if "tool_calls" in d
              and d["tool_calls"][0]["index"] == 0]
    assert len(pieces) > 10 and pieces[0] == '{"city": "'      # the string value streams as written


def test_no_reasoning_parser_keeps_think_in_content():
    out, _ = run({"in_think": False, "tool_form": None}, ["<think>\nhm\n</think>\n\nHi"], reasoning=False)
    assert out.message() == {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHi"}


@pytest.mark.parametrize("schema, text, value", [
    ({"type": "integer"}, "7", 7), ({"type": "integer"}, "7.0", 7), ({"type": "number"}, "7", 7),
    ({"type": "number"}, "1e3", 1000.0), ({"type": "boolean"}, "FALSE", False), ({"type": "boolean"}, "yes", "yes"),
    ({"type": "array"}, "(1, 2)", "(1, 2)"), ({"type": "object"}, "not json", "not json"),
    ({"type": "string"}, "null", "null"), ({}, "5", "5"), ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
    ({"type": ["string", "integer"]}, "5", "5"),
])
def test_convert(schema, text, value):
    got = convert(text, param_types(schema))
    assert got == value and type(got) is type(value)
