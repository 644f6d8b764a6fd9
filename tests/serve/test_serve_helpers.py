"""The serving helpers of LLM (what the servers use instead of engine internals) and the request
schema, in process."""
import time

import pytest
import torch

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.errors import PromptError, SpecfireError
from specfire.report import RequestFigures
from specfire.serve import schema, wire
from specfire.serve.wire import RequestError
from tinytok import make_tok_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tok_checkpoint(str(tmp_path_factory.mktemp("helpers") / "ckpt"), seed=4)
    with LLM(path, device="cpu", max_seq_len=96, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def nomtp(tmp_path_factory):
    path = make_tok_checkpoint(str(tmp_path_factory.mktemp("helpers") / "nomtp"), seed=4, mtp=False)
    with LLM(path, device="cpu", max_seq_len=96, progress=False) as m:
        yield m


def test_max_model_len(llm):
    assert llm.max_model_len == 96


@pytest.mark.parametrize("mode,max_tokens", [("off", 4), ("auto", 4), ("auto", 1), ("mtp", 4), ("ngram", 4)])
def test_preview_route_is_the_route_taken(llm, nomtp, mode, max_tokens):
    sp = SamplingParams(max_tokens=max_tokens)
    for m in (llm, nomtp):
        if mode == "mtp" and m is nomtp:
            with pytest.raises(SpecfireError, match="MTP head"):
                m.preview_route(sp, mode)
            with pytest.raises(SpecfireError, match="MTP head"):
                m.generate("hi", sp, mode)
            continue
        route, reason = m.preview_route(sp, SpecPolicy(mode=mode, k=2))
        st = m.generate("hi", sp, SpecPolicy(mode=mode, k=2)).stats
        if route != "auto":
            assert (route, reason) == (st["route"], st["route_reason"])
            continue
        # a measured `auto` settles its route while it runs: the preview says so, and the request
        # only ever ran routes this model can serve
        assert mode == "auto" and max_tokens > 1 and reason.startswith("auto")
        allowed = {"ar", "ngram"} | ({"mtp"} if m.mtp_loaded else set())
        assert st["route"] in allowed and set(st["routes"]) <= allowed


def test_prompt_ids_one_check(llm):
    assert llm.prompt_ids("def f(x):") == llm.tokenizer.encode("def f(x):")
    assert llm.prompt_ids([1, 2, 3]) == [1, 2, 3]
    cases = [("", "empty", False), ([], "empty", False), ([1, 10 ** 6], "out of range", False),
             ([1, True], "not an integer", False), ("a \ud800 b", "lone surrogate", False),
             ([5] * 96, "max_seq_len is 96", True), ("word " * 200, "max_seq_len is 96", True)]
    for prompt, word, too_long in cases:
        with pytest.raises(PromptError, match=word) as e:
            llm.prompt_ids(prompt)
        assert e.value.too_long is too_long, prompt


def test_an_absurdly_long_prompt_is_refused_without_tokenizing(llm):
    text = "x" * 20_000_000                     # tokenizing this would take tens of seconds
    t0 = time.perf_counter()
    with pytest.raises(PromptError, match="characters") as e:
        llm.prompt_ids(text)
    assert e.value.too_long and time.perf_counter() - t0 < 2.0


def test_figures_is_the_one_projection(llm):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    res = llm.generate("def f(x):", sp, "mtp")
    fig = llm.figures(res, sp)
    assert isinstance(fig, RequestFigures)
    st = res.stats
    assert (fig.prompt_tokens, fig.generated_tokens, fig.route, fig.cycles) == \
        (st["prompt_tokens"], st["generated_tokens"], "mtp", st["cycles"])
    assert fig.context_limited and fig.finish_reason == "length" and fig.generated_tokens < 200
    t = fig.timings(12.5)
    assert t["ttft_ms"] == 12.5 and t["prefill_ms"] == pytest.approx(1000 * st["prefill_s"])
    assert "cut short" in fig.summary() and f"{fig.prompt_tokens} prompt" in fig.summary()
    short = llm.figures(llm.generate("def f(x):", SamplingParams(max_tokens=3, ignore_eos=True)),
                        SamplingParams(max_tokens=3))
    assert not short.context_limited and "cut short" not in short.summary()


# ---- the request schema ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param,word", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "", "content": "y"}]}, "messages[1].role", "non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0]", "text part"),
    ({"messages": []}, "messages", "non-empty"),
    ({}, "messages", "required"),
    ({"messages": [{"role": "user"}], "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "boolean"),
    ({"messages": [{"role": "user"}], "max_tokens": True}, "max_tokens", "integer"),
    ({"messages": [{"role": "user"}], "temperature": "0.5"}, "temperature", "number"),
    ({"messages": [{"role": "user"}], "stop": ["a", 3]}, "stop", "strings"),
    ({"messages": [{"role": "user"}], "n": 0}, "n", "from 1 to 64"),
    ({"messages": [{"role": "user"}], "n": 65}, "n", "from 1 to 64"),
    ({"messages": [{"role": "user"}], "n": 2.0}, "n", "from 1 to 64"),
    ({"messages": [{"role": "user"}], "best_of": 2}, "best_of", "must be 1"),
])
def test_schema_errors_name_the_field(body, param, word):
    with pytest.raises(RequestError) as e:
        schema.validate(schema.ChatBody, body)
    assert e.value.param == param and word in e.value.message and param.split("[")[0] in e.value.message


def test_check_tree_depth_and_surrogates():
    wire.check_tree({"a": [[[1]]]}, max_depth=4)
    with pytest.raises(RequestError) as e:
        wire.check_tree({"a": [[[[1]]]]}, max_depth=4)
    assert e.value.param == "a[0][0][0]"
    with pytest.raises(RequestError) as e:
        wire.check_tree({"messages": [{"content": "ok"}, {"content": "\udc00"}]})
    assert e.value.param == "messages[1].content" and "surrogate" in e.value.message
    with pytest.raises(RequestError):
        wire.parse_json("[" * 100_000)


def test_seed_range():
    b = schema.validate(schema.CompletionBody, {"prompt": "x", "seed": 2 ** 63})
    with pytest.raises(RequestError) as e:
        schema.sampling_params(b, 4)
    assert e.value.param == "seed"
    b = schema.validate(schema.CompletionBody, {"prompt": "x", "seed": 2 ** 63 - 1})
    assert schema.sampling_params(b, 4).seed == 2 ** 63 - 1


# ---- fields the server does not honour are refused, never dropped ---------------------------------------

MSG = [{"role": "user", "content": "x"}]
REFUSED = [
    (schema.ChatBody, {"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    (schema.ChatBody, {"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
    (schema.ChatBody, {"logit_bias": {"5": 10}}, "logit_bias", "not built"),
    (schema.ChatBody, {"echo": True}, "echo", "/v1/completions"),
    (schema.ChatBody, {"top_logprobs": 21}, "top_logprobs", "0..20"),
    (schema.ChatBody, {"logprobs": 1}, "logprobs", "a boolean"),
    (schema.CompletionBody, {"logprobs": 21}, "logprobs", "0..20"),
    (schema.CompletionBody, {"logprobs": True}, "logprobs", "an integer"),
    (schema.ChatBody, {"max_token": 5}, "max_token", "not a field"),             # a typo is not dropped either
    (schema.ChatBody, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "not a field"),
    (schema.CompletionBody, {"suffix": "}"}, "suffix", "fill-in-the-middle"),
    (schema.CompletionBody, {"tools": []}, "tools", "not a field"),
    (schema.CompletionBody, {"use_beam_search": True}, "use_beam_search", "beam search"),
    (schema.GenerateMessage, {"chat_template_kwargs": [1]}, "chat_template_kwargs", "an object"),
    (schema.GenerateMessage, {"tools": [{"type": "function"}]}, "tools", "parses no tool calls"),
    (schema.GenerateMessage, {"tool_choice": "auto"}, "tool_choice", "parses no tool calls"),
]


@pytest.mark.parametrize("model,extra,param,word", REFUSED, ids=[r[2] for r in REFUSED])
def test_fields_not_honoured_are_refused(model, extra, param, word):
    body = {"prompt": "x"} if model is not schema.ChatBody else {"messages": MSG}
    with pytest.raises(RequestError) as e:
        schema.validate(model, {**body, **extra})
    assert e.value.param == param and f"'{param}'" in e.value.message and word in e.value.message


def test_fields_that_ask_for_nothing_are_accepted():
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"tools": [], "tool_choice": "auto"},
                  {"response_format": {"type": "text"}}, {"parallel_tool_calls": True}, {"user": "u-1"},
                  {"logit_bias": {}}, {"top_logprobs": 0}, {"tools": None, "response_format": None}):
        schema.validate(schema.ChatBody, {"messages": MSG, **extra})
    schema.validate(schema.CompletionBody, {"prompt": "x", "user": "u-1", "logit_bias": {}})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("extra, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice"),
])
def test_structured_output_fields_reach_sampling_params(extra, kind, param):
    for model, body in ((schema.ChatBody, {"messages": MSG}), (schema.CompletionBody, {"prompt": "x"}),
                        (schema.GenerateMessage, {"prompt": "x"})):
        sp = schema.sampling_params(schema.validate(model, {**body, **extra}), 4)
        assert (sp.structured_outputs.kind, sp.structured_outputs.param) == (kind, param)


def test_logprob_fields_reach_sampling_params():
    def sp(model, **kw):
        body = {"messages": MSG} if model is schema.ChatBody else {"prompt": "x"}
        p = schema.sampling_params(schema.validate(model, {**body, **kw}), 4)
        return p.logprobs, p.prompt_logprobs

    assert sp(schema.ChatBody) == (None, None) and sp(schema.ChatBody, logprobs=True) == (0, None)
    assert sp(schema.ChatBody, logprobs=True, top_logprobs=4) == (4, None)
    assert sp(schema.CompletionBody, logprobs=3) == (3, None) and sp(schema.CompletionBody, logprobs=2, echo=True) == (2, 2)
    assert sp(schema.CompletionBody, echo=True) == (None, None) and sp(schema.GenerateMessage, logprobs=1) == (1, None)
    with pytest.raises(RequestError) as e:
        sp(schema.ChatBody, top_logprobs=2)
    assert e.value.param == "top_logprobs" and "'logprobs': true" in e.value.message
    for bad, param in (({"response_format": {"type": "xml"}}, "response_format.type"),
                       ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")):
        with pytest.raises(RequestError) as e:
            schema.sampling_params(schema.validate(schema.ChatBody, {"messages": MSG, **bad}), 4)
        assert e.value.param == param
    schema.validate(schema.GenerateMessage, {"type": "generate", "id": 1, "attempt_id": 0, "prompt": "x"})


def test_end_fields_map_to_sampling_params(llm):
    b = schema.validate(schema.CompletionBody, {"prompt": "x", "max_tokens": 9, "min_tokens": 3,
                                                "stop_token_ids": [1, 2], "include_stop_str_in_output": True,
                                                "skip_special_tokens": False})
    sp = schema.sampling_params(b, 4)
    assert (sp.min_tokens, sp.stop_token_ids, sp.include_stop_str_in_output, sp.skip_special_tokens) == \
        (3, (1, 2), True, False)
    plain = schema.sampling_params(schema.validate(schema.CompletionBody, {"prompt": "x"}), 4)
    assert (plain.min_tokens, plain.stop_token_ids, plain.include_stop_str_in_output, plain.skip_special_tokens) == \
        (0, (), False, True)                                                   # vLLM's defaults
    for body, param in (({"min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                        ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"stop_token_ids": 7}, "stop_token_ids"),
                        ({"skip_special_tokens": "no"}, "skip_special_tokens")):
        with pytest.raises(RequestError) as e:
            schema.sampling_params(schema.validate(schema.CompletionBody, {"prompt": "x", **body}), 4)
        assert e.value.param == param and param in e.value.message, body
    v = llm.cfg.vocab_size
    sp = schema.sampling_params(schema.validate(schema.CompletionBody, {"prompt": "x", "stop_token_ids": [0, v]}), 4)
    with pytest.raises(RequestError) as e:
        schema.check_route(llm, sp, llm.spec)
    assert e.value.param == "stop_token_ids" and f"is {v}, outside the vocabulary" in e.value.message


def test_http_refuses_tools_and_serves_the_end_fields(llm):
    """Through the app: tools this template cannot show, tool_choice required without tools and a
    schema llguidance cannot compile are a 400 naming the field; the vLLM end fields reach the
    engine (the text is the in-process one)."""
    from fastapi.testclient import TestClient

    from specfire.serve.app import build_app

    plain = llm.generate("def f(x):", SamplingParams(max_tokens=12, ignore_eos=True), spec="off")
    kw = dict(max_tokens=12, min_tokens=3, stop_token_ids=[plain.token_ids[0], plain.token_ids[4]])
    want = llm.generate("def f(x):", SamplingParams(**kw), spec="off")
    with TestClient(build_app(llm, "t")) as tc:
        for extra, param in (({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
                             ({"guided_json": {"type": "nope"}}, "guided_json"),
                             ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
                              "response_format.json_schema.schema"),
                             ({"tool_choice": "required"}, "tool_choice")):
            r = tc.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = tc.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "tools": [], "tool_choice": "none",
                                                  "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text
        r = tc.post("/v1/completions", json={"prompt": "def f(x):", "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["completion_tokens"] == len(want.token_ids) > 3
        r = tc.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [llm.cfg.vocab_size]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


# ---- multi-turn prefix reuse ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same checkpoint twice, both prefilling in 16-row pieces: one reusing prefixes, one cold."""
    path = make_tok_checkpoint(str(tmp_path_factory.mktemp("prefix") / "ckpt"), seed=7)
    with LLM(path, device="cpu", max_seq_len=512, progress=False) as warm, \
            LLM(path, device="cpu", max_seq_len=512, progress=False) as cold:
        warm.enable_prefix_cache(64 << 20, piece=16)
        cold.enable_prefix_cache(0, piece=16)
        cold.engine.trunk.piece = 16        # same forwards as the warm one, no reuse
        yield path, warm, cold


def test_multi_turn_reuses_the_prefix_with_identical_output(pair):
    path, warm, cold = pair
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prev = 0                                       # the previous turn's prompt length
    for turn in range(3):
        for i, (mode, sp) in enumerate( (("off", SamplingParams(max_tokens=10)), ("mtp", SamplingParams(max_tokens=10)),
                         ("ngram", SamplingParams(max_tokens=10)),
                         ("mtp", SamplingParams(max_tokens=10, temperature=0.8, seed=5)))):
            a, b = cold.chat(msgs, sp, mode), warm.chat(msgs, sp, mode)
            assert a.token_ids == b.token_ids, (turn, mode)
            own = ((len(b.prompt_token_ids) - 1) // 16) * 16
            assert a.stats["cached_tokens"] == 0
            # a turn's first request resumes from the end of the previous turn's prompt, the others
            # from that or the last piece multiple of their own
            assert b.stats["cached_tokens"] == (prev if i == 0 else max(prev, own)), (turn, mode, b.stats["cached_tokens"])
        prev = len(b.prompt_token_ids)
        msgs = msgs + [{"role": "assistant", "content": a.text}, {"role": "user", "content": f"Turn {turn}: again."}]
    # the logits of a resumed prefill are the bits of a cold one (cut where the chat's turns end)
    ids = warm.chat_ids(msgs)
    rows, cached = warm.engine.prefix.prefill(ids, torch.tensor(ids), ends=ids.ends)
    cold.engine.trunk.begin()
    ref = cold.engine.trunk.prefill(torch.tensor(ids), ends=ids.ends)
    assert cached == prev and torch.equal(rows.logits, ref.logits) and torch.equal(rows.hidden, ref.hidden)


def test_prefix_cache_memory_is_bounded_and_can_be_off(pair):
    path, warm, cold = pair
    with LLM(path, device="cpu", max_seq_len=512, progress=False) as m:
        m.enable_prefix_cache(64 << 20, piece=16)
        one = m.generate(list(range(3, 40)), SamplingParams(max_tokens=2))
        size = m.engine.prefix.nbytes
        assert size > 0 and len(m.engine.prefix.entries) == 1 and one.stats["cached_tokens"] == 0
        m.enable_prefix_cache(int(2.5 * size), piece=16)      # room for two snapshots of this size
        for start in (3, 4, 5, 6):
            m.generate(list(range(start, start + 37)), SamplingParams(max_tokens=2))
            assert m.engine.prefix.nbytes <= 2.5 * size
        assert len(m.engine.prefix.entries) == 2
        assert m.generate(list(range(6, 60)), SamplingParams(max_tokens=2)).stats["cached_tokens"] == 32
        m.enable_prefix_cache(0)
        assert m.generate(list(range(6, 60)), SamplingParams(max_tokens=2)).stats["cached_tokens"] == 0


def test_http_reports_cached_tokens(pair):
    from fastapi.testclient import TestClient

    from specfire.serve.http import build_app

    path, warm, cold = pair
    msgs = [{"role": "user", "content": "Tell me about the lighthouse keeper and the bottle, in detail."}]
    with TestClient(build_app(warm, "w")) as tc:
        first = tc.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
        msgs2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And then?"}]
        second = tc.post("/v1/chat/completions", json={"messages": msgs2, "max_tokens": 6, "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == first["usage"]["prompt_tokens"]         # the end of the first turn's prompt
    assert second["timings"]["cached_tokens"] == cached
    assert second["choices"][0]["message"]["content"] == cold.chat(msgs2, SamplingParams(max_tokens=6)).text


def test_the_daemon_takes_one_choice():
    """The daemon's events carry one completion: n other than 1 is refused naming n (HTTP takes 1..64)."""
    with pytest.raises(RequestError) as e:
        schema.validate(schema.GenerateMessage, {"type": "generate", "prompt": "hi", "n": 2})
    assert e.value.param == "n" and "must be 1" in e.value.message
    assert schema.validate(schema.GenerateMessage, {"type": "generate", "prompt": "hi", "n": 1}).n == 1
    assert schema.validate(schema.ChatBody, {"messages": [{"role": "user", "content": "x"}], "n": 64}).n == 64


def test_chunk_crosses_the_pipe_unchanged():
    """A streamed chunk sent as plain data (serve/remote.py chunk_wire) comes back equal, logprobs
    (-inf included) and prompt logprobs (None for the first position) alike."""
    import pickle

    from specfire.runtime.engine import StreamChunk
    from specfire.runtime.output import TokenLogprobs
    from specfire.serve.remote import chunk_of, chunk_wire

    lps = [TokenLogprobs(7, -0.25, ((7, -0.25), (9, -1.5))), TokenLogprobs(3, float("-inf"))]
    for c in (StreamChunk("é", [7, 3], None, lps, [None, TokenLogprobs(4, -2.0, ((4, -2.0),))]),
              StreamChunk("", [5]), StreamChunk("ab", [], None, [], None)):
        got = chunk_of(pickle.loads(pickle.dumps(chunk_wire(c))))
        assert got == c and type(got.logprobs) is type(c.logprobs)
