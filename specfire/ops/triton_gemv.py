"""Row-invariant skinny matmul (GEMV) on CUDA, in Triton: decode and verify rows, and prefill.

y[M, N] = x[M, K] @ w[N, K]^T with fp32 accumulation. Row invariance by construction: the row
tile is always 16 wide (rows past M are masked), the launch configuration is a function of
(N, K) only, and M is not a specialised kernel argument, so every M runs the same machine code
and row m's reduction order (tile by tile along K, one tensor-core MMA per tile, then an optional
split-K sum in fixed order) never depends on the other rows or on how many there are.

The weight is the MMA's A operand ([BLOCK_N, BLOCK_K], K-contiguous as stored) and x^T the B
operand, so one weight tile is read once for all rows: the kernel moves the weight bytes once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROWS = 16          # the row tile of decode / verify
PREFILL_ROWS = 64  # the row tile of a prefill (more than ROWS rows, not rows mode)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


SMEM_BUDGET = 200 * 1024   # bytes of shared memory a program may stage (the H200 has 227 KB)


def fit_stages(cfg: GemvConfig, tile: int, elt: int) -> int:
    """The pipeline depth that keeps (weight tile + x tile) x stages within SMEM_BUDGET; depth
    changes only how loads overlap, never the arithmetic."""
    stages = cfg.num_stages
    while stages > 1 and stages * (cfg.block_n + tile) * cfg.block_k * elt > SMEM_BUDGET:
        stages -= 1
    return stages


def gemv_config(n: int, k: int) -> GemvConfig:
    """The launch configuration for a weight [n, k]; depends on the shape only (never on M).
    Picked by the sweep in bench/linear.py on the H200 (27B shapes, K = 5120..17408)."""
    if n >= 65536:   # lm_head
        return GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    if n >= 16384:   # MLP gate / up
        return GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=8, num_stages=3)
    if n >= 8192:    # attention q, GDN qkv
        return GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4)
    return GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr,
                 PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)        # row tiles innermost: the tiles that read one weight tile run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROWS_ + tl.arange(0, ROWS_)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)           # [BLOCK_N, ROWS] = (W x^T) tile
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)          # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)          # [ROWS, BLOCK_K]
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if not PARTIAL:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
    else:  # partials [split, M, N] float32, summed in a fixed order by _splitk_sum
        base = y_ptr + pid_s * M * N
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


@triton.jit(do_not_specialize=["MN"])
def _splitk_sum(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig | None = None, launch_n: int | None = None,
         tile: int = ROWS) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype; rows run in tiles of `tile` over grid axis 0
    (16: row-invariant, see the module doc; row_tile picks 64 for a prefill). `launch_n`: pick the launch settings of a matrix with that many
    rows (a column shard passes the whole matrix's N, so its elements are computed as the whole's)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemv: x has K={k} but w is {list(w.shape)}")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = cfg or gemv_config(launch_n or n, k)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # never launch an empty split
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    grid = (triton.cdiv(m, tile), triton.cdiv(n, cfg.block_n), split)
    stages = fit_stages(cfg, tile, x.element_size())
    if split == 1:
        _gemv_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile, PARTIAL=False, IEEE=ieee,
                           num_warps=cfg.num_warps, num_stages=stages)
        return y
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _gemv_kernel[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), n, k_per_split,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile, PARTIAL=True, IEEE=ieee,
                       num_warps=cfg.num_warps, num_stages=stages)
    blk = 1024
    _splitk_sum[(triton.cdiv(m * n, blk),)](part, y, m * n, SPLIT=split, BLOCK=blk)
    return y


def row_tile(m: int, rows: bool) -> int:
    """Rows per program: 16 in rows mode (decode / verify: the same code for every row count), 64
    for a prefill of more than 16 rows (4x fewer passes over the weight; prefill rows need only
    be computed alike on every tensor-parallel degree, which a tile chosen by M gives)."""
    return ROWS if rows or m <= ROWS else PREFILL_ROWS
