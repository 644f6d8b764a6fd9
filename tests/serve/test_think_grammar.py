"""Where a chat request's structured output (response_format, guided_*, structured_outputs) starts
when the model reasons, as for tool_choice's grammar: after the think block the prompt opened
(Qwen3.5 / 3.6), after an optional one the model writes itself (earlier Qwen3 templates, thinking
on: no think tag in the generation prompt), at the first token with thinking off or no reasoning
parser. The answer's constraint stays exact either way; the reasoning parser splits the block out."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from qwenstyle import qwen_ckpt
from specfire import LLM
from specfire.grammar import GrammarCompiler, spec_from_fields
from specfire.params import SamplingParams
from specfire.serve.chat import prepare_chat
from specfire.serve.chat_options import ChatOptions

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "Where?"}]
THINK = "<think>\nThe user asks where; {\"city\": 1} is not it.\n</think>\n\n"
# request fields -> (an answer they allow, one they refuse)
FIELDS = {
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
                        '{"city": "Paris", "n": 2}', '{"city": "Oslo", "n": 2}'),
    "json_object": ({"response_format": {"type": "json_object"}}, '{"a": [1]}', "[1]"),
    "guided_regex": ({"guided_regex": "[a-c]{2,4}-[0-9]"}, "abc-7", "abcd5"),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, "no", "maybe"),
    "guided_grammar": ({"guided_grammar": 'start: "go " NUM\nNUM: /[0-9]+/\n'}, "go 42", "go x"),
    "structured_outputs": ({"structured_outputs": {"json": SCHEMA}}, '{"city": "Rome", "n": -1}', '{"city": "Rome"}'),
}


@pytest.fixture(scope="module")
def json_llm(ckpt_cache):
    """An earlier-Qwen3-style template: thinking on leaves the think block to the model."""
    with LLM(qwen_ckpt(ckpt_cache, "json"), device="cpu", spec="off", max_seq_len=1024, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def xml_llm(ckpt_cache):
    """A Qwen3.5-style template: the generation prompt opens the think block."""
    with LLM(qwen_ckpt(ckpt_cache, "xml"), device="cpu", spec="off", max_seq_len=1024, progress=False) as m:
        yield m


def placed(llm, fields, kwargs=None, opts=ChatOptions()):
    """The request's grammar as the server hands it to the engine, and its ChatPrep."""
    prep = prepare_chat(llm, USER, {}, kwargs or {}, opts)
    return prep.params(SamplingParams(structured_outputs=spec_from_fields(**fields))).structured_outputs, prep


def compiler(llm):
    tok = llm.tokenizer
    return GrammarCompiler(tok, [tok.tok.token_to_id("<|im_end|>")])


def accepts(llm, spec, text):
    m = compiler(llm).matcher(spec)
    ids = llm.tokenizer.encode(text)
    return m.advance(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("name", list(FIELDS))
def test_the_model_may_reason_before_the_answer(json_llm, name):
    fields, good, bad = FIELDS[name]
    spec, _ = placed(json_llm, fields)
    assert spec.think and spec.after is None
    assert accepts(json_llm, spec, THINK + good)             # (a) a think block, then the answer
    assert accepts(json_llm, spec, good)                     # (b) the answer at once
    assert not accepts(json_llm, spec, THINK + bad)          # (c) the answer's constraint holds after the block
    assert not accepts(json_llm, spec, bad)
    assert not accepts(json_llm, spec, THINK + "Sure: " + good)      # nothing but the answer after it
    assert not accepts(json_llm, spec, "<think>\nhm")                 # the block must end
    assert not accepts(json_llm, spec, THINK + THINK + good)          # one block


def test_an_open_think_block_delays_the_constraint_until_it_closes(xml_llm):
    """(d) The prompt opened the block: nothing is masked before `</think>`, the schema after it."""
    spec, prep = placed(xml_llm, FIELDS["response_format"][0])
    assert spec.after == "</think>" and not spec.think
    tok, v = xml_llm.tokenizer, xml_llm.cfg.vocab_size
    end, brace, word = tok.tok.token_to_id("</think>"), tok.encode("{")[0], tok.encode("hm")[0]
    c = xml_llm.engine.constraint(SamplingParams(structured_outputs=spec))
    out = c.mask(torch.zeros(3, v), [word, end])
    assert torch.isfinite(out[:2]).all()                                 # reasoning: anything goes
    allowed = torch.isfinite(out[2]).nonzero().flatten().tolist()
    assert brace in allowed and word not in allowed and tok.tok.token_to_id("<think>") not in allowed
    assert c.advance(tok.encode("reasoning </think>")) == len(tok.encode("reasoning </think>")) and not c.waiting
    assert prep.assistant().reasoning and prep.assistant().in_think
    # the layout a block's end leaves ("</think>\n\n") may come before the JSON, nothing else may
    good = FIELDS["response_format"][1]
    for text, ok in (("\n\n" + good, True), (good, True), ("Sure " + good, False)):
        m = compiler(xml_llm).matcher(spec)
        ids = tok.encode(text)
        assert (m.advance(ids) == len(ids) and m.is_accepting()) is ok, text


@pytest.mark.parametrize("kwargs, opts", [({"enable_thinking": False}, ChatOptions()),
                                          ({}, ChatOptions(reasoning_parser="none"))])
def test_thinking_off_or_no_reasoning_parser_starts_at_the_first_token(json_llm, kwargs, opts):
    """(e) With thinking off the prompt closes an empty block; with no reasoning parser a think block
    is not the server's to know: the grammar starts at the first token either way."""
    fields, good, _ = FIELDS["response_format"]
    spec, _ = placed(json_llm, fields, kwargs, opts)
    assert not spec.think and spec.after is None
    assert accepts(json_llm, spec, good) and not accepts(json_llm, spec, THINK + good)


def test_the_tools_grammar_and_the_body_s_are_placed_alike(json_llm):
    """One rule for both: tool_choice required gets the same optional block as a response_format."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"enable_thinking": False}):
        prep = prepare_chat(json_llm, USER, {"tools": tools, "tool_choice": "required"}, kwargs, ChatOptions())
        tool_spec = prep.params(SamplingParams()).structured_outputs
        body_spec, _ = placed(json_llm, FIELDS["guided_choice"][0], kwargs)
        assert (tool_spec.think, tool_spec.after) == (body_spec.think, body_spec.after) == (not kwargs, None)


def test_the_reasoning_parser_splits_the_block_from_the_answer(json_llm):
    """The response the optional block allows comes back as reasoning_content + the JSON content,
    streamed in any pieces or whole."""
    fields, good, _ = FIELDS["response_format"]
    spec, prep = placed(json_llm, fields)
    text = THINK + good
    assert accepts(json_llm, spec, text)
    for size in (1, 3, len(text)):
        out = prep.assistant()
        deltas = [d for i in range(0, len(text), size) for d in out.feed(text[i:i + size])] + out.finish()
        msg = out.message()
        assert msg["content"] == good and json.loads(msg["content"]) == {"city": "Paris", "n": 2}
        assert msg["reasoning_content"] == 'The user asks where; {"city": 1} is not it.'
        assert "".join(d.get("content", "") for d in deltas) == good
    out = prep.assistant()
    out.feed(good)
    out.finish()
    assert out.message()["content"] == good and out.message()["reasoning_content"] is None


def test_sampled_answers_keep_the_schema(json_llm):
    """Random decoding inside the mask (closing the block now and then): whatever the model writes,
    the content the parser returns validates the schema."""
    spec, prep = placed(json_llm, FIELDS["response_format"][0])
    comp, tok = compiler(json_llm), json_llm.tokenizer
    eos, end = comp.eos_ids[0], tok.tok.token_to_id("</think>")
    rnd, thought = random.Random(5), 0
    for _ in range(6):
        m, ids = comp.matcher(spec), []
        while not m.is_done() and len(ids) < 400:
            allowed = [t for t in np.nonzero(m.allowed())[0].tolist() if t != eos]
            t = end if end in allowed and rnd.random() < 0.1 else rnd.choice(allowed)
            assert m.advance([t]) == 1
            ids.append(t)
        assert m.is_done(), tok.decode(ids)
        out = prep.assistant()
        out.feed(tok.decode(ids))
        out.finish()
        got = json.loads(out.message()["content"])
        assert got["city"] in ("Paris", "Rome") and isinstance(got["n"], int) and set(got) == {"city", "n"}
        thought += out.message()["reasoning_content"] is not None
    assert thought                          # the walk took the think block at least once


def test_the_route_reason_names_the_optional_block(json_llm):
    spec, _ = placed(json_llm, FIELDS["guided_regex"][0])
    assert spec.think
    reason = json_llm.plan_route(SamplingParams(structured_outputs=spec), {"mode": "off"}).reason
    assert "after an optional think block" in reason
