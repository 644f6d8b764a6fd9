"""`specfire daemon` over a subprocess pipe: the full message set, bad lines, attempt_id rules."""
import json
import os
import queue
import subprocess
import sys
import threading

import pytest

from repo import REPO
from tinytok import make_tok_checkpoint



class Pipe:
    """A running daemon: send one message, read the events it answers with."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "specfire.cli", "daemon", *args], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        self.raw: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.raw.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def send(self, msg) -> None:
        if isinstance(msg, bytes):
            self.proc.stdin.buffer.write(msg + b"\n")
        else:
            self.proc.stdin.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout=60) -> dict:
        line = self.lines.get(timeout=timeout)
        assert line is not None, "daemon exited: " + self.proc.stderr.read()
        return json.loads(line)

    def until(self, kind: str) -> list[dict]:
        evs = []
        while True:
            ev = self.recv()
            evs.append(ev)
            if ev["type"] in (kind, "error"):
                return evs

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tok_checkpoint(str(tmp_path_factory.mktemp("tok") / "ckpt"), seed=5)


@pytest.fixture(scope="module")
def daemon():
    d = Pipe()
    yield d
    d.close()


@pytest.fixture
def loaded(daemon, ckpt):
    """The module's daemon with the tiny model loaded (whatever ran before)."""
    daemon.send({"type": "load", "id": "fx", "model": ckpt, "params": {"spec": {"mode": "auto", "k": 2},
                                                                       "max_seq_len": 2048}})
    assert daemon.recv()["type"] == "loaded"
    return daemon


def _bad(d: Pipe, line, cls: str, word: str, mid=None):
    d.send(line)
    ev = d.recv()
    assert ev["type"] == "error" and ev["class"] == cls and ev["id"] == mid, ev
    assert word in ev["message"] and ev["retryable"] is False
    d.send({"type": "ping", "id": "alive"})  # still running
    assert d.recv() == {"type": "pong", "id": "alive"}


def test_load(daemon, ckpt):
    _bad(daemon, {"type": "load", "id": "l0", "model": "/nonexistent/model"}, "load_error", "nonexistent", "l0")
    _bad(daemon, {"type": "load", "id": "l1", "model": ckpt, "params": {"bogus": 1}}, "invalid_request", "bogus", "l1")
    _bad(daemon, {"type": "load", "id": "l2", "model": ckpt, "params": {"draft_vocab": 0}}, "invalid_request",
         "draft_vocab must be an integer", "l2")
    # a mesh keeps no prefix snapshots: asking it for them is refused before anything starts
    for field in ("prefix_cache_mb", "prefill_piece"):
        _bad(daemon, {"type": "load", "id": "l3", "model": ckpt, "params": {"tp": 2, field: 64}}, "invalid_request",
             f"'params.{field}': the prefix cache and its prefill pieces serve one device; this load has tp=2", "l3")
    daemon.send({"type": "load", "id": "l2", "model": ckpt, "params": {"spec": {"mode": "auto", "k": 2}}})
    ev = daemon.recv()
    assert ev["type"] == "loaded" and ev["id"] == "l2"
    assert ev["arch"] == "qwen3_5_text" and ev["layers"] == 4 and ev["vocab"] == 320
    assert ev["mtp"] is True and ev["tp"] == 1


def test_draft_vocab_flag_is_every_loads_default(ckpt):
    """`daemon --draft-vocab N` applies to the start-up load and to every load that does not set its own."""
    d = Pipe("--draft-vocab", "100000", "--model", ckpt)
    try:
        ev = d.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request", ev
        assert "draft_vocab must be an integer in 1..320" in ev["message"] and "100000" in ev["message"]
        d.send({"type": "load", "id": "l", "model": ckpt, "params": {"draft_vocab": 7}})
        assert d.recv()["type"] == "loaded"
    finally:
        d.close()


def test_tp_invariant_load_param_and_flag(ckpt):
    """params.tp_invariant reaches LLM and the loaded event names it; `daemon --tp-invariant` is
    every load's default (a load's own False wins); a non-bool is refused naming the field."""
    import io

    from specfire.serve.daemon import Daemon

    for flag, params, want in ((False, {}, False), (False, {"tp_invariant": True}, True),
                               (True, {}, True), (True, {"tp_invariant": False}, False)):
        out = io.BytesIO()
        d = Daemon(out, tp_invariant=flag)
        d.handle_line(json.dumps({"type": "load", "model": ckpt, "params": {"device": "cpu", **params}}).encode())
        ev = json.loads(out.getvalue().decode().splitlines()[0])
        assert ev["type"] == "loaded" and ev["tp_invariant"] is want, (flag, params, ev)
        assert d.llm.engine.trunk.model.target.exact is want
        d._unload()
    out = io.BytesIO()
    Daemon(out).handle_line(json.dumps({"type": "load", "model": ckpt, "params": {"tp_invariant": "yes"}}).encode())
    ev = json.loads(out.getvalue().decode().splitlines()[0])
    assert ev["type"] == "error" and ev["class"] == "invalid_request"
    assert ev["message"] == "tp_invariant must be True or False, got 'yes'", ev


def test_generate_events_match_in_process(loaded, ckpt):
    daemon = loaded
    from specfire import LLM, SamplingParams

    daemon.send({"type": "generate", "id": "g1", "attempt_id": 3, "prompt": "def add(a, b):", "max_tokens": 12,
                 "temperature": 0, "speculation": {"mode": "mtp", "k": 2}})
    evs = daemon.until("done")
    start, toks, done = evs[0], evs[1:-1], evs[-1]
    assert start["type"] == "gen_start" and start["attempt_id"] == 3 and start["id"] == "g1"
    assert toks and all(t["type"] == "token" and t["attempt_id"] == 3 and t["ids"] for t in toks)
    assert done["type"] == "done" and done["attempt_id"] == 3 and done["id"] == "g1"
    for key in ("tokens", "prefill_tokens", "prefill_tok_s", "decode_tok_s", "ttft_ms", "finish_reason",
                "mean_accept_len", "cycles"):
        assert key in done, key
    assert done["route"] == "mtp" and done["cycles"] >= 1 and done["mean_accept_len"] >= 1.0
    text = "".join(t["text"] for t in toks)
    with LLM(ckpt, progress=False) as llm:
        ref = llm.generate("def add(a, b):", SamplingParams(max_tokens=12), spec="off")
    assert text == ref.text and done["tokens"] == len(ref.token_ids)
    assert [i for t in toks for i in t["ids"]] == ref.token_ids
    assert done["finish_reason"] == ref.finish_reason and done["prefill_tokens"] == len(ref.prompt_token_ids)

    # the same request with speculation off gives the same greedy text
    daemon.send({"type": "generate", "id": "g2", "attempt_id": 4, "prompt": "def add(a, b):", "max_tokens": 12,
                 "temperature": 0, "speculation": {"mode": "off"}})
    evs = daemon.until("done")
    assert "".join(e["text"] for e in evs if e["type"] == "token") == text and evs[-1]["route"] == "ar"


def test_generate_messages(loaded):
    daemon = loaded
    daemon.send({"type": "generate", "id": "c", "attempt_id": 0, "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 5, "temperature": 0})
    evs = daemon.until("done")
    assert evs[0]["type"] == "gen_start" and evs[0]["prompt_tokens"] > 3
    assert evs[-1]["type"] == "done" and evs[-1]["tokens"] <= 5


def test_generate_chat_ids_structured_output_and_logprobs(loaded, ckpt):
    """messages through chat_ids (a control token typed in content stays text), a guided_choice
    grammar and logprobs on the token events, as in process."""
    from specfire import LLM, SamplingParams
    from specfire.grammar import GrammarSpec

    msgs = [{"role": "user", "content": "a<|im_end|>b"}]
    loaded.send({"type": "generate", "id": "s", "attempt_id": 9, "messages": msgs, "max_tokens": 8,
                 "guided_choice": ["yes", "no way"], "logprobs": 2, "speculation": {"mode": "mtp", "k": 2}})
    evs = loaded.until("done")
    with LLM(ckpt, progress=False) as llm:
        ids = llm.chat_ids(msgs)
        assert len(ids) != len(llm.tokenizer.encode(llm.render_chat(msgs)))
        want = llm.generate(ids, SamplingParams(max_tokens=8, logprobs=2, structured_outputs=GrammarSpec(
            "choice", ["yes", "no way"], "guided_choice")), spec="off")
    assert evs[0]["prompt_tokens"] == len(ids) and evs[-1]["finish_reason"] == "stop"
    toks = [e for e in evs if e["type"] == "token"]
    assert "".join(e["text"] for e in toks) == want.text and want.text in ("yes", "no way")
    got = [(x["id"], x["logprob"], [tuple(t) for t in x["top"]]) for e in toks for x in e["logprobs"]]

    def fin(v):                                         # JSON has no -inf: the daemon writes -9999.0
        return v if v > float("-inf") else -9999.0
    assert got == [(x.token, fin(x.logprob), [(t, fin(v)) for t, v in x.top]) for x in want.logprobs]


def test_token_events_carry_every_id_a_partial_character_included(loaded, ckpt):
    """A character split over tokens (the grammar forces the two bytes of "é", one token each): the
    first token has no text yet, and its id still comes in a token event, so the events' ids are
    the generation's ids in order (EOS included), as LLM.stream gives them."""
    from specfire import LLM, SamplingParams
    from specfire.grammar import GrammarSpec

    loaded.send({"type": "generate", "id": "u", "attempt_id": 40, "prompt": "hello", "max_tokens": 8,
                 "guided_choice": ["\u00e9t\u00e9"], "speculation": {"mode": "off"}})
    evs = loaded.until("done")
    with LLM(ckpt, progress=False) as llm:
        sp = SamplingParams(max_tokens=8, structured_outputs=GrammarSpec("choice", ["\u00e9t\u00e9"], "guided_choice"))
        chunks = list(llm.stream("hello", sp, spec="off"))
    want = chunks[-1].result
    assert any(c.token_ids and not c.text for c in chunks)      # the case this test is about
    toks = [e for e in evs if e["type"] == "token"]
    assert [i for e in toks for i in e["ids"]] == want.token_ids and evs[-1]["tokens"] == len(want.token_ids)
    assert [(e["text"], e["ids"]) for e in toks] == [(c.text, c.token_ids) for c in chunks if c.token_ids]
    assert "".join(e["text"] for e in toks) == want.text == "\u00e9t\u00e9"



@pytest.mark.parametrize("attempt", ["missing", "1", True, -1, 1.5, None, [1]])
def test_attempt_id_rules(daemon, attempt):
    msg = {"type": "generate", "id": "a", "prompt": "hi", "max_tokens": 2}
    if attempt != "missing":
        msg["attempt_id"] = attempt
    _bad(daemon, msg, "invalid_request", "attempt_id", "a")


@pytest.mark.parametrize("line,cls,word", [
    ("this is not json", "parse_error", "JSON"),
    ("[1, 2]", "parse_error", "object"),
    ('{"type": "fly"}', "invalid_request", "fly"),
    ('{"id": 9}', "invalid_request", "type"),
    ('{"type": "generate", "attempt_id": 0}', "invalid_request", "prompt"),
    ('{"type": "generate", "attempt_id": 0, "prompt": "x", "temperature": -1}', "invalid_request", "temperature"),
    ('{"type": "generate", "attempt_id": 0, "prompt": "x", "max_tokens": 0}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "attempt_id": 0, "prompt": "x", "top_p": 2}', "invalid_request", "top_p"),
    ('{"type": "generate", "attempt_id": 0, "prompt": "x", "speculation": {"k": 0}}', "invalid_request", "k"),
    ('{"type": "generate", "attempt_id": 0, "prompt": "x", "messages": []}', "invalid_request", "prompt"),
])
def test_bad_lines(loaded, line, cls, word):
    daemon = loaded
    mid = json.loads(line).get("id") if line.startswith("{") else None
    _bad(daemon, line, cls, word, mid)


def test_ping_and_generate_before_load_then_unload_then_exit(ckpt):
    """One daemon's life: answers before any model is loaded, a generate then is not_loaded; load,
    unload, not_loaded again; the end of its input ends it with status 0. (A model loaded at
    start-up by --model: test_a_file_of_requests_is_answered_in_full.)"""
    daemon = Pipe()
    daemon.send({"type": "ping", "id": 1})
    assert daemon.recv() == {"type": "pong", "id": 1}
    _bad(daemon, {"type": "generate", "id": "g0", "attempt_id": 0, "prompt": "hi"}, "not_loaded", "load", "g0")
    daemon.send({"type": "load", "id": "l", "model": ckpt})
    assert daemon.recv()["type"] == "loaded"
    daemon.send({"type": "unload", "id": "u"})
    assert daemon.recv() == {"type": "unloaded", "id": "u", "was_loaded": True}
    _bad(daemon, {"type": "generate", "id": "z", "attempt_id": 1, "prompt": "hi"}, "not_loaded", "load", "z")
    daemon.proc.stdin.close()
    assert daemon.proc.wait(timeout=30) == 0
    for line in daemon.raw:  # stdout carried protocol JSON only
        assert isinstance(json.loads(line), dict)


# ---- issue 16: bad bytes, cancellation, end of input, a reader that leaves -------------------------

def test_lone_surrogate_and_bad_utf8_do_not_kill_it(loaded):
    d = loaded
    d.send('{"type":"ping","id":"\\ud800"}')                # a lone surrogate in the id: echoed as null
    ev = d.recv()
    assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["id"] is None and "surrogate" in ev["message"]
    d.send({"type": "ping", "id": 2})
    assert d.recv() == {"type": "pong", "id": 2}
    d.send(b'{"type": "ping", "id": "\xff\xfe"}')          # raw invalid UTF-8 inside a JSON string
    ev = d.recv()
    assert ev["type"] == "error" and ev["class"] == "parse_error" and "UTF-8" in ev["message"]
    d.send('{"type": "generate", "id": "s", "attempt_id": 5, "prompt": "a \\udfff b"}')
    ev = d.recv()
    assert ev["class"] == "invalid_request" and ev["attempt_id"] == 5 and "prompt" in ev["message"]
    d.send("[" * 100_000)
    assert d.recv()["class"] == "parse_error"
    d.send({"type": "ping", "id": 3})
    assert d.recv() == {"type": "pong", "id": 3}


def test_errors_carry_attempt_id_and_bad_seed_is_refused_before_gen_start(loaded):
    d = loaded
    d.send({"type": "generate", "id": "e", "attempt_id": 7, "prompt": "hi", "seed": 2 ** 64})
    ev = d.recv()      # the very next event: no gen_start was sent for a request that cannot run
    assert ev["type"] == "error" and ev["attempt_id"] == 7 and ev["id"] == "e" and "seed" in ev["message"]
    assert ev["class"] == "invalid_request" and ev["retryable"] is False
    d.send({"type": "generate", "id": "e2", "attempt_id": 8, "prompt": "hi", "temperature": -1})
    ev = d.recv()
    assert ev["type"] == "error" and ev["attempt_id"] == 8


def test_generate_with_penalties(loaded, ckpt):
    """The penalty fields reach the engine (the text equals the in-process one) and bad values are
    refused before gen_start, naming the field."""
    from specfire import LLM, SamplingParams

    d = loaded
    pen = {"repetition_penalty": 1.5, "frequency_penalty": 0.8, "presence_penalty": 0.3}
    d.send({"type": "generate", "id": "p", "attempt_id": 20, "prompt": "def add(a, b):", "max_tokens": 16,
            "ignore_eos": True, "speculation": {"mode": "mtp", "k": 2}, **pen})
    evs = d.until("done")
    assert evs[-1]["type"] == "done", evs
    text = "".join(e["text"] for e in evs if e["type"] == "token")
    with LLM(ckpt, progress=False) as llm:
        want = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, ignore_eos=True, **pen), spec="off")
        plain = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, ignore_eos=True), spec="off")
    assert text == want.text != plain.text
    for field, value, word in (("repetition_penalty", 0, "> 0.0"), ("presence_penalty", -2.5, ">= -2.0"),
                               ("frequency_penalty", [1], "a number")):
        d.send({"type": "generate", "id": "pb", "attempt_id": 21, "prompt": "hi", field: value})
        ev = d.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["attempt_id"] == 21, ev
        assert field in ev["message"] and word in ev["message"], ev


LONG = {"type": "generate", "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}


def test_cancel_by_attempt_id(daemon, ckpt):
    """With one slot, attempt 12 waits behind 11: a cancel drops it unstarted (tokens 0, no
    gen_start); the running one stops at its next step; an unknown one is not found."""
    d = daemon
    d.send({"type": "load", "id": "one", "model": ckpt, "params": {"max_num_seqs": 1, "max_seq_len": 2048}})
    assert d.recv()["type"] == "loaded"
    d.send({**LONG, "id": "g", "attempt_id": 11})
    d.send({**LONG, "id": "q", "attempt_id": 12})          # waits behind attempt 11
    ev = d.recv()
    assert ev["type"] == "gen_start" and ev["attempt_id"] == 11, ev
    assert d.recv()["type"] == "token"
    d.send({"type": "cancel", "id": "c0", "attempt_id": 12})   # the queued one: dropped, never started
    d.send({"type": "ping", "id": "p"})                     # answered while 11 runs
    d.send({"type": "cancel", "id": "c1", "attempt_id": 11})
    d.send({"type": "cancel", "id": "c2", "attempt_id": 99})
    evs = []
    while len(evs) < 6:
        ev = d.recv()
        if ev["type"] != "token":
            evs.append(ev)
    assert {"type": "pong", "id": "p"} in evs and {"type": "cancelled", "id": "c2", "attempt_id": 99,
                                                   "found": False} in evs, evs
    q = evs.index({"type": "aborted", "id": "q", "attempt_id": 12, "tokens": 0, "reason": "cancel"})
    assert evs[q + 1] == {"type": "cancelled", "id": "c0", "attempt_id": 12, "found": True}, evs
    g = next(i for i, e in enumerate(evs) if e["type"] == "aborted" and e["id"] == "g")
    assert evs[g] == {**evs[g], "attempt_id": 11, "reason": "cancel"} and 0 < evs[g]["tokens"] < 2000, evs
    assert evs[g + 1] == {"type": "cancelled", "id": "c1", "attempt_id": 11, "found": True}, evs
    assert not any(e["type"] == "gen_start" for e in evs)
    d.send({"type": "generate", "id": "after", "attempt_id": 13, "prompt": "hi", "max_tokens": 3})
    assert d.until("done")[-1]["type"] == "done"


def test_concurrent_generates_share_steps_and_stay_exact(daemon, ckpt):
    """Generates sent together run at once (each starts before the first one ends), each giving
    what it gives alone; an attempt_id already in use is refused; a load waits for them to end."""
    from specfire import LLM, SamplingParams

    d = daemon
    d.send({"type": "load", "id": "four", "model": ckpt, "params": {"max_num_seqs": 4, "max_seq_len": 2048}})
    assert d.recv()["type"] == "loaded"
    gens = [dict(attempt_id=20, prompt="def add(a, b):", max_tokens=120, ignore_eos=True),
            dict(attempt_id=21, prompt="hello", max_tokens=16, speculation={"mode": "mtp", "k": 2}),
            dict(attempt_id=22, prompt="for i in", max_tokens=16, temperature=0.8, seed=4,
                 speculation={"mode": "ngram", "k": 2}),
            dict(attempt_id=23, prompt="x = 1", max_tokens=12, frequency_penalty=0.5, stop=[" "],
                 speculation={"mode": "auto", "k": 2})]
    for g in gens:
        d.send({"type": "generate", "id": g["attempt_id"], **g})
    d.send({"type": "generate", "id": "dup", "attempt_id": 20, "prompt": "hi"})
    d.send({"type": "load", "id": "again", "model": ckpt, "params": {"max_seq_len": 2048}})
    evs = [d.recv()]
    while evs[-1]["type"] != "loaded":
        evs.append(d.recv())
    dup = [e for e in evs if e["type"] == "error"]
    assert len(dup) == 1 and dup[0]["id"] == "dup" and "already running" in dup[0]["message"], dup
    assert evs[-1]["type"] == "loaded"
    by = {g["attempt_id"]: [e for e in evs if e.get("attempt_id") == g["attempt_id"] and e["id"] != "dup"]
          for g in gens}
    first_done = min(evs.index(b[-1]) for b in by.values())
    assert all(evs.index(b[0]) < first_done for b in by.values())      # all started before any ended
    with LLM(ckpt, progress=False, max_seq_len=2048) as llm:
        for g in gens:
            kw = {k: v for k, v in g.items() if k not in ("attempt_id", "prompt", "speculation")}
            want = llm.generate(g["prompt"], SamplingParams(**kw), spec=g.get("speculation", "off"))
            got = by[g["attempt_id"]]
            assert got[0]["type"] == "gen_start" and got[-1]["type"] == "done", got
            assert "".join(e["text"] for e in got if e["type"] == "token") == want.text, g
            assert got[-1]["tokens"] == len(want.token_ids) and got[-1]["finish_reason"] == want.finish_reason


def test_a_file_of_requests_is_answered_in_full(ckpt, tmp_path):
    """`specfire daemon --model M < requests.jsonl`: the end of input means no more input, so the
    running generation and every line queued behind it are answered (a cancel in the file still
    drops the attempt it names), then the daemon exits 0. It used to abort the running one after
    a token and drop the rest."""
    from specfire import LLM, SamplingParams

    gens = [dict(attempt_id=1, prompt="hello", max_tokens=60, ignore_eos=True),
            dict(attempt_id=2, prompt="def add(a, b):", max_tokens=12),
            dict(attempt_id=3, prompt="x", max_tokens=5),
            dict(attempt_id=4, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, ignore_eos=True,
                 speculation={"mode": "mtp", "k": 2}),
            dict(attempt_id=5, prompt="for i in", max_tokens=20, min_tokens=10, stop=[" "], ignore_eos=True)]
    lines = [json.dumps({"type": "generate", "id": f"g{g['attempt_id']}", **g}) for g in gens]
    lines.insert(1, json.dumps({"type": "ping", "id": "p"}))
    lines.insert(4, json.dumps({"type": "cancel", "id": "c3", "attempt_id": 3}))
    lines.append("not json")
    req = tmp_path / "requests.jsonl"
    req.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    with open(req, "rb") as f:
        p = subprocess.run([sys.executable, "-m", "specfire.cli", "daemon", "--max-num-seqs", "2", "--model", ckpt],
                           stdin=f,
                           capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    evs = [json.loads(line) for line in p.stdout.decode().splitlines()]
    assert evs[0]["type"] == "loaded" and [e["class"] for e in evs if e["type"] == "error"] == ["parse_error"]
    by = {a: [e for e in evs if e.get("attempt_id") == a] for a in range(1, 6)}
    assert [e["type"] for e in by[3]] == ["aborted", "cancelled"] and by[3][0]["tokens"] == 0
    assert {"type": "pong", "id": "p"} in evs and not any(e["type"] == "aborted" for a in (1, 2, 4, 5) for e in by[a])
    with LLM(ckpt, progress=False) as llm:
        for g in gens:
            a = g["attempt_id"]
            if a == 3:
                continue
            assert by[a][0]["type"] == "gen_start" and by[a][-1]["type"] == "done", by[a]
            kw = {k: v for k, v in g.items() if k not in ("attempt_id", "prompt", "messages", "speculation")}
            prompt = llm.chat_ids(g["messages"]) if "messages" in g else g["prompt"]
            want = llm.generate(prompt, SamplingParams(**kw), spec="off")
            assert "".join(e["text"] for e in by[a] if e["type"] == "token") == want.text, a
            assert by[a][-1]["tokens"] == len(want.token_ids) and by[a][-1]["finish_reason"] == want.finish_reason
    assert by[1][-1]["tokens"] == 60
    assert evs.index(by[1][0]) < evs.index(by[2][0]) < evs.index(by[4][0]) < evs.index(by[5][0])   # in order
    assert evs.index(by[2][0]) < evs.index(by[1][-1])          # two slots: 2 ran beside 1


def test_end_fields_and_refused_fields(loaded, ckpt):
    """min_tokens, stop_token_ids, include_stop_str_in_output and skip_special_tokens reach the
    engine; a field the daemon would ignore (tools, a typo) is refused naming it."""
    from specfire import LLM, SamplingParams

    d = loaded
    with LLM(ckpt, progress=False) as llm:
        plain = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, ignore_eos=True), spec="off")
        kw = dict(max_tokens=16, min_tokens=4, stop_token_ids=[plain.token_ids[1], plain.token_ids[5]],
                  include_stop_str_in_output=True, skip_special_tokens=False)
        want = llm.generate("def add(a, b):", SamplingParams(**kw), spec="off")
    assert want.token_ids != plain.token_ids[:len(want.token_ids)] or want.finish_reason == "stop"
    d.send({"type": "generate", "id": "f", "attempt_id": 30, "prompt": "def add(a, b):", **kw})
    evs = d.until("done")
    assert evs[-1]["type"] == "done" and evs[-1]["tokens"] == len(want.token_ids)
    assert "".join(e["text"] for e in evs if e["type"] == "token") == want.text
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("max_token", 5),
                         ("response_format", {"type": "xml"}), ("guided_json", {"type": "nope"}), ("echo", True),
                         ("min_tokens", -1),
                         ("stop_token_ids", [10 ** 6])):
        d.send({"type": "generate", "id": "r", "attempt_id": 31, "prompt": "hi", field: value})
        ev = d.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["attempt_id"] == 31, ev
        assert field in ev["message"], ev


def test_echo_is_refused_and_false_is_the_default(loaded):
    """`echo` (the prompt sent back, as /v1/completions does) is not built in the daemon: true is
    refused naming the field and saying why; false, what the daemon does anyway, is accepted."""
    d = loaded
    for value, word in ((True, "does not send the prompt back"), (1, "must be a boolean")):
        d.send({"type": "generate", "id": "e", "attempt_id": 41, "prompt": "hi", "max_tokens": 2, "echo": value})
        ev = d.recv()
        assert ev["type"] == "error" and ev["class"] == "invalid_request" and ev["attempt_id"] == 41, ev
        assert ev["message"].startswith("'echo' ") and word in ev["message"], ev
    d.send({"type": "generate", "id": "e", "attempt_id": 42, "prompt": "hi", "max_tokens": 2, "echo": False})
    evs = d.until("done")
    assert evs[0]["type"] == "gen_start" and evs[-1]["type"] == "done" and evs[-1]["tokens"] == 2, evs


def test_reader_that_leaves_ends_it_quietly(ckpt):
    """`specfire daemon | head -1`: no BrokenPipeError traceback, exit status 0."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specfire.cli", "daemon", "--model", ckpt], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert json.loads(proc.stdout.readline())["type"] == "loaded"
    proc.stdout.close()                         # the reader leaves, as `head -1` does
    try:
        for i in range(5):
            proc.stdin.write(json.dumps({"type": "ping", "id": i}).encode() + b"\n")
            proc.stdin.flush()
        proc.stdin.write(json.dumps({**LONG, "id": "g", "attempt_id": 1}).encode() + b"\n")
        proc.stdin.flush()
    except BrokenPipeError:                     # the daemon already left
        pass
    assert proc.wait(timeout=60) == 0           # it left without waiting for the end of its input
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    proc.stdin.close()


def test_prefix_reuse_reports_cached_tokens(daemon, ckpt):
    daemon.send({"type": "load", "id": "p", "model": ckpt, "params": {"prefill_piece": 16, "max_seq_len": 512}})
    assert daemon.recv()["type"] == "loaded"
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers, with a docstring."}]
    texts, cached = [], []
    for i in range(2):
        daemon.send({"type": "generate", "id": i, "attempt_id": i, "messages": msgs, "max_tokens": 6})
        evs = daemon.until("done")
        texts.append("".join(e["text"] for e in evs if e["type"] == "token"))
        cached.append(evs[-1]["cached_tokens"])
        n = evs[0]["prompt_tokens"]
    assert texts[0] == texts[1] and cached == [0, ((n - 1) // 16) * 16] and cached[1] > 0
    # the next turn resumes from the end of this one's prompt
    turn2 = msgs + [{"role": "assistant", "content": texts[0]}, {"role": "user", "content": "Now subtract."}]
    daemon.send({"type": "generate", "id": 2, "attempt_id": 2, "messages": turn2, "max_tokens": 2})
    assert daemon.until("done")[-1]["cached_tokens"] == n
    daemon.send({"type": "load", "id": "p0", "model": ckpt, "params": {"prefix_cache_mb": 0, "prefill_piece": 16}})
    assert daemon.recv()["type"] == "loaded"
    for i in range(2):
        daemon.send({"type": "generate", "id": i, "attempt_id": i, "messages": msgs, "max_tokens": 6})
        assert daemon.until("done")[-1]["cached_tokens"] == 0
    _bad(daemon, {"type": "load", "id": "b", "model": ckpt, "params": {"prefix_cache_mb": -1}}, "invalid_request",
         "prefix_cache_mb", "b")


def test_a_generate_is_routed_once(ckpt, monkeypatch):
    """The daemon decides a generate's route once, when it checks the message, and hands that
    decision to the engine (one call of the route selector per generate)."""
    import io

    from specfire.runtime import engine
    from specfire import LLM
    from specfire.serve.daemon import Daemon

    calls = []
    real = engine.select_route
    monkeypatch.setattr(engine, "select_route", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    out = io.BytesIO()
    d = Daemon(out)
    d.llm = LLM(ckpt, progress=False)
    d.run(iter([json.dumps({"type": "generate", "id": "r", "attempt_id": 1, "prompt": "def add(a, b):",
                            "max_tokens": 6, "speculation": {"mode": "mtp", "k": 2}}).encode()]))
    events = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert events[-1]["type"] == "done" and len(calls) == 1, (events[-1], calls)


def test_a_load_waits_for_the_generations_before_it(ckpt):
    """However lines reach it, a load (or unload) lets the generations before it end first, not
    cancel them."""
    import io

    from specfire.serve.daemon import Daemon

    out = io.BytesIO()
    d = Daemon(out)
    for msg in ({"type": "load", "model": ckpt, "params": {"max_seq_len": 512}},
                {"type": "generate", "id": "g", "attempt_id": 1, "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
                {"type": "unload", "id": "u"}):
        d.handle_line(json.dumps(msg).encode())
    evs = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert [e["type"] for e in evs if e["type"] != "token"] == ["loaded", "gen_start", "done", "unloaded"], evs
    assert evs[-2]["tokens"] == 8
