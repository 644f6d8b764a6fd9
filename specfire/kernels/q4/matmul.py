"""4-bit products of many rows (prefill, the MTP head's prompt catch-up) on CUDA, in Triton.

More than kernels/gemv ROW_PATH_MAX rows through a 4-bit weight (kernels/q4) is compute-bound,
so the weight is expanded to the activation dtype and multiplied on the tensor cores. Two forms,
chosen by `MODE` (environment SPECFIRE_Q4_PREFILL at import; benches switch the attribute):

- "dequant": `q4_dequantize` writes the weight's bf16 values (codes x scale + zero in float32,
  rounded once: the very bits of `QuantWeight.dequantize().to(bf16)`, since a 4-bit code times a
  bf16 scale is exact in float32) into a per-device scratch buffer, reused by every call, in
  chunks of output rows of at most SCRATCH_MAX elements; then the stock GEMM (cuBLAS) multiplies.
  The product is the one the torch path computed (same weight bits, same GEMM), without its
  float32 temporaries (about 30 bytes of traffic per weight element through torch ops, against
  2.5 here).
- "fused": `q4_matmul`, one kernel: each program dequantizes a [BLOCK_N, G] tile of the weight
  per group in registers (the same bf16 bits) and accumulates x_tile @ w_tile^T in float32 with
  tl.dot, so the weight is read as 4-bit codes only (no scratch traffic); the sum over K runs in
  group order, so it rounds differently from cuBLAS (close, not bitwise).
- "torch": the reference path kept in kernels/q4 (float32 dequantize through torch ops, GEMM).

Measured on the H200 (bench/q4_prefill.py, docs/BENCHMARKS.md "Eighth wave: 4-bit prefill through
Triton"), 27B shapes at 1024 rows: dequant 505-607 TFLOP/s on the large weights (cuBLAS alone on the
bf16 weight: 708-806), fused 224-320 (its 4 configs), torch 55-128; so dequant is the default.

Nothing here is row-invariant or needs to be: decode and verify (rows=True) keep the row-invariant
GEMV of kernels/q4/gemv.py, and a prompt's prefill is the same computation for AR and for
speculative decoding, so greedy MTP == AR is untouched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from .._triton import triton, tl

MODES = ("dequant", "fused", "torch")
MODE = os.environ.get("SPECFIRE_Q4_PREFILL", "dequant")
if MODE not in MODES:
    raise ValueError(f"SPECFIRE_Q4_PREFILL must be one of {', '.join(MODES)}, got {MODE!r}")
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


@dataclass(frozen=True)
class MMConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    wa: bool = True          # the weight tile as the MMA's A operand (y^T = W x^T): on sm_90 the
                             # register operand of wgmma is A, so the dequantized tile stays in registers
    group_m: int = 8         # row tiles per band of the launch order (L2 reuse of the weight tiles)


# launch settings by the number of rows (prefill pieces are ops trunk PREFILL_PIECE = 1024 rows)
MM_SMALL = MMConfig(64, 128, num_warps=4, num_stages=4)    # up to 64 rows
MM_LARGE = MMConfig(128, 128, num_warps=8, num_stages=3)


def mm_config(m: int) -> MMConfig:
    return MM_SMALL if m <= 64 else MM_LARGE


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _q4_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, KH, stride_xm, n_groups,
                  G: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr, WA: tl.constexpr, F32: tl.constexpr, INTERP: tl.constexpr):
    # y [M, N] = x [M, K] @ W^T, W dequantized a [BLOCK_N, G] tile per group in registers (same
    # packing as _dequant_kernel), rounded to x's dtype. F32: float32 products (float32
    # activations, or the CPU interpreter, whose bf16 arithmetic is wrong: x converted right after
    # loading, the bf16 weight values converted back to float32).
    HALF: tl.constexpr = G // 2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % size_m
    pid_n = (pid % band) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, HALF)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if TILE == 0:
        q_rows = q_ptr + offs_n[:, None] * KH + offs_c[None, :]
        q_step = HALF
    else:
        q_rows = q_ptr + ((offs_n // TILE) * (KH * TILE) + (offs_n % TILE) * HALF)[:, None] + offs_c[None, :]
        q_step = TILE * HALF
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :]
    if WA:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, n_groups):
        xe = tl.load(x_rows + g * G, mask=m_ok[:, None], other=0.0)              # [BLOCK_M, HALF] low-nibble k
        xo = tl.load(x_rows + g * G + HALF, mask=m_ok[:, None], other=0.0)       # high-nibble k
        if F32:
            xe = xe.to(tl.float32)
            xo = xo.to(tl.float32)
        qb = tl.load(q_rows + g * q_step, mask=n_ok[:, None], other=0)          # [BLOCK_N, HALF] bytes
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        wl = (qb & 15).to(tl.float32) * s + z           # the weight in float32 (exact product, one rounding)
        wh = (qb >> 4).to(tl.float32) * s + z
        if x_ptr.dtype.element_ty != tl.float32:         # rounded to x's dtype (the reference's weight bits)
            wl = _narrow(wl, x_ptr.dtype.element_ty, INTERP)
            wh = _narrow(wh, x_ptr.dtype.element_ty, INTERP)
        if F32:
            wl = wl.to(tl.float32)
            wh = wh.to(tl.float32)
        if WA:
            acc = _dot(wl, tl.trans(xe), acc, F32)
            acc = _dot(wh, tl.trans(xo), acc, F32)
        else:
            acc = _dot(xe, tl.trans(wl), acc, F32)
            acc = _dot(xo, tl.trans(wh), acc, F32)
    if WA:
        acc = tl.trans(acc)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], _narrow(acc, y_ptr.dtype.element_ty, INTERP),
             mask=m_ok[:, None] & n_ok[None, :])


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
DQ_MEASURED: dict = {}       # (rows, K) at group 128 -> DequantConfig measured fastest on the H200 (empty: the
                             # one sweep so far, bench/q4_prefill.py dqsweep, covered 3 shapes and adopted nothing)
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


def q4_matmul(x: torch.Tensor, qw, cfg: MMConfig | None = None) -> torch.Tensor:
    """x [M, K] (already rotated if the weight is) @ W^T in one fused kernel -> [M, N] in x's dtype."""
    _check(x, qw)
    m, k = x.shape
    n = qw.shape[0]
    cfg = cfg or mm_config(m)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _q4_mm_kernel[grid](x, qw.qtiled, qw.scales_t, qw.zeros_t, y, m, n, k // 2, x.stride(0), k // qw.group_size,
                        G=qw.group_size, TILE=qw.tile, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        GROUP_M=cfg.group_m, WA=cfg.wa, F32=x.dtype == torch.float32 or INTERPRET, INTERP=INTERPRET,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
