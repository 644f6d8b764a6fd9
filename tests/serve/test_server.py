"""The OpenAI-compatible server, live in a subprocess (`specfire serve`), driven by the real `openai`
client and by raw HTTP for the error cases."""
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from serving import mixed_chats, start_server, stop
from tinytok import make_tok_checkpoint

KEY = "sk-test-key"
NAME = "tiny"
MAX_SEQ = 1024


@pytest.fixture(scope="module")
def server(tinytok_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    path = tinytok_ckpt
    log = str(root / "server.log")
    proc, base = start_server([path, "--api-key", KEY, "--served-model-name", NAME, "--max-seq-len", str(MAX_SEQ)],
                              log)
    yield {"base": base, "proc": proc, "path": path, "log": log}
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server, path, body=None, raw=None, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server["base"] + path, content=content, headers=headers, timeout=60)


def _metric(server, name, **labels):
    text = httpx.get(server["base"] + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"specfire:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


MSGS = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}


def test_chat_stream_equals_nonstream(client):
    full = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    t = full.model_extra["timings"]
    assert t["ttft_ms"] > 0 and t["prefill_tok_s"] > 0 and "mean_accept_len" in t

    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_equals_nonstream(client):
    full = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage.completion_tokens == 16 or full.choices[0].finish_reason == "stop"


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server["base"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_per_request_speculation_same_greedy_text(client):
    texts, routes = {}, {}
    for mode in ("off", "mtp", "ngram", "auto"):
        r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=24, temperature=0,
                                           extra_body={"speculation": {"mode": mode, "k": 2}})
        texts[mode] = r.choices[0].message.content
        routes[mode] = r.model_extra["timings"]["route"]
    assert len(set(texts.values())) == 1, texts
    assert routes["off"] == "ar" and routes["mtp"] == "mtp" and routes["ngram"] == "ngram"


def test_stop_string(client):
    full = client.completions.create(model=NAME, prompt="Hello", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 8
    stop = full[4:6]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt="Hello", max_tokens=24, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=NAME, prompt="Once upon", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


ERRORS = [
    ("/v1/chat/completions", None, '{"messages": [', 400, None),
    ("/v1/chat/completions", None, "[1, 2]", 400, None),
    ("/v1/chat/completions", {"max_tokens": 4}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, None, 400, "messages[0].role"),
    ("/v1/completions", {"max_tokens": 4}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 0}, None, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, None, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, None, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, None, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": MSGS, "frequency_penalty": "high"}, None, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, None, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, None, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "speculation": {"mode": "mtp", "k": 0}}, None, 400, "speculation.k"),
    ("/v1/completions", {"prompt": "hi", "speculation": {"mode": "fast"}}, None, 400, "speculation.mode"),
    ("/v1/completions", {"prompt": "hi", "speculation": 3}, None, 400, "speculation"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello " * (MAX_SEQ + 50)}, None, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * (MAX_SEQ + 50)}]}, None, 400,
     "messages"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, None, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": 7}, None, 400, "model"),
]


def test_n_choices_are_the_requests_alone(client):
    """n = 3: three choices indexed 0..2, each the request alone (a seeded one with seed + i);
    usage counts the prompt once; streamed choices carry their index and equal the whole response."""
    kw = dict(model=NAME, prompt="Once upon", max_tokens=10, temperature=1.0, top_p=0.95)
    alone = [client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    full = client.completions.create(seed=7, n=3, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2] and [c.text for c in full.choices] == alone
    one = client.completions.create(seed=7, **kw)
    assert full.usage.prompt_tokens == one.usage.prompt_tokens
    assert full.usage.completion_tokens == sum(
        client.completions.create(seed=7 + i, **kw).usage.completion_tokens for i in range(3))
    chunks = list(client.completions.create(seed=7, n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == alone and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content      # greedy: alike
    streamed = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0, n=2,
                                                   stream=True))
    roles = sorted(ch.index for c in streamed for ch in c.choices if ch.delta.role == "assistant")
    assert roles == [0, 1]
    got = ["", ""]
    for c in streamed:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
    assert got == [chat.choices[0].message.content] * 2


@pytest.mark.parametrize("path,body,raw,status,param", ERRORS)
def test_errors_then_good_request(server, path, body, raw, status, param):
    r = _post(server, path, body, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"]
    good = _post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_auth_and_unknown_route(server, client):
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"prompt": "hi"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["base"] + "/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=-3)
    r = httpx.get(server["base"] + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_concurrent_requests_match_sequential(client):
    prompts = ["def f(x):", "The quick brown fox", "Tip 1:", "Once upon a time"]
    kw = dict(model=NAME, max_tokens=24, temperature=0)
    seq = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    got = [None] * 4

    def go(i):
        s = i % 2 == 1  # mix streaming and non-streaming
        if s:
            got[i] = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[i], stream=True, **kw))
        else:
            got[i] = client.completions.create(prompt=prompts[i], **kw).choices[0].text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == seq


CHATS = mixed_chats(40, ar_tokens=80)   # the AR chat, the fastest, streams longest


def test_concurrent_chats_stream_at_once_and_match_alone(client):
    """Four simultaneous streamed chats (off, MTP, seeded sampled n-gram, penalised auto with a stop
    string) each get their first token before any of them ends, and each streams the text it
    gives alone."""
    alone = [client.chat.completions.create(model=NAME, **kw).choices[0].message.content for kw in CHATS]
    got: list = [None] * 4
    first: list = [None] * 4
    ended: list = [None] * 4

    start = threading.Barrier(4)            # sent together: a thread started late is not a late stream

    def go(i):
        text = ""
        start.wait(30)
        for c in client.chat.completions.create(model=NAME, stream=True, **CHATS[i]):
            if c.choices and c.choices[0].delta.content:
                if first[i] is None:
                    first[i] = time.perf_counter()
                text += c.choices[0].delta.content
        ended[i] = time.perf_counter()
        got[i] = text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone
    assert max(first) < min(ended), (first, ended)


def test_metrics_count_running_and_waiting(server):
    """Six long streams on four slots (the CPU default): four run, two wait in line, the KV in use is
    the blocks the running four have grown to (a share of the pool: more than none, at most all);
    when the clients leave, every one ends and the gauges return to 0."""
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True, "stream": True}
    stop_all = threading.Event()

    def go():
        with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            for _ in r.iter_lines():
                if stop_all.is_set():
                    return

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 30
        seen = None
        while time.time() < deadline:
            seen = (_metric(server, "num_requests_running"), _metric(server, "num_requests_waiting"),
                    _metric(server, "kv_cache_usage_perc"))
            if seen[:2] == (4.0, 2.0) and 0.0 < seen[2] <= 1.0:
                break
            time.sleep(0.05)
        assert seen[:2] == (4.0, 2.0) and 0.0 < seen[2] <= 1.0, seen
    finally:
        stop_all.set()
        for t in threads:
            t.join(60)
    deadline = time.time() + 30
    while (_metric(server, "num_requests_running"), _metric(server, "num_requests_waiting"),
           _metric(server, "kv_cache_usage_perc")) != (0.0, 0.0, 0.0):
        assert time.time() < deadline, "the abandoned streams did not end"
        time.sleep(0.1)


def test_disconnect_mid_stream_stops_generation(server, client):
    aborted0 = _metric(server, "request_success_total", finished_reason="abort") or 0.0
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        it = r.iter_lines()
        for _ in range(3):
            next(it)
    # the server is not wedged: a new request is served, and the abandoned one ended as 'abort'
    t0 = time.time()
    r = client.completions.create(model=NAME, prompt="ok", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    deadline = time.time() + 10
    while (_metric(server, "request_success_total", finished_reason="abort") or 0.0) < aborted0 + 1:
        assert time.time() < deadline, "the abandoned generation was not stopped"
        time.sleep(0.1)
    assert time.time() - t0 < 20


def test_metrics(server, client):
    client.completions.create(model=NAME, prompt="x", max_tokens=6, temperature=0,
                              extra_body={"speculation": {"mode": "mtp", "k": 3}})
    bad = httpx.post(server["base"] + "/v1/completions", json={"model": NAME, "prompt": "x", "temperature": -1},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30)     # its own 400: any test order
    assert bad.status_code == 400
    text = httpx.get(server["base"] + "/metrics").text
    assert "# TYPE specfire:time_to_first_token_seconds histogram" in text
    assert "# TYPE specfire:inter_token_latency_seconds histogram" in text
    assert _metric(server, "generation_tokens_total") > 0 and _metric(server, "prompt_tokens_total") > 0
    assert _metric(server, "time_to_first_token_seconds_count") >= 1
    assert _metric(server, "spec_decode_num_drafts_total") >= 1
    assert _metric(server, "spec_decode_num_draft_tokens_total") >= 3
    assert _metric(server, "spec_decode_num_accepted_tokens_per_pos_total", position="0") is not None
    assert _metric(server, "http_errors_total", status="400") >= 1
    assert _metric(server, "num_requests_running") == 0


def test_battery_against_server(server, capsys):
    from specfire.cli import main
    from specfire.serve.battery import PROMPTS

    rc = main(["bench", "battery", "--url", server["base"], "--api-key", KEY, "--served-model-name", NAME,
               "-n", "6", "--identity", "--spec", "mtp", "--spec-k", "2"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and lines[-1]["identity"] is True and lines[-1]["cells"] == ["spec=off", "spec=mtp"]
    rows = lines[:-1]
    assert len(rows) == 2 * len(PROMPTS)
    assert all(r["saw_done"] and r["gen"] >= 1 and r["ctx"] > 5 for r in rows)
    # the second cell re-sends each chat: it resumes where the first one's messages ended
    assert all(r["cached"] == 0 for r in rows if r["spec"] == "off")
    assert all(0 < r["cached"] < r["ctx"] for r in rows if r["spec"] == "mtp")
    assert {r["tau"] >= 1.0 for r in rows if r["spec"] == "mtp"} == {True}


def test_sigterm_is_clean(tinytok_ckpt, tmp_path):
    """SIGTERM with a long stream in flight: the process ends promptly with status 0 (its own server:
    the module's stays up for the other tests, whatever order they run in)."""
    path = tinytok_ckpt
    log = str(tmp_path / "server.log")
    proc, base = start_server([path, "--api-key", KEY, "--max-seq-len", str(MAX_SEQ)], log)
    server = {"base": base, "proc": proc, "log": log}
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln]
    # the stream was ended by the server (not cut off after the grace period) and said why
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    with open(server["log"]) as f:
        assert "server stopped" in f.read()


def test_in_process_app_without_mtp_head(tmp_path):
    """build_app over an LLM in this process (fastapi's TestClient): a model with no MTP head refuses
    speculation mode 'mtp' with a 400 naming speculation.mode, and serves 'auto' on the AR route."""
    from fastapi.testclient import TestClient

    from specfire import LLM
    from specfire.serve.http import build_app

    path = make_tok_checkpoint(str(tmp_path / "nomtp"), seed=2, mtp=False)
    with LLM(path, progress=False) as llm, TestClient(build_app(llm, "nomtp")) as tc:
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "speculation": {"mode": "mtp"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.mode"
        assert "MTP head" in r.json()["error"]["message"]
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                             "speculation": "auto"})
        assert r.status_code == 200 and r.json()["timings"]["route"] == "ar"
        assert tc.get("/v1/models").json()["data"][0]["id"] == "nomtp"  # no API key: open


def test_a_request_is_routed_once(tmp_path, monkeypatch):
    """The route is decided when the request is checked and handed to the engine with it: one
    call of the route selector per request (streamed or not), and the stats carry that decision."""
    from fastapi.testclient import TestClient

    from specfire import LLM
    from specfire.runtime import engine
    from specfire.serve.http import build_app

    calls = []
    real = engine.select_route
    monkeypatch.setattr(engine, "select_route", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    path = make_tok_checkpoint(str(tmp_path / "routed"), seed=2)
    with LLM(path, progress=False) as llm, TestClient(build_app(llm, "routed")) as tc:
        for body in ({"prompt": "hi", "max_tokens": 4, "temperature": 0, "speculation": {"mode": "mtp", "k": 2}},
                     {"prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True, "speculation": "ngram"}):
            calls.clear()
            r = tc.post("/v1/completions", json=body)
            assert r.status_code == 200 and len(calls) == 1, (body, calls)
        calls.clear()
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                             "speculation": {"mode": "mtp", "k": 2}})
        assert r.json()["timings"]["route"] == "mtp" and len(calls) == 1
