"""Start `specfire serve` in a subprocess on a free port and wait until /health answers; the mixed
chats the concurrency tests send."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from repo import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log_path: str, timeout: float = 120.0, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, **popen: Any) -> tuple[subprocess.Popen, str]:
    """`specfire serve ARGS --port P`; output goes to log_path (a pipe nobody reads could fill up).
    env: variables set on top of this process's; launcher: the command before `serve` (default
    `python -m specfire.cli`); popen: more subprocess.Popen arguments (e.g. preexec_fn)."""
    port = free_port()
    # one intra-op thread: tiny models gain nothing from more, and a busy CI box loses a lot
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           **(env or {})}
    log = open(log_path, "w")
    cmd = launcher or [sys.executable, "-m", "specfire.cli"]
    proc = subprocess.Popen([*cmd, "serve", *args, "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True, **popen)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            proc.wait()
            with open(log_path) as f:
                raise RuntimeError("server did not start:\n" + f.read())
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def mixed_chats(tokens: int, ar_tokens: int | None = None) -> list[dict]:
    """Four chat requests of mixed policies and sampling (off, MTP k=3, seeded sampled n-gram k=2,
    penalised auto with a stop string), `tokens` each; `ar_tokens` for the AR one (the fastest)."""
    return [
        dict(messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
             max_tokens=ar_tokens or tokens, temperature=0, extra_body={"speculation": {"mode": "off"}, "ignore_eos": True}),
        dict(messages=[{"role": "user", "content": "Tell me a story about a fox."}], max_tokens=tokens, temperature=0,
             extra_body={"speculation": {"mode": "mtp", "k": 3}, "ignore_eos": True}),
        dict(messages=[{"role": "user", "content": "for i in range(10):"}], max_tokens=tokens, temperature=0.8, seed=3,
             extra_body={"speculation": {"mode": "ngram", "k": 2}, "ignore_eos": True}),
        dict(messages=[{"role": "user", "content": "Hello, world!"}], max_tokens=tokens, temperature=0,
             frequency_penalty=0.5, stop=["\n\n"], extra_body={"speculation": {"mode": "auto", "k": 3}}),
    ]
