"""Linear layers (y = x @ W^T) with a row-invariant path for decode and verify.

Row invariance: a row's result must not depend on how many rows are computed with it, so that a
k+1-row verify reproduces k+1 one-row decodes bit for bit. A plain GEMM is not row-invariant on the
CPU (MKL/oneDNN pick different blockings for M = 1 and M > 1: measured, every row of M = 2..8
differed from the M = 1 result in the last bits). A batched GEMM with one row per batch entry runs
the same per-row kernel for every M; on the 2-core CPU it is also faster than GEMM for M <= 8
(512x1536 fp32: 45/56/92 us at M = 1/2/4 vs 44/79/137 us for GEMM). On CUDA the row path is
the Triton skinny matmul of ops/triton_gemv.py (row-invariant by construction, ~bandwidth-bound).
A 4-bit `QuantWeight` (ops/quant.py) is accepted in place of a weight tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_PATH_MAX = 16  # up to this many rows use the row-invariant path (decode, verify)


def linear_rows_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N]; every row computed by the same one-row kernel."""
    m = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The row-invariant path: Triton on CUDA (16-row tiles), the batched reference elsewhere."""
    if x.is_cuda:
        from .triton_gemv import gemv
        if x.shape[0] <= ROW_PATH_MAX:
            return gemv(x, w)
        return torch.cat([gemv(x[i:i + ROW_PATH_MAX], w) for i in range(0, x.shape[0], ROW_PATH_MAX)])
    return linear_rows_ref(x, w)


def linear(x: torch.Tensor, w, rows: bool) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T. `rows` selects the row-invariant path (decode / verify). `w` is a
    tensor or a 4-bit QuantWeight."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, rows)
    if rows:
        return linear_rows(x, w)
    return F.linear(x, w)
