"""The process's CPU intra-op threads: the one policy of LLM() and the command line.

Single-stream decode is a chain of small ops: a second intra-op thread gains little on idle cores
and stalls every op when the cores are shared with other work (specfire/bundled/MODEL_CARD.md,
"CPU speed"), so a model on a CPU runs on one thread unless the process chose a count."""
from __future__ import annotations

import glob
import os

import torch

CPU_THREADS = 1
_threads_chosen = False                 # set_threads() was called (`specfire --threads N`)


def set_threads(n: int) -> None:
    """Use `n` intra-op CPU threads from now on; every LLM built afterwards keeps them."""
    global _threads_chosen
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    torch.set_num_threads(n)
    _threads_chosen = True


def torch_start_threads() -> int:
    """The intra-op count torch starts with when no variable sets it: one per physical core (its
    cpuinfo count; the logical CPUs where the topology is not readable)."""
    cores = set()
    for f in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"):
        try:
            with open(f, encoding="ascii") as fh:
                cores.add(fh.read().strip())
        except OSError:
            pass
    return len(cores) or os.cpu_count() or 1


def default_threads() -> int | None:
    """The threads an LLM on a CPU sets when given none: None (keep the count) where the process
    chose one (set_threads, $OMP_NUM_THREADS / $MKL_NUM_THREADS, or torch.set_num_threads to other
    than torch's start-up count), else CPU_THREADS."""
    if _threads_chosen or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    if torch.get_num_threads() != torch_start_threads():
        return None
    return CPU_THREADS
