"""Linear layers (y = x @ W^T) with a row-invariant path for decode and verify.

Row invariance: a row's result must not depend on how many rows are computed with it, so that a
k+1-row verify reproduces k+1 one-row decodes bit for bit. A plain GEMM is not row-invariant on the
CPU (MKL/oneDNN pick different blockings for M = 1 and M > 1: measured, every row of M = 2..8
differed from the M = 1 result in the last bits). A batched GEMM with one row per batch entry runs
the same per-row kernel for every M; on the 2-core CPU it is also faster than GEMM for M <= 8
(512x1536 fp32: 45/56/92 us at M = 1/2/4 vs 44/79/137 us for GEMM).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_PATH_MAX = 16  # up to this many rows use the row-invariant path (decode, verify)


def linear_rows_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N]; every row computed by the same one-row kernel."""
    m = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)


def linear(x: torch.Tensor, w: torch.Tensor, rows: bool) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T. `rows` selects the row-invariant path (decode / verify)."""
    if rows:
        return linear_rows_ref(x, w)
    return F.linear(x, w)
