"""`specfire serve` under hostile or careless clients (issue 16): bad input is a 400 naming the field,
never a 500; a client that goes away, streaming or not, has its generation aborted; a request size
limit answers 413 while /health stays responsive; a taken port fails before the model loads."""
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from repo import REPO
from serving import free_port, start_server, stop

NAME = "tiny"
MAX_SEQ = 4096
LIMIT = 300_000


@pytest.fixture(scope="module")
def server(tinytok_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("robust")
    path = tinytok_ckpt
    proc, base = start_server([path, "--served-model-name", NAME, "--max-seq-len", str(MAX_SEQ),
                               "--max-request-bytes", str(LIMIT)], str(root / "server.log"))
    yield {"base": base, "proc": proc, "path": path}
    stop(proc)


def post(server, path, body=None, raw=None, timeout=60):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server["base"] + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def metric(server, name, **labels):
    for line in httpx.get(server["base"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"specfire:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ok_after(server):
    r = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


BAD = [
    # a lone surrogate (a \ud800 escape) in the text: was a 500 TypeError from the tokenizer
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800 x"}]}', "messages[0].content"),
    ("/v1/completions", '{"prompt": "a \\udfff b"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
    # 100,000 nested arrays: was a 500 RecursionError
    ("/v1/chat/completions", "[" * 100_000, None),
    ("/v1/completions", '{"prompt": "hi", "extra": ' + "[" * 200 + "]" * 200 + "}", "extra" + "[0]" * 31),
    # a seed beyond 64 bits: was a 400 from inside the engine with param null
    ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2 ** 64}), "seed"),
    ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2 ** 63}), "seed"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),                      # not UTF-8
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "chat_template_kwargs": 3}), "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,raw,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_400_naming_the_field(server, path, raw, param):
    r = post(server, path, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    ok_after(server)


def test_seed_is_refused_before_generation(server):
    before = metric(server, "request_success_total", finished_reason="error")
    r = post(server, "/v1/completions", {"prompt": "hi", "seed": 2 ** 64, "max_tokens": 3})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    assert metric(server, "request_success_total", finished_reason="error") == before  # never reached the engine


def test_dropped_nonstreaming_client_is_aborted(server):
    """A client that gives up on a long non-streaming request: the generation stops (counted as
    abort, not length) and the next request is served at once."""
    aborted = metric(server, "request_success_total", finished_reason="abort")
    length = metric(server, "request_success_total", finished_reason="length")
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=1.0)
    deadline = time.time() + 15
    while metric(server, "request_success_total", finished_reason="abort") < aborted + 1:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.1)
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "request_success_total", finished_reason="length") == length
    t0 = time.time()
    ok_after(server)
    assert time.time() - t0 < 10


def test_dropped_queued_client_never_runs(server):
    """Two long requests: the second client leaves while queued behind the first; both abort."""
    aborted = metric(server, "request_success_total", finished_reason="abort")
    body = {"prompt": "hello", "max_tokens": MAX_SEQ - 10, "temperature": 0, "ignore_eos": True}
    timeouts = []

    def give_up():
        try:
            post(server, "/v1/completions", body, timeout=1.5)
        except httpx.TimeoutException:
            timeouts.append(1)

    threads = [threading.Thread(target=give_up) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(timeouts) == 2
    deadline = time.time() + 15
    while metric(server, "request_success_total", finished_reason="abort") < aborted + 2:
        assert time.time() < deadline, "an abandoned request was not aborted"
        time.sleep(0.1)
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0


def test_request_size_limit_and_health(server):
    """Over the limit: 413 at once (by Content-Length, and for a chunked body); meanwhile, and while
    large requests are parsed and refused, /health answers within a second."""
    slow: list[float] = []
    done = threading.Event()

    def poll_health():
        with httpx.Client() as c:          # one client: httpx.get() builds an SSL context per call
            while not done.is_set():
                t0 = time.time()
                r = c.get(server["base"] + "/health", timeout=10)
                slow.append(time.time() - t0 if r.status_code == 200 else 99.0)
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        big = json.dumps({"prompt": "x" * (LIMIT + 10)})
        t0 = time.time()
        r = post(server, "/v1/completions", raw=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert time.time() - t0 < 5

        def chunks():
            for _ in range(LIMIT // 10_000 + 5):
                yield b" " * 10_000

        r = httpx.post(server["base"] + "/v1/completions", content=chunks(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        # just under the limit: parsed off the event loop and refused as too long for the context
        for _ in range(3):
            r = post(server, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "word " * (LIMIT // 6)}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        done.set()
        poller.join()
    assert slow and max(slow) < 1.0, max(slow)
    ok_after(server)


def test_port_in_use_fails_before_loading(tmp_path):
    """The port is checked before the model loads: a missing model is not even looked at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "specfire.cli", "serve", str(tmp_path / "no-such-model"),
                            "--port", str(port)], capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "already in use" in p.stderr
    assert "serving" not in p.stderr and "no-such-model" not in p.stderr
    assert free_port() > 0 and time.time() - t0 < 120
