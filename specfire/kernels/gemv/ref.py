"""The row-invariant CPU reference of y = x @ W^T, and the zero-padded panels that make an output
element's CPU arithmetic independent of the column shard it is in."""
from __future__ import annotations

import torch

PANEL = 16         # CPU output-row panel (elements of one AVX-512 vector)


def linear_rows_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N]; a batched product of one row per entry, so every row runs the
    same one-row kernel whatever M (a CPU GEMM picks another blocking for M > 1)."""
    m = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)


def paneled(fn, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fn(x, w) with N cut into whole panels plus one zero-padded panel for the tail: on the CPU an
    element of N's tail rounds unlike one of the vector body, so a shard would differ from the
    whole (the padded tail is kept on the weight until the weight changes)."""
    n = w.shape[0]
    body = n - n % PANEL
    if body == n:
        return fn(x, w)
    keep = not w.is_inference()          # an inference tensor has no version counter: no cache
    hit = getattr(w, "_specfire_tail", None) if keep else None
    if hit is not None and hit[0] == w._version:
        pad = hit[1]
    else:
        pad = torch.zeros(PANEL, w.shape[1], dtype=w.dtype, device=w.device)
        pad[:n - body] = w[body:]
        if keep:
            w._specfire_tail = (w._version, pad)
    tail = fn(x, pad)[:, :n - body]
    return tail if body == 0 else torch.cat([fn(x, w[:body]), tail], dim=-1)
