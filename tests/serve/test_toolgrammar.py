"""serve/toolgrammar.py's XML call form on a Qwen-style tokenizer: a string parameter's maxLength,
minLength and pattern bound the text the model may write (a JSON Schema pattern searches, unless
anchored); a keyword the text form cannot enforce is a 400 naming the tool and the parameter."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from qwenstyle import qwen_ckpt
from specfire.grammar import GrammarCompiler
from specfire.params import SamplingParams
from specfire.serve.schema import RequestError
from specfire.serve.toolgrammar import tool_grammar

TOOLS = [{"type": "function", "function": {"name": "send", "parameters": {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
    "note": {"type": "string", "maxLength": 5},
    "tag": {"type": ["string", "null"], "minLength": 2, "maxLength": 3, "pattern": "x|y$"}},
    "required": ["code", "note", "tag"]}}}]


@pytest.fixture(scope="module")
def tok(ckpt_cache):
    from specfire.tokenizer import Tokenizer

    return Tokenizer(qwen_ckpt(ckpt_cache, "xml"))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, [tok.tok.token_to_id("<|im_end|>")])


def call(code: str, note: str, tag: str) -> str:
    return (f"<tool_call>\n<function=send>\n<parameter=code>\n{code}\n</parameter>\n<parameter=note>\n{note}\n"
            f"</parameter>\n<parameter=tag>\n{tag}\n</parameter>\n</function>\n</tool_call>")


def accepts(compiler, tok, text: str) -> bool:
    m = compiler.matcher(tool_grammar(TOOLS, "qwen3_xml", "send", set(tok.template.added)))
    ids = tok.encode(text)
    return m.advance(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("code, note, tag, ok", [
    ("AB1", "hi", "ax", True), ("AB1", "", "yy", True), ("AB1", "héllo", "zzy", True),
    ("AB12", "hi", "ax", False), ("xAB1", "hi", "ax", False), ("ab1", "hi", "ax", False),   # pattern anchored
    ("AB1", "hello!", "ax", False),                                                         # note > 5
    ("AB1", "hi", "x", False), ("AB1", "hi", "abcx", False),                                # tag length 2..3
    ("AB1", "hi", "xa", True), ("AB1", "hi", "ya", False), ("AB1", "hi", "ab", False),      # x anywhere | y at end
])
def test_string_bounds_and_pattern_are_enforced(compiler, tok, code, note, tag, ok):
    assert accepts(compiler, tok, call(code, note, tag)) is ok


def test_sampled_calls_keep_the_bounds(compiler, tok):
    """Random decoding inside the mask: every call it ends with keeps every string constraint."""
    rnd = random.Random(3)
    spec = tool_grammar(TOOLS, "qwen3_xml", "send", set(tok.template.added))
    eos = compiler.eos_ids[0]
    for _ in range(4):
        m, ids = compiler.matcher(spec), []
        while not m.is_done() and len(ids) < 400:
            t = rnd.choice([t for t in np.nonzero(m.allowed())[0].tolist() if t != eos])
            assert m.advance([t]) == 1
            ids.append(t)
        text = tok.decode(ids)
        got = dict(re.findall(r"<parameter=(\w+)>\n(.*?)\n</parameter>", text, re.S))
        assert m.is_done() and set(got) == {"code", "note", "tag"}, text
        assert re.fullmatch(r"[A-Z]{2}[0-9]", got["code"]) and len(got["note"]) <= 5, got
        assert 2 <= len(got["tag"]) <= 3 and re.search("x|y$", got["tag"]), got


@pytest.mark.parametrize("sub, word", [
    ({"type": "string", "format": "email"}, "'format' 'email' cannot be enforced"),
    ({"type": "string", "pattern": "a(?=b)"}, "look-around"),
    ({"type": "string", "pattern": "(^a)b"}, "cannot be enforced"),
    ({"type": "string", "pattern": 5}, "'pattern' must be a string"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "no text fits"),
    ({"type": "string", "maxLength": -1}, "'maxLength' must be a non-negative integer"),
])
def test_a_string_keyword_it_cannot_enforce_is_refused(sub, word):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "mail", "parameters": {
        "type": "object", "properties": {"to": sub}}}}]
    for named in (None, "mail"):
        with pytest.raises(RequestError) as e:
            tool_grammar(tools, "qwen3_xml", named)
        assert e.value.param == "tools[1].function.parameters.properties.to" and e.value.status == 400
        assert "tool 'mail', parameter 'to'" in e.value.message and word in e.value.message, e.value.message
    tool_grammar(tools, "qwen3_xml", "send")          # a call of the other tool does not meet the schema


def test_refusal_reaches_the_client_as_a_400(ckpt_cache):
    from fastapi.testclient import TestClient

    from specfire import LLM
    from specfire.serve.http import build_app

    tools = [{"type": "function", "function": {"name": "mail", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "format": "email"}}}}}]
    with LLM(qwen_ckpt(ckpt_cache, "xml"), device="cpu", spec="off", max_seq_len=1024, progress=False) as llm:
        with TestClient(build_app(llm, "m")) as tc:
            r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "tools": tools, "tool_choice": "required", "max_tokens": 4})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tools[0].function.parameters.properties.to" and "'format'" in err["message"]
            ok = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": tools, "max_tokens": 4})
            assert ok.status_code == 200, ok.text               # auto: no grammar, nothing to enforce


# ---- where the calls start when the model reasons -------------------------------------------------

JSON_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TIME = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("thinking, text, ok", [
    (True, "<think>\nThe user wants the time.\n</think>\n\n" + JSON_CALL, True),   # reasons first, then calls
    (True, JSON_CALL, True),                                                     # or calls at once
    (True, "<think>\nhm\n</think>\n\nSure: " + JSON_CALL, False),                # nothing but calls after it
    (True, "<think>\nhm", False),                                                # the block must end
    (False, "<think>\nhm\n</think>\n\n" + JSON_CALL, False),     # the prompt closed the block: calls only
    (False, JSON_CALL, True),
])
def test_required_calls_after_a_think_block_the_model_opens(ckpt_cache, thinking, text, ok):
    """An earlier Qwen3 template with thinking on leaves the think block to the model (no `<think>`
    in the generation prompt): as in vLLM, it may reason until `</think>` before the calls are
    enforced; with thinking off the prompt holds a closed block and the calls start at once."""
    from specfire import LLM
    from specfire.serve.chat import prepare_chat
    from specfire.serve.chat_options import ChatOptions

    with LLM(qwen_ckpt(ckpt_cache, "json"), device="cpu", spec="off", max_seq_len=1024, progress=False) as llm:
        prep = prepare_chat(llm, [{"role": "user", "content": "Time?"}],
                            {"tools": TIME, "tool_choice": "required"}, {"enable_thinking": thinking}, ChatOptions())
        tok = llm.tokenizer
        assert prep.think_end is None                        # no block open in the prompt: no wait for one
        spec = prep.params(SamplingParams()).structured_outputs
        m = GrammarCompiler(tok, [tok.tok.token_to_id("<|im_end|>")]).matcher(spec)
        ids = tok.encode(text)
        assert (m.advance(ids) == len(ids) and m.is_accepting()) is ok


def test_an_open_think_block_delays_the_calls_until_it_closes(ckpt_cache):
    """Qwen3.5 / 3.6 open the block in the prompt: the grammar starts after `</think>`, no think rule."""
    from specfire import LLM
    from specfire.serve.chat import prepare_chat
    from specfire.serve.chat_options import ChatOptions

    with LLM(qwen_ckpt(ckpt_cache, "xml"), device="cpu", spec="off", max_seq_len=1024, progress=False) as llm:
        prep = prepare_chat(llm, [{"role": "user", "content": "Time?"}], {"tools": TIME, "tool_choice": "required"},
                            {}, ChatOptions())
    spec = prep.params(SamplingParams()).structured_outputs
    assert spec.after == "</think>" and not spec.think


def plain(code: dict) -> list[dict]:
    """The tool with `code` as given and two unbounded string parameters."""
    return [{"type": "function", "function": {"name": "send", "parameters": {"type": "object", "properties": {
        "code": code, "note": {"type": "string"}, "tag": {"type": "string"}}, "required": ["code", "note", "tag"]}}}]


@pytest.mark.parametrize("code, value, ok", [
    ({"type": "string"}, "any text", True), ({"type": "integer"}, "12", True), ({"type": "integer"}, "x", False),
    ({"enum": ["a", "b"]}, "a", True), ({"enum": ["a", "b"]}, "c", False),
    ({"enum": ["a", 1, None]}, "a", True), ({"enum": ["a", 1, None]}, "1", True),      # mixed: others as JSON
    ({"enum": ["a", 1, None]}, "null", True), ({"enum": ["a", 1, None]}, "2", False),
])
def test_a_call_with_unbounded_strings_ends(compiler, tok, code, value, ok):
    """Unbounded string parameters keep the call closable (its </tool_call> accepted), and an
    enum, mixed types too, allows exactly its values."""
    m = compiler.matcher(tool_grammar(plain(code), "qwen3_xml", "send", set(tok.template.added)))
    ids = tok.encode(call(value, "a note", "t"))
    assert (m.advance(ids) == len(ids) and m.is_accepting()) is ok
