"""Timing shared by the GPU benches: calls replayed from one CUDA graph, median of 5 replays."""
from __future__ import annotations

import torch


def graph_time(fns, iters: int = 20) -> float:
    """Seconds per call of fns[i % len(fns)] (rotating inputs), replayed from one CUDA graph after
    a warm-up of every fn outside the capture (kernel compilation)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / iters)
    ts.sort()
    return ts[len(ts) // 2]
