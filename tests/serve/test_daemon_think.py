"""The daemon's `messages` generates follow the chat endpoint's rules for think blocks
(test_think_grammar.py): a structured output starts after the think block the prompt opened, after
an optional one the model writes, or at the first token with thinking off or no reasoning parser;
token and done events split the answer into `reasoning` and `content` as the HTTP deltas and
message do. Each case is checked against the HTTP path run in process (serve/chat.prepare_chat,
the engine, AssistantOutput)."""
import pytest

from qwenstyle import qwen_ckpt
from test_daemon import Pipe

USER = [{"role": "user", "content": "Where?"}]
CHOICE = {"guided_choice": ["yes", "no"]}


def http_answer(path, kwargs=None, parser="auto", **sampling):
    """What /v1/chat/completions answers for USER with a guided_choice: (text, message, prompt ids)."""
    from specfire import LLM, SamplingParams
    from specfire.grammar import spec_from_fields
    from specfire.serve.chat import prepare_chat
    from specfire.serve.chat_options import ChatOptions

    with LLM(path, device="cpu", spec="off", max_seq_len=1024, progress=False) as llm:
        prep = prepare_chat(llm, USER, {}, kwargs or {}, ChatOptions(reasoning_parser=parser))
        sp = prep.params(SamplingParams(structured_outputs=spec_from_fields(**CHOICE), **sampling))
        res = llm.generate(prep.ids, sp)
    out = prep.assistant()
    out.feed(res.text)
    out.finish()
    return res.text, out.message(), list(prep.ids)


def thinking_seed(path, max_tokens):
    """The first seed whose sampled answer (temperature 2) opens and closes a think block itself."""
    from specfire import LLM, SamplingParams
    from specfire.grammar import spec_from_fields
    from specfire.serve.chat import prepare_chat
    from specfire.serve.chat_options import ChatOptions

    with LLM(path, device="cpu", spec="off", max_seq_len=1024, progress=False) as llm:
        prep = prepare_chat(llm, USER, {}, {}, ChatOptions())
        for seed in range(200):
            sp = prep.params(SamplingParams(max_tokens=max_tokens, temperature=2.0, seed=seed,
                                            structured_outputs=spec_from_fields(**CHOICE)))
            res = llm.generate(prep.ids, sp)
            if res.text.lstrip().startswith("<think>") and res.finish_reason == "stop":
                return seed
    raise AssertionError("no seed in 0..199 makes the model write a think block")


@pytest.fixture(scope="module")
def daemon():
    d = Pipe()
    yield d
    d.close()


def generate(d, path, **fields):
    """Load `path` (if another is loaded) and run one messages generate: (token events, done)."""
    if getattr(d, "model", None) != path:
        d.send({"type": "load", "model": path, "params": {"max_seq_len": 1024, "spec": {"mode": "auto", "k": 2}}})
        assert d.recv()["type"] == "loaded"
        d.model = path
    d.send({"type": "generate", "id": "t", "attempt_id": 0, "messages": USER, **CHOICE, "speculation": "off",
            **fields})
    evs = d.until("done")
    assert evs[-1]["type"] == "done", evs[-1]
    return [e for e in evs if e["type"] == "token"], evs


def check_split(toks, done, text, msg, reasoning=True):
    """The events carry the HTTP answer: raw text, and its content (and reasoning) piece by piece."""
    assert "".join(e["text"] for e in toks) == text
    assert done["content"] == msg["content"]
    assert "".join(e["content"] for e in toks) == (msg["content"] or "")
    if reasoning:
        assert done["reasoning"] == msg["reasoning_content"]
        assert "".join(e["reasoning"] for e in toks) == (msg["reasoning_content"] or "")
    else:
        assert "reasoning" not in done and not any("reasoning" in e for e in toks)


def test_an_open_think_block_delays_the_grammar_and_goes_to_reasoning(daemon, ckpt_cache):
    """A Qwen3.5-style prompt opens the block: the choice is enforced after `</think>`, the block is
    `reasoning`, the choice `content` (greedy; MTP gives AR's bits)."""
    path = qwen_ckpt(ckpt_cache, "xml")
    text, msg, _ = http_answer(path, max_tokens=40)
    assert "</think>" in text and msg["reasoning_content"] and msg["content"] in ("yes", "no")   # the case
    for spec in ({"mode": "off"}, {"mode": "mtp", "k": 2}):
        toks, evs = generate(daemon, path, max_tokens=40, speculation=spec)
        check_split(toks, evs[-1], text, msg)
        assert evs[-1]["finish_reason"] == "stop"
    # a prompt generate is a completion: no split
    daemon.send({"type": "generate", "id": "p", "attempt_id": 1, "prompt": "Where?", "max_tokens": 4})
    evs = daemon.until("done")
    assert not any("content" in e or "reasoning" in e for e in evs)


def test_the_model_may_open_a_think_block_before_the_choice(daemon, ckpt_cache):
    """An earlier-Qwen3-style prompt opens no block: the model may write one, then the choice."""
    path = qwen_ckpt(ckpt_cache, "json")
    seed = thinking_seed(path, 120)
    text, msg, _ = http_answer(path, max_tokens=120, temperature=2.0, seed=seed)
    assert msg["reasoning_content"] and msg["content"] in ("yes", "no")
    toks, evs = generate(daemon, path, max_tokens=120, temperature=2.0, seed=seed)
    check_split(toks, evs[-1], text, msg)


def test_enable_thinking_false_reaches_the_template_and_the_grammar_starts_at_once(daemon, ckpt_cache):
    """chat_template_kwargs reach the template as over HTTP: with thinking off the prompt closes an
    empty block and the choice is the whole answer, even for a seed that thinks when allowed."""
    path = qwen_ckpt(ckpt_cache, "json")
    seed = thinking_seed(path, 120)
    off = {"enable_thinking": False}
    text, msg, ids = http_answer(path, off, max_tokens=120, temperature=2.0, seed=seed)
    assert text == msg["content"] in ("yes", "no") and msg["reasoning_content"] is None
    toks, evs = generate(daemon, path, max_tokens=120, temperature=2.0, seed=seed, chat_template_kwargs=off)
    assert evs[0]["type"] == "gen_start" and evs[0]["prompt_tokens"] == len(ids)
    assert len(ids) > len(http_answer(path, max_tokens=1)[2])        # the empty block is in the prompt
    check_split(toks, evs[-1], text, msg)
    for fields, word in (({"chat_template_kwargs": {"add_generation_prompt": False}},
                          "'chat_template_kwargs.add_generation_prompt' is set by the server"),
                         ({"chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object"),
                         ({"messages": None, "prompt": "hi", "chat_template_kwargs": off},
                          "'chat_template_kwargs' goes with 'messages'")):
        msg = {"type": "generate", "id": "k", "attempt_id": 2, "messages": USER, "max_tokens": 2, **fields}
        daemon.send({k: v for k, v in msg.items() if v is not None})
        ev = daemon.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["attempt_id"] == 2, ev
        assert word in ev["message"], ev


def test_reasoning_parser_none_starts_the_grammar_at_the_first_token(ckpt_cache):
    """`daemon --reasoning-parser none` (serve's flag): a think block is not the daemon's to know,
    so the choice starts at the first token even where the prompt opened one, and all is content."""
    path = qwen_ckpt(ckpt_cache, "xml")
    text, msg, _ = http_answer(path, parser="none", max_tokens=40)
    assert text == msg["content"] in ("yes", "no") and "reasoning_content" not in msg
    d = Pipe("--reasoning-parser", "none")
    try:
        toks, evs = generate(d, path, max_tokens=40)
        check_split(toks, evs[-1], text, msg, reasoning=False)
    finally:
        d.close()
    bad = Pipe("--reasoning-parser", "deepseek_r1")
    try:
        assert bad.proc.wait(timeout=60) == 2 and "--reasoning-parser" in bad.proc.stderr.read()
    finally:
        bad.close()


def test_tools_are_refused_saying_why(daemon, ckpt_cache):
    """The daemon parses no tool calls: `tools` and `tool_choice` that ask for any are refused
    naming the field and the endpoint that serves them; [] and "none", which ask for none, run."""
    path = qwen_ckpt(ckpt_cache, "xml")
    toks, evs = generate(daemon, path, max_tokens=40, tools=[], tool_choice="none")
    text, msg, _ = http_answer(path, max_tokens=40)
    check_split(toks, evs[-1], text, msg)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for fields, name in (({"tools": tools}, "tools"), ({"tools": tools, "tool_choice": "required"}, "tools"),
                         ({"tool_choice": "auto"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice")):
        daemon.send({"type": "generate", "id": "x", "attempt_id": 3, "messages": USER, "max_tokens": 2, **fields})
        ev = daemon.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["attempt_id"] == 3, ev
        assert ev["message"].startswith(f"'{name}' is not supported: the daemon parses no tool calls, "
                                        f"/v1/chat/completions does"), ev
