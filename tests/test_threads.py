"""One CPU thread policy for LLM() and the command line (threads.default_threads): a model on a CPU
runs on one intra-op thread unless the process chose a count."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from repo import REPO
from specfire import LLM, threads


# torch's own count, the policy's idea of it, then the count after each way of building an LLM
PROBE = """
import json, os, torch
start = torch.get_num_threads()
from specfire import LLM
from specfire.threads import torch_start_threads
seen = {"start": start, "estimate": torch_start_threads()}
with LLM(spec="off", device="cpu", progress=False):
    seen["default"] = torch.get_num_threads()
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(start + 1)                 # the caller's own choice
    with LLM(spec="off", device="cpu", progress=False):
        seen["after_set_num_threads"] = torch.get_num_threads()
    with LLM(spec="off", device="cpu", progress=False, threads=2):
        seen["threads_2"] = torch.get_num_threads()
print(json.dumps(seen))
"""


def probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                       env={**base, **env, "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_llm_on_a_cpu_takes_one_thread_unless_the_process_chose():
    """The README's Python example in a fresh interpreter: LLM() takes one thread where torch
    started with one per core (the CLI's default already); torch.set_num_threads or threads=
    before it are kept."""
    seen = probe()
    assert seen["estimate"] == seen["start"]        # the policy reads torch's start-up count right
    assert seen["default"] == 1
    assert seen["after_set_num_threads"] == seen["start"] + 1
    assert seen["threads_2"] == 2


def test_omp_num_threads_is_kept():
    seen = probe(OMP_NUM_THREADS="2")               # torch takes at most one thread per core
    assert seen["default"] == seen["start"] == min(2, os.cpu_count() or 1)


def test_threads_argument_is_checked():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            LLM(spec="off", device="cpu", progress=False, threads=bad)


@pytest.fixture
def fresh_process(monkeypatch):
    """This process as if torch had just started on two cores with nothing chosen."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "torch_start_threads", lambda: 2)
    monkeypatch.setattr(threads, "_threads_chosen", False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


def test_cli_and_api_share_the_policy(fresh_process, cli_run):
    """`specfire run` leaves the count to the same policy as LLM(); --threads (before or after the
    subcommand) is the process's choice, which LLM() then keeps."""
    assert threads.default_threads() == 1
    r = cli_run("run", "--device", "cpu", "--prompt", "def f(x):", "-n", "2", "--spec", "off")
    assert r.returncode == 0, r.stderr
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    r = cli_run("run", "--device", "cpu", "--prompt", "def f(x):", "-n", "2", "--spec", "off", "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert torch.get_num_threads() == 2 and threads.default_threads() is None
    with LLM(spec="off", device="cpu", progress=False):
        assert torch.get_num_threads() == 2
