"""`specfire serve` with its engine in a process of its own (serve/engine.py), against the same
model served in-thread (build_app over an LLM in this process): the same tokens, the same refusals;
a client leaving frees its request in the engine process; the engine dying fails what is in flight."""
import json
import os
import signal
import threading
import time

import httpx
import pytest

from procs import wait_gone
from serving import start_server, stop

NAME = "tiny"
MAX_SEQ = 512
ARGS = ["--served-model-name", NAME, "--max-seq-len", str(MAX_SEQ), "--generation-config", "none"]
MSGS = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def engine_pid(server_pid: int) -> int:
    """The server's one child: its engine process."""
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{tid}/children") as f:
            kids.update(int(x) for x in f.read().split())
    assert len(kids) == 1, kids
    pid = kids.pop()
    with open(f"/proc/{pid}/cmdline") as f:
        assert "specfire.serve.engine" in f.read().split("\0")
    return pid


@pytest.fixture(scope="module")
def served(tinytok_ckpt, tmp_path_factory):
    """The CLI server (engine process) and the in-thread app, over one checkpoint."""
    from fastapi.testclient import TestClient

    from specfire import LLM
    from specfire.serve.http import build_app

    log = str(tmp_path_factory.mktemp("eproc") / "server.log")
    proc, base = start_server([tinytok_ckpt, *ARGS], log)
    llm = LLM(tinytok_ckpt, max_seq_len=MAX_SEQ, generation_config="none", progress=False, threads=1)
    try:
        with TestClient(build_app(llm, NAME)) as tc:
            yield {"proc": proc, "base": base, "local": tc, "log": log}
    finally:
        llm.close()
        stop(proc)


def post(served, path, body):
    return httpx.post(served["base"] + path, json=body, timeout=60)


def sse_lines(r) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def metric(served, name, **labels):
    for line in httpx.get(served["base"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"specfire:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def answer(j: dict) -> list:
    """What must match between the two modes: each choice's text, logprobs and finish, and the usage."""
    return [[(c.get("text"), c.get("message"), c["logprobs"], c["finish_reason"]) for c in j["choices"]], j["usage"]]


def test_engine_runs_in_its_own_process(served):
    assert engine_pid(served["proc"].pid) != served["proc"].pid
    assert httpx.get(served["base"] + "/health").json() == {"status": "ok"}
    assert httpx.get(served["base"] + "/v1/models").json()["data"][0]["max_model_len"] == MAX_SEQ


def test_completion_and_streamed_chat_equal_in_thread(served):
    body = {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0, "logprobs": 2,
            "speculation": {"mode": "mtp", "k": 3}}
    remote, local = post(served, "/v1/completions", body), served["local"].post("/v1/completions", json=body)
    assert remote.status_code == local.status_code == 200
    assert answer(remote.json()) == answer(local.json())
    assert remote.json()["choices"][0]["logprobs"]["tokens"]
    chat = {"messages": MSGS, "max_tokens": 24, "temperature": 0, "stream": True, "logprobs": True,
            "top_logprobs": 1, "seed": 5, "stream_options": {"include_usage": True}}

    def pieces(lines):
        toks = [t["token"] for x in lines if x["choices"] for t in (x["choices"][0]["logprobs"] or {}).get("content", [])]
        text = "".join(x["choices"][0]["delta"].get("content") or "" for x in lines if x["choices"])
        return toks, text, lines[-1]["usage"]

    with httpx.stream("POST", served["base"] + "/v1/chat/completions", json=chat, timeout=60) as r:
        got = pieces(sse_lines(r))
    with served["local"].stream("POST", "/v1/chat/completions", json=chat) as r:
        want = pieces(sse_lines(r))
    assert got == want and len(got[0]) == got[2]["completion_tokens"] > 0


def test_concurrent_mixed_speculation_equal_alone(served):
    bodies = [{"prompt": f"count {i}:", "max_tokens": 20, "temperature": 0 if i % 2 else 0.8, "seed": i,
               "speculation": {"mode": mode, "k": 2}}
              for i, mode in enumerate(("off", "mtp", "ngram", "auto"))]
    alone = [answer(post(served, "/v1/completions", b).json()) for b in bodies]
    out: list = [None] * 4

    def go(i):
        out[i] = answer(post(served, "/v1/completions", bodies[i]).json())

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == alone


def test_client_leaving_frees_its_request(served):
    aborted = metric(served, "request_success_total", finished_reason="abort") or 0.0
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served["base"] + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        for _ in range(3):
            next(it)
        assert metric(served, "kv_cache_usage_perc") > 0
    deadline = time.time() + 10
    while (metric(served, "request_success_total", finished_reason="abort") or 0.0) < aborted + 1:
        assert time.time() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.05)
    # the slot is free in the engine process (its use comes from there) and nothing runs
    assert (metric(served, "num_requests_running"), metric(served, "kv_cache_usage_perc")) == (0.0, 0.0)


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 3, "speculation": {"mode": "bogus"}},
    {"prompt": "hi", "max_tokens": 3, "stop_token_ids": [10 ** 6]},
    {"prompt": "hi " * 2000, "max_tokens": 3},
    {"prompt": [10 ** 7], "max_tokens": 3},
    {"prompt": "hi", "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
    {"prompt": "hi", "max_tokens": 3, "temperature": -1},
], ids=["spec-mode", "stop-id", "too-long", "bad-id", "grammar", "temperature"])
def test_bad_input_gets_the_same_400(served, body):
    remote, local = post(served, "/v1/completions", body), served["local"].post("/v1/completions", json=body)
    assert remote.status_code == local.status_code == 400, (remote.text, local.text)
    assert remote.json() == local.json()


def test_engine_death_fails_in_flight_requests(tinytok_ckpt, tmp_path):
    proc, base = start_server([tinytok_ckpt, *ARGS], str(tmp_path / "server.log"))
    try:
        pid = engine_pid(proc.pid)
        body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True}
        got: dict = {}

        def whole():
            got["whole"] = httpx.post(base + "/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=whole)
        t.start()
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            it = r.iter_lines()
            next(it)
            deadline = time.time() + 20
            while metric({"base": base}, "num_requests_running") != 2.0:    # both hold a slot
                assert time.time() < deadline
                time.sleep(0.05)
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in it if x.startswith("data: {")]
        t.join(30)
        assert time.time() - t0 < 10
        assert "engine process exited with code -9" in rest[-1]["error"]["message"]
        assert got["whole"].status_code == 500 and "EngineDied" in got["whole"].json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 500 and "engine process" in r.json()["error"]["message"]
        assert wait_gone([pid], 5)
    finally:
        stop(proc)


def test_errors_cross_as_the_same_error():
    from specfire.errors import CheckpointError, GrammarError, PromptError
    from specfire.serve.remote import rebuilt, wire_error

    g = rebuilt(*wire_error(GrammarError("bad schema", "response_format")))
    assert type(g) is GrammarError and g.param == "response_format" and str(g) == "bad schema"
    p = rebuilt(*wire_error(PromptError("too long", too_long=True)))
    assert type(p) is PromptError and p.too_long
    assert type(rebuilt(*wire_error(CheckpointError("no config")))) is CheckpointError
    assert type(rebuilt(*wire_error(ValueError("v")))) is ValueError
    other = rebuilt(*wire_error(ZeroDivisionError("z")))     # no specfire error of that name: a 500 naming it
    assert type(other).__name__ == "ZeroDivisionError" and isinstance(other, RuntimeError)


def test_load_error_is_the_servers_one_line(tmp_path):
    """A checkpoint the engine process cannot load: the server exits with its one-line error."""
    import subprocess
    import sys

    from repo import REPO
    from serving import free_port

    (tmp_path / "empty").mkdir()
    env = {**os.environ, "PYTHONPATH": REPO}
    got = subprocess.run([sys.executable, "-m", "specfire.cli", "serve", str(tmp_path / "empty"), "--port",
                          str(free_port())], capture_output=True, text=True, env=env, timeout=120)
    lines = [x for x in got.stderr.splitlines() if x.strip()]
    assert got.returncode == 2 and lines[-1].startswith("specfire: error: ") and "Traceback" not in got.stderr
    assert "config.json" in lines[-1]


def test_verbose_reaches_the_engine_process(served, tinytok_ckpt, tmp_path):
    """`serve -v` logs the engine process's INFO lines too (it gets -v with the serve flags); the
    module's server, without -v, logs none of them."""
    log = tmp_path / "verbose.log"
    proc, _ = start_server(["-v", tinytok_ckpt, *ARGS], str(log))
    try:
        child = engine_pid(proc.pid)
    finally:
        stop(proc)
    text = log.read_text()
    assert f"engine process {child}: the model loaded in" in text, text[-2000:]
    with open(served["log"]) as f:
        assert "the model loaded in" not in f.read()
