"""Row-invariant dequant-GEMV for specfire's 4-bit format (ops/quant.py) on CUDA, in Triton.

Two forms, chosen per shape by `q4_config`: `deq` dequantises a tile of `gps` groups to the
activation dtype in registers (w = code * scale + zero) and runs one MMA per nibble plane; the
factorised form computes t = codes @ x^T per group on the tensor cores (codes are exact in bf16,
fp32 accumulation) and folds the affine map in afterwards, y += scale * t + zero * sum(x). The same
row-invariance rules as ops/triton_gemv.py hold: a fixed 16-row tile, a config chosen from
(N, K, G) only, M not specialised, split-K partials summed in a fixed order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_gemv import ROWS, _splitk_sum


@dataclass(frozen=True)
class Q4Config:
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    gps: int = 1          # groups per K step
    deq: bool = False     # dequantise the tile to the activation dtype (one MMA per nibble plane)
    magic: bool = True    # bf16 activations: codes to floats by bit tricks instead of int->float converts


def q4_config(n: int, k: int, group: int) -> Q4Config:
    """Launch configuration from the weight's shape only (never from M). Picked by the sweep in
    bench/linear.py on the H200: the factorised form with bit-trick codes, 64-row tiles, and
    split-K for all but the lm_head (the kernel is issue-bound, so more CTAs help)."""
    if n >= 65536:
        return Q4Config(block_n=64, split_k=1)
    if k >= 12288 and group >= 128:
        return Q4Config(block_n=64, split_k=8)
    return Q4Config(block_n=64, split_k=4)


@triton.jit(do_not_specialize=["M"])
def _q4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_ym, groups_per_split,
                    BLOCK_N: tl.constexpr, G: tl.constexpr, GPS: tl.constexpr, DEQ: tl.constexpr,
                    MAGIC: tl.constexpr, ROWS_: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    # Kernel packing (ops/quant.py): in group g, byte j of a row holds codes g*G + j (low nibble)
    # and g*G + G/2 + j (high nibble); scales / zeros are [K/G, N].
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    HALF: tl.constexpr = G // 2
    TILE: tl.constexpr = GPS * HALF                                               # bytes per row per step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS_)
    offs_c = tl.arange(0, TILE)
    n_mask = offs_n < N
    m_mask = offs_m < M
    n_groups = K // G
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)                            # [BLOCK_N, ROWS]
    c_grp = offs_c // HALF                                                        # group within the step
    c_k = c_grp * G + offs_c % HALF                                               # k of the low nibble
    q_rows = q_ptr + offs_n[:, None] * (K // 2)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for g0 in range(g_lo, g_hi, GPS):
        c_ok = (g0 + c_grp) < g_hi                                                # [TILE]
        qb = tl.load(q_rows + g0 * HALF + offs_c[None, :], mask=n_mask[:, None] & c_ok[None, :], other=0)
        xm = m_mask[:, None] & c_ok[None, :]
        xe = tl.load(x_rows + g0 * G + c_k[None, :], mask=xm, other=0.0)          # [ROWS, TILE] low-nibble k
        xo = tl.load(x_rows + g0 * G + HALF + c_k[None, :], mask=xm, other=0.0)   # [ROWS, TILE] high-nibble k
        if DEQ:
            # scales / zeros of the GPS groups, broadcast over each group's G/2 columns
            gs = tl.arange(0, GPS)
            sg_ok = n_mask[:, None] & ((g0 + gs) < g_hi)[None, :]
            sg = tl.load(s_ptr + (g0 + gs)[None, :] * N + offs_n[:, None], mask=sg_ok, other=0.0)  # [BN, GPS]
            zg = tl.load(z_ptr + (g0 + gs)[None, :] * N + offs_n[:, None], mask=sg_ok, other=0.0)
            se = tl.reshape(tl.broadcast_to(sg.to(tl.float32)[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, TILE))
            ze = tl.reshape(tl.broadcast_to(zg.to(tl.float32)[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, TILE))
            if MAGIC:  # float bits 0x4B000000 | q are 2^23 + q: one logic op and one add, no I2F
                cl = ((qb & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                ch = ((qb >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            else:
                cl = (qb & 15).to(tl.float32)
                ch = (qb >> 4).to(tl.float32)
            wl = (cl * se + ze).to(xe.dtype)
            wh = (ch * se + ze).to(xe.dtype)
            if IEEE:
                acc = tl.dot(wl, tl.trans(xe), acc, input_precision="ieee")
                acc = tl.dot(wh, tl.trans(xo), acc, input_precision="ieee")
            else:
                acc = tl.dot(wl, tl.trans(xe), acc)
                acc = tl.dot(wh, tl.trans(xo), acc)
        else:
            # codes are exact in the activation dtype: MMA on codes, then the affine map per group
            if MAGIC:  # bf16 bits 0x4300 | q are 128 + q: codes without int->float converts
                lo = ((qb & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
                hi = ((qb >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            else:
                lo = (qb & 15).to(xe.dtype)
                hi = (qb >> 4).to(xe.dtype)
            if IEEE:
                t = tl.dot(lo, tl.trans(xe), input_precision="ieee")
                t = tl.dot(hi, tl.trans(xo), t, input_precision="ieee")
            else:
                t = tl.dot(lo, tl.trans(xe))
                t = tl.dot(hi, tl.trans(xo), t)                                   # [BLOCK_N, ROWS]
            xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
            s = tl.load(s_ptr + g0 * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g0 * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if MAGIC:  # t holds sum (128 + q) x: take the 128 sum(x) back out through the zero term
                z = z - 128.0 * s
            acc += s[:, None] * t + z[:, None] * xs[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if not PARTIAL:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        base = y_ptr + pid_s * M * N
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


def q4_gemv(x: torch.Tensor, qw, cfg: Q4Config | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, already rotated if the weight is) @ dequant(qw)^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qw.shape[0]
    g = qw.group_size
    if m > ROWS:
        raise ValueError(f"q4_gemv serves at most {ROWS} rows, got M={m}")
    if qw.shape[1] != k:
        raise ValueError(f"q4_gemv: x has K={k} but the weight is {list(qw.shape)}")
    x = x.contiguous()
    cfg = cfg or q4_config(n, k, g)
    n_groups = k // g
    gps = cfg.gps if cfg.deq else 1  # the factorised form takes one group per step
    per = triton.cdiv(triton.cdiv(n_groups, cfg.split_k), gps) * gps
    split = triton.cdiv(n_groups, per)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    grid = (triton.cdiv(n, cfg.block_n), split)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _q4_gemv_kernel[grid](x, qw.qweight, qw.scales_t, qw.zeros_t, out, m, n, k, x.stride(0),
                          y.stride(0) if split == 1 else n, per,
                          BLOCK_N=cfg.block_n, G=g, GPS=gps, DEQ=cfg.deq,
                          MAGIC=cfg.magic and x.dtype == torch.bfloat16, ROWS_=ROWS, PARTIAL=split > 1,
                          IEEE=ieee,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        blk = 1024
        _splitk_sum[(triton.cdiv(m * n, blk),)](out, y, m * n, SPLIT=split, BLOCK=blk)
    return y
