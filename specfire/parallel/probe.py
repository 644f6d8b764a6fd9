"""Timing probes of the rows forward, for bench/tp.py: where a decode step's device time goes.

`time_rows` replays a captured rows graph back to back (no host work in between) and returns the
seconds per replay, so a step's wall time minus this is what the host and the control plane
cost. On a mesh every rank runs it at the same command (`MeshTrunk.rank_time`) and the graphs'
collectives keep the ranks in lockstep. With a profile path it also writes this rank's kernel
table (torch.profiler) and its device time summed by kernel family.
"""
from __future__ import annotations

import json

import torch

from ..runtime.trunk import LocalTrunk

FAMILIES = (   # kernel-name fragment -> family, first match wins
    ("tree_loop", "canonical split-K"), ("chunk_tree", "canonical split-K"), ("_chunk_kernel", "canonical split-K"),
    ("one_shot", "all-reduce"), ("all_reduce", "all-reduce"),
    ("_gemv_kernel", "gemv"), ("_gemv_group_kernel", "gemv"), ("q4", "gemv"), ("gdn", "gdn"), ("attn", "attention"),
    ("attention", "attention"),
    ("norm", "norms"), ("rope", "rope"), ("conv", "gdn"), ("copy", "copies"), ("Memcpy", "copies"),
    ("Memset", "copies"), ("fill", "copies"),
)


def family(name: str) -> str:
    for frag, fam in FAMILIES:
        if frag.lower() in name.lower():
            return fam
    return "other elementwise"


def time_rows(trunk: LocalTrunk, rows: int, n: int, profile: str | None = None, rank: int = 0) -> float:
    """Seconds per replay of the `rows`-row graph (NaN when it was never captured)."""
    g = trunk.graphs.graphs.get(rows) if trunk.graphs is not None else None
    if g is None or n <= 0:
        return float("nan")
    g.graph.replay()                                   # warm
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        g.graph.replay()
    e1.record()
    e1.synchronize()
    sec = e0.elapsed_time(e1) / 1e3 / n
    if profile:
        _profile(g.graph, min(n, 8), f"{profile}.rank{rank}")
    return sec


def _profile(graph: torch.cuda.CUDAGraph, n: int, path: str) -> None:
    """Replays exactly n times whatever the profiler does (on a mesh the peers replay as many:
    a rank that stopped short would leave them waiting inside a collective)."""
    prof = None
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    except Exception as e:  # noqa: BLE001 - a probe reports and goes on
        prof = None
        _error(path, e)
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    if prof is None:
        return
    try:
        prof.__exit__(None, None, None)
        _summary(prof, n, path)
    except Exception as e:  # noqa: BLE001
        _error(path, e)


def _error(path: str, e: BaseException) -> None:
    with open(path + ".error", "w") as f:
        f.write(f"{type(e).__name__}: {e}\n")


def _summary(prof, n: int, path: str) -> None:
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(ev.name, [0, 0.0])
            k[0] += 1
            k[1] += ev.time_range.elapsed_us()
    fams: dict[str, list[float]] = {}
    for name, (cnt, us) in kernels.items():
        f = fams.setdefault(family(name), [0, 0.0])
        f[0] += cnt / n
        f[1] += us / n
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    with open(path + ".json", "w") as f:
        json.dump({"replays": n, "families_per_replay": {k: {"kernels": c, "us": u} for k, (c, u) in fams.items()},
                   "top_kernels_per_replay": [{"name": k[:120], "calls": c / n, "us": u / n} for k, (c, u) in top]},
                  f, indent=1)
