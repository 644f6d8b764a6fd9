"""The serving battery: five fixed prompts of different genres, one JSON row each, with quality
flags (attractor / empty / runaway) and md5s that make output identity across speculation modes
and topologies checkable by comparing strings.

Runs against a live OpenAI-compatible server (streaming chat completions) or an LLM loaded in
this process; both produce the same row shape."""
from __future__ import annotations

import hashlib
import http.client
import json
import re
import urllib.parse
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from ..api import LLM

PROMPTS: list[tuple[str, str]] = [
    ("code", "Write a Python function `is_prime(n)` that returns True when n is a prime number and False "
             "otherwise. Include a short docstring."),
    ("arithmetic", "A baker bakes 7 trays of 24 muffins and sells 150 of them. Then she bakes 2 more trays. "
                   "How many muffins does she have now? Show your working."),
    ("explanation", "Explain in exactly three sentences why the sky is blue."),
    ("story", "Write a short story, about 150 words, about a lighthouse keeper who finds a message in a bottle."),
    ("tips", "Give five tips for sleeping better, as a numbered list."),
]

# ---- quality flags --------------------------------------------------------------------------------
WINDOW = 128          # whitespace tokens at the head and at the tail of the text
MIN_TOKENS = 8        # below this a window is too short to call degenerate (a one-word answer is fine)
HEAD_UNIQUE, TAIL_UNIQUE, DOMINANT, NGRAM_REPEAT = 0.15, 0.30, 0.5, 0.5

_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


def visible(text: str) -> str:
    """The answer a reader sees: reasoning blocks (<think>...</think>, or an unclosed one) removed."""
    return _THINK.sub("", text).strip()


def _window_degenerate(words: list[str], min_unique: float) -> bool:
    if len(words) < MIN_TOKENS:
        return False
    counts = Counter(words)
    return len(counts) / len(words) < min_unique or counts.most_common(1)[0][1] / len(words) > DOMINANT


def attractor(text: str) -> bool:
    """Degenerate repetition over whitespace tokens: the first 128 have a unique ratio < 0.15 or one
    token > 50%, or the last 128 have a unique ratio < 0.30 or one token > 50%, or in the second half
    more than half of the 3-grams are repeats of an earlier 3-gram of that half."""
    words = text.split()
    if _window_degenerate(words[:WINDOW], HEAD_UNIQUE) or _window_degenerate(words[-WINDOW:], TAIL_UNIQUE):
        return True
    half = words[len(words) // 2:]
    grams = [tuple(half[i:i + 3]) for i in range(len(half) - 2)]
    if len(grams) < MIN_TOKENS:
        return False
    repeats = len(grams) - len(set(grams))
    return repeats / len(grams) > NGRAM_REPEAT


def flags(text: str, finish: str | None) -> dict[str, bool]:
    return {"attractor": attractor(text), "empty": not visible(text), "runaway": finish == "length"}


def md5(s: str) -> str:
    return hashlib.md5(s.encode("utf-8")).hexdigest()


def request_body(prompt: str, max_tokens: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    # plain greedy with every penalty off, whatever defaults the served model's
    # generation_config.json sets: the battery measures the model, as run_local does
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if spec is not None:
        body["speculation"] = spec
    return body


def request_md5(body: dict[str, Any]) -> str:
    """md5 of the request's content: everything but the model name and the speculation policy, which
    are what an identity run varies (canonical JSON: sorted keys, no spaces)."""
    core = {k: v for k, v in body.items() if k not in ("model", "speculation")}
    return md5(json.dumps(core, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def make_row(name: str, prompt: str, body: dict[str, Any], text: str, finish: str | None, gen: int, ctx: int,
             cached: int, timings: dict[str, Any] | None, saw_done: bool) -> dict[str, Any]:
    t = timings or {}
    return {"prompt": name, "finish": finish, "gen": gen, "ctx": ctx, "cached": cached,
            "tau": t.get("mean_accept_len"), "prefill_tok_s": t.get("prefill_tok_s"),
            "decode_tok_s": t.get("decode_tok_s"), **flags(text, finish), "saw_done": saw_done,
            "prompt_md5": md5(prompt), "request_md5": request_md5(body), "content_md5": md5(text)}


# ---- running against a server -------------------------------------------------------------------

def iter_sse(resp: http.client.HTTPResponse) -> Iterable[str]:
    """`data:` payloads of a server-sent-event stream."""
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            yield line[5:].strip()


def run_server(url: str, prompt_name: str, prompt: str, max_tokens: int, spec: dict[str, Any] | None,
               api_key: str | None = None, model: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """One battery row from a streaming chat completion against `url` (e.g. http://127.0.0.1:8000)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--url must look like http://HOST:PORT, got {url!r}")
    body = request_body(prompt, max_tokens, spec)
    if model is not None:
        body["model"] = model
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    base = u.path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    try:
        conn.request("POST", base + "/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"server answered {resp.status}: {resp.read().decode('utf-8', 'replace')[:500]}")
        parts: list[str] = []
        finish = None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] | None = None
        saw_done = False
        for data in iter_sse(resp):
            if data == "[DONE]":
                saw_done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"server error mid-stream: {ev['error'].get('message')}")
            for c in ev.get("choices") or []:
                parts.append((c.get("delta") or {}).get("content") or "")
                finish = c.get("finish_reason") or finish
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    finally:
        conn.close()
    text = "".join(parts)
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return make_row(prompt_name, prompt, body, text, finish, usage.get("completion_tokens", 0),
                    usage.get("prompt_tokens", 0), cached, timings, saw_done)


# ---- running in process ---------------------------------------------------------------------------

def run_local(llm: "LLM", prompt_name: str, prompt: str, max_tokens: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    """One battery row from an LLM in this process (the same request, without HTTP)."""
    from ..params import SamplingParams

    body = request_body(prompt, max_tokens, spec)
    ids = llm.prompt_ids(llm.render_chat(body["messages"]))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    res = llm.generate(ids, sp, spec)
    fig = llm.figures(res, sp)
    return make_row(prompt_name, prompt, body, res.text, res.finish_reason, fig.generated_tokens, fig.prompt_tokens,
                    fig.cached_tokens, fig.timings(0.0), True)


def run_battery(runner: Any, max_tokens: int, spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [runner(name, prompt, max_tokens, spec) for name, prompt in PROMPTS]


def identity_report(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Whether every cell produced the same content md5 for every prompt, and where not."""
    names = list(cells)
    ref = names[0]
    mismatches = []
    for i, (pname, _) in enumerate(PROMPTS):
        want = cells[ref][i]["content_md5"]
        for c in names[1:]:
            got = cells[c][i]["content_md5"]
            if got != want:
                mismatches.append({"prompt": pname, "cell": c, "content_md5": got, "reference": ref,
                                   "reference_md5": want})
    return {"identity": not mismatches, "cells": names, "reference": ref, "mismatches": mismatches}
