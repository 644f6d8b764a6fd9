"""4-bit products of many rows (prefill, the MTP head's prompt catch-up) on CUDA: compute-bound, so
`q4_dequantize` writes the weight's bf16 values (the very bits of QuantWeight.dequantize().to(bf16))
into a per-device scratch buffer in chunks of output rows, and cuBLAS multiplies. Not row-invariant
and need not be: decode and verify keep the GEMV of kernels/q4/gemv.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from .._triton import triton, tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCRATCH_MAX = 1 << 27        # elements of the dequantize scratch per device (256 MB in bf16)


@triton.jit
def _rne_bf16(v):
    """float32 -> the nearest bf16 value (ties to even), still float32: the interpreter's own
    float32 -> bf16 cast truncates, where the GPU's (cvt.rn) and torch's round to nearest."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _narrow(v, dtype: tl.constexpr, EMU: tl.constexpr):
    """float32 v -> dtype, rounded to nearest (EMU: by bits, for the interpreter)."""
    if EMU and dtype == tl.bfloat16:
        v = _rne_bf16(v)
    return v.to(dtype)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, n0, rows, N, KH, n_groups,
                    G: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr,
                    EMU: tl.constexpr):
    # w[r, k] (r < rows, row-major [rows, K]) = dequantized weight row n0 + r. Kernel packing
    # (kernels/q4): in group g, byte j holds codes g*G + j (low nibble) and g*G + G/2 + j (high);
    # codes in tiles [N/TILE, K/G, TILE, G/2] (TILE 0: rows [N, K/2]); scales / zeros [K/G, N].
    # One program: BLOCK_N rows x GB groups.
    HALF: tl.constexpr = G // 2
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = n0 + r
    r_ok = r < rows
    offs_c = tl.arange(0, HALF)
    if TILE == 0:
        q_rows = q_ptr + n[:, None] * KH + offs_c[None, :]
        q_step = HALF
    else:
        q_rows = q_ptr + ((n // TILE) * (KH * TILE) + (n % TILE) * HALF)[:, None] + offs_c[None, :]
        q_step = TILE * HALF
    w_rows = w_ptr + r[:, None] * (2 * KH) + offs_c[None, :]
    for i in tl.static_range(GB):
        g = tl.program_id(1) * GB + i
        ok = r_ok & ((g + r * 0) < n_groups)
        qb = tl.load(q_rows + g * q_step, mask=ok[:, None], other=0)
        s = tl.load(s_ptr + g * N + n, mask=ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + g * N + n, mask=ok, other=0.0).to(tl.float32)[:, None]
        lo = (qb & 15).to(tl.float32) * s + z          # the product is exact: one rounding, as in torch
        hi = (qb >> 4).to(tl.float32) * s + z
        tl.store(w_rows + g * G, _narrow(lo, w_ptr.dtype.element_ty, EMU), mask=ok[:, None])
        tl.store(w_rows + g * G + HALF, _narrow(hi, w_ptr.dtype.element_ty, EMU), mask=ok[:, None])


_SCRATCH: dict = {}


def _scratch(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The per-device (and dtype) dequantize buffer, grown to the largest request (<= SCRATCH_MAX
    elements, or one row). Calls on one stream run in order, so one buffer serves them all."""
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, device=device, dtype=dtype)
    return buf


def _check(x: torch.Tensor, qw) -> None:
    if x.dim() != 2 or x.shape[1] != qw.shape[1]:
        raise ValueError(f"4-bit product: x must be [M, {qw.shape[1]}], got {list(x.shape)}")
    if x.device != qw.device:
        raise ValueError(f"4-bit product: x is on {x.device}, the weight on {qw.device}")


@dataclass(frozen=True)
class DequantConfig:
    block_n: int = 64        # weight rows per program (a code tile's 64 rows: one contiguous block a group)
    gb: int = 4              # groups per program
    num_warps: int = 4


DQ_DEFAULT = DequantConfig()
DQ_MEASURED: dict = {}       # (rows, K) at group 128 -> DequantConfig measured faster on the H200 (none yet)
DQ_MIN_PROGRAMS = 528        # 4 per SM of an H200: fewer, and the groups are spread over more programs


def dequant_config(rows: int, k: int, group: int) -> DequantConfig:
    """The measured setting for this (rows, K), else 64-row programs of 4 groups, or of fewer
    groups when that leaves fewer than DQ_MIN_PROGRAMS programs (small weights)."""
    if group == 128 and (rows, k) in DQ_MEASURED:
        return DQ_MEASURED[(rows, k)]
    cfg = DQ_DEFAULT
    while cfg.gb > 1 and triton.cdiv(rows, cfg.block_n) * triton.cdiv(k // group, cfg.gb) < DQ_MIN_PROGRAMS:
        cfg = DequantConfig(cfg.block_n, cfg.gb // 2, cfg.num_warps)
    return cfg


def q4_dequantize(qw, rows: slice = slice(None), out: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.bfloat16, cfg: DequantConfig | None = None) -> torch.Tensor:
    """The weight's output rows `rows` (step 1) dequantized, [rows, K] in `dtype` (out: a buffer
    of at least that many elements; a view of it is returned): equal to
    qw.dequantize(rows).to(dtype). cfg: launch settings (default: dequant_config)."""
    n, k = qw.shape
    a, b, step = rows.indices(n)
    if step != 1:
        raise ValueError("q4_dequantize: rows must be a contiguous slice")
    cnt = max(0, b - a)
    w = (out if out is not None else torch.empty(cnt * k, device=qw.device, dtype=dtype))[:cnt * k].view(cnt, k)
    g = qw.group_size
    n_groups = k // g
    if cnt:
        cfg = cfg or dequant_config(cnt, k, g)
        _dequant_kernel[(triton.cdiv(cnt, cfg.block_n), triton.cdiv(n_groups, cfg.gb))](
            qw.qtiled, qw.scales_t, qw.zeros_t, w, a, cnt, n, k // 2, n_groups,
            G=g, TILE=qw.tile, BLOCK_N=cfg.block_n, GB=cfg.gb, EMU=INTERPRET, num_warps=cfg.num_warps)
    return w


def q4_linear_dequant(x: torch.Tensor, qw, limit: int | None = None) -> torch.Tensor:
    """x [M, K] (already rotated if the weight is) @ W^T through the scratch buffer and F.linear,
    at most `limit` (SCRATCH_MAX) weight elements at a time."""
    _check(x, qw)
    n, k = qw.shape
    step = max(1, min(n, (limit or SCRATCH_MAX) // k))
    buf = _scratch(x.device, step * k, x.dtype)
    if step >= n:
        return F.linear(x, q4_dequantize(qw, slice(0, n), buf, x.dtype))
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    for i in range(0, n, step):
        j = min(n, i + step)
        y[:, i:j] = F.linear(x, q4_dequantize(qw, slice(i, j), buf, x.dtype))
    return y


