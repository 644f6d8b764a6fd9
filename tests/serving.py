"""Start `specfire serve` in a subprocess on a free port and wait until /health answers."""
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
