"""A bounded soak of `specfire serve` on 127.0.0.1: 200 requests from four clients at once, mixing
good, bad, cancelled, streaming and non-streaming ones. /health must answer within a second
throughout, no request may hang, and every greedy answer (during and after) must equal a cold
single run of the same request in a fresh process-local LLM."""
import json
import random
import threading
import time

import httpx
import pytest

from serving import start_server, stop
from tinytok import make_tok_checkpoint

N_REQUESTS = 200
CLIENTS = 4
MAX_SEQ = 512
PROMPTS = ["def add(a, b):", "The quick brown fox", "Tip 1:", "Once upon a time", "import os\n", "Hello, world!"]
N_GEN = 8
BAD = ['{"prompt": "\\ud800"}', "[" * 5000, '{"prompt": "x", "seed": 18446744073709551616}',
       '{"prompt": "x", "top_p": 7}', '{"prompt": 3}', "not json", '{"prompt": "x", "speculation": {"k": 0}}']


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specfire import LLM, SamplingParams

    root = tmp_path_factory.mktemp("soak")
    path = make_tok_checkpoint(str(root / "ckpt"), seed=6)
    with LLM(path, device="cpu", max_seq_len=MAX_SEQ, spec="off", progress=False) as llm:
        ref = {p: llm.generate(p, SamplingParams(max_tokens=N_GEN)).text for p in PROMPTS}
    proc, base = start_server([path, "--max-seq-len", str(MAX_SEQ)], str(root / "server.log"))
    yield base, ref
    stop(proc)


def metric(base, name, **labels):
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"specfire:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_soak(setup):
    base, ref = setup
    rng = random.Random(1234)
    kinds = rng.choices(["good", "good_stream", "bad", "drop", "drop_stream"], [35, 20, 20, 13, 12], k=N_REQUESTS)
    plan = [(k, rng.choice(PROMPTS), rng.choice(["off", "auto", "mtp", "ngram"])) for k in kinds]
    wrong: list[str] = []
    counts = {k: 0 for k in ("good", "good_stream", "bad", "drop", "drop_stream")}
    health: list[float] = []
    done = threading.Event()
    lock = threading.Lock()

    def one(c: httpx.Client, kind: str, prompt: str, mode: str) -> None:
        body = {"prompt": prompt, "max_tokens": N_GEN, "temperature": 0, "speculation": {"mode": mode, "k": 2}}
        if kind == "good":
            r = c.post(base + "/v1/completions", json=body, timeout=60)
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"
        elif kind == "good_stream":
            with c.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            text = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
        elif kind == "bad":
            r = c.post(base + "/v1/completions", content=rng_bad(prompt), timeout=60,
                       headers={"Content-Type": "application/json"})
            text = ref[prompt] if r.status_code == 400 and "error" in r.json() else f"HTTP {r.status_code}: {r.text}"
        else:
            long = {**body, "max_tokens": MAX_SEQ - 20, "ignore_eos": True}
            if kind == "drop":
                try:
                    c.post(base + "/v1/completions", json=long, timeout=0.3)
                except httpx.TimeoutException:
                    pass
            else:
                with c.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                    it = r.iter_lines()
                    next(it)
            text = ref[prompt]
        with lock:
            counts[kind] += 1
            if text != ref[prompt]:
                wrong.append(f"{kind} {mode} {prompt!r}: {text!r} != {ref[prompt]!r}")

    def rng_bad(prompt: str) -> str:
        return BAD[hash(prompt) % len(BAD)]

    def client(i: int) -> None:
        with httpx.Client() as c:
            for kind, prompt, mode in plan[i::CLIENTS]:
                one(c, kind, prompt, mode)

    def poll() -> None:
        with httpx.Client() as c:           # one client: httpx.get() builds an SSL context per call (~0.2 s here)
            while not done.is_set():
                t0 = time.perf_counter()
                r = c.get(base + "/health", timeout=10)
                health.append(time.perf_counter() - t0 if r.status_code == 200 else 99.0)
                time.sleep(0.1)

    poller = threading.Thread(target=poll)
    poller.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.time()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads), "a client hung"
    finally:
        done.set()
        poller.join()
    assert sum(counts.values()) == N_REQUESTS, counts
    assert not wrong, wrong[:5]
    assert health and max(health) < 1.0, f"/health took {max(health):.2f} s"
    # the server is idle and consistent afterwards, and still gives the cold greedy answers
    deadline = time.time() + 30
    while metric(base, "num_requests_running") or metric(base, "num_requests_waiting"):
        assert time.time() < deadline, "requests left running after the soak"
        time.sleep(0.1)
    with httpx.Client() as c:
        for p in PROMPTS:
            for mode in ("off", "mtp"):
                r = c.post(base + "/v1/completions", json={"prompt": p, "max_tokens": N_GEN, "temperature": 0,
                                                           "speculation": mode}, timeout=60)
                assert r.json()["choices"][0]["text"] == ref[p]
    aborted = metric(base, "request_success_total", finished_reason="abort")
    assert aborted >= 0.5 * (counts["drop"] + counts["drop_stream"]), (aborted, counts)
    print(f"soak: {N_REQUESTS} requests in {time.time() - t0:.1f} s, {counts}, aborted {aborted:.0f}, "
          f"/health max {1000 * max(health):.0f} ms, median {1000 * sorted(health)[len(health) // 2]:.0f} ms over "
          f"{len(health)} polls")
