"""Starting a mesh's processes: what a rank needs to build its shard, the local worker processes
rank 0 starts, and the torchrun environment when the ranks were started for us.

Launch: `LLM(model, tp=N)` starts N-1 local workers (fresh interpreters running
`python -m specfire.parallel.worker`); under `torchrun` (the torch.distributed environment
variables are set, several hosts included) every process calls `LLM(...)`, rank 0 returns the
driver and the other ranks serve until rank 0 closes, then exit.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing import Pipe

import torch

from ..config import ModelConfig
from ..env import TP_TIMEOUT as TIMEOUT_ENV, Env  # noqa: F401 - TIMEOUT_ENV: lifecycle names it in errors
from ..errors import MeshError

START_TIMEOUT_S = 1800.0          # starting interpreters and loading shards (bounded, but generous)
JOIN_S = 10.0                     # how long a closing worker may take before it is killed


def mesh_timeout() -> float:
    """The collective timeout in seconds (specfire/env.py)."""
    return Env.read().tp_timeout_s


@dataclass(frozen=True)
class MeshSpec:
    """Everything a rank needs to build its shard (pickled to spawned workers)."""

    path: str
    cfg: ModelConfig
    tp: int
    dtype: torch.dtype
    device_type: str
    device_base: int
    max_seq: int
    kv_dtype: torch.dtype
    timeout_s: float
    threads: int | None           # CPU threads per rank; None = leave as is
    cuda_graphs: bool | None = None   # the rows forward in CUDA graphs (None: where the kernels serve)
    draft_vocab: int | None = None    # the MTP drafter scores token ids 0..N-1 only (parallel/draft.py)
    max_num_seqs: int = 1             # slots; without a budget the KV pool holds this many max_seq
    kv_budget: int | None = None      # bytes of each rank's KV pool (runtime/slots.py pool_blocks)

    def device(self, local_rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.device_base + local_rank)
        return torch.device(self.device_type)


@dataclass(frozen=True)
class Placement:
    """This process's place in the mesh: its rank, its local rank, and whether the ranks were
    started by torchrun (joined) or are about to be started by us."""

    rank: int
    local_rank: int
    joined: bool


def placement(tp: int) -> Placement:
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return Placement(0, 0, False)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != tp:
        raise ValueError(f"tp={tp} but the torch.distributed launch has WORLD_SIZE={world}; they must match")
    return Placement(rank, int(os.environ.get("LOCAL_RANK", rank)), True)


class LocalWorker:
    """One worker process started by rank 0. A fresh interpreter (not multiprocessing's spawn, which
    re-imports the caller's __main__), with a private pipe for start-up messages."""

    def __init__(self, rank: int, spec: MeshSpec, init_method: str):
        self.rank = rank
        ours, theirs = Pipe(duplex=True)
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specfire.parallel.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = ours
        self.conn.send((rank, spec, init_method))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()
        self.join(5.0)

    def close(self) -> None:
        self.conn.close()


def start_local_workers(spec: MeshSpec, store: str) -> list[LocalWorker]:
    """Start ranks 1..tp-1 and wait until each has imported (a crash at start surfaces now)."""
    workers = [LocalWorker(r, spec, "file://" + store) for r in range(1, spec.tp)]
    deadline = time.monotonic() + START_TIMEOUT_S
    for w in workers:
        try:
            while not w.conn.poll(0.05):
                if not w.is_alive() or time.monotonic() > deadline:
                    raise EOFError
            w.conn.recv()
        except (EOFError, OSError):
            why = (f"exited with code {w.exitcode}" if not w.is_alive()
                   else f"did not start within {START_TIMEOUT_S:g} s")
            kill_workers(workers)
            raise MeshError(f"tensor-parallel worker rank {w.rank} {why} while starting") from None
    return workers


def kill_workers(workers: list[LocalWorker]) -> None:
    for w in workers:
        w.kill()
        w.close()


def worker_errors(workers: list[LocalWorker]) -> list[tuple[str, str]]:
    """(error type, message) of every worker that reported a load failure."""
    out = []
    for w in workers:
        try:
            if w.conn.poll(2.0):
                _, name, msg = w.conn.recv()
                out.append((name, f"rank {w.rank}: {msg}"))
        except (EOFError, OSError, ValueError):
            pass
    return out
