"""Triton attention for a few query rows (decode, verify) over the KV cache, bf16 / fp32 or Q8.

Why this shape: one program scans one fixed span of SPLIT keys of one KV head for a tile of
BLOCK_M (row, query head) pairs, so a KV block loaded once serves every query head of the group
and every row (GQA packing, rows masked by causal position). Long contexts get parallelism from
the number of spans, not from the number of rows.

Row invariance (a row's result never depends on R): pair index r*rep + h is independent of R, so
a row always lands in the same tile slot of a kernel compiled with the same constants; keys past
a row's position contribute exactly zero (p = 0, running max unchanged); spans are fixed key
ranges [j*SPLIT, (j+1)*SPLIT) and the combine walks a row's own spans 0..pos//SPLIT in order. None
of SPLIT, BLOCK_M, BLOCK_N depends on R or pos0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT = 512      # keys per span (fixed: part of the reduction order)
BLOCK_M = 16     # (row, query-head) pairs per tile
BLOCK_N = 64     # keys per inner step


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, acc_ptr, ml_ptr,
                       pos0, n_rows, n_split, qk_scale,
                       sq_r, sq_h, sk_n, sk_h, sv_n, sv_h, sks_n, sks_h, svs_n, svs_h,
                       REP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, Q8: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       PREC: tl.constexpr):
    sid = tl.program_id(0)
    mt = tl.program_id(1)
    kvh = tl.program_id(2)
    hq = tl.num_programs(2) * REP
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)        # pair = row * REP + head-in-group
    row = offs_m // REP
    head = kvh * REP + offs_m % REP
    m_ok = row < n_rows
    pos = pos0 + row                                     # each row's own position
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * sq_r + head[:, None] * sq_h + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    if PREC == "ieee":
        q = q.to(tl.float32)
    start = sid * SPLIT
    hi = tl.minimum(start + SPLIT, pos0 + n_rows)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kp = k_ptr + offs_n[:, None] * sk_n + kvh * sk_h + offs_d[None, :]
        vp = v_ptr + offs_n[:, None] * sv_n + kvh * sv_h + offs_d[None, :]
        if Q8:
            kq = tl.load(kp, mask=n_ok[:, None], other=0).to(tl.float32)
            vq = tl.load(vp, mask=n_ok[:, None], other=0).to(tl.float32)
            ksc = tl.load(ks_ptr + offs_n[:, None] * sks_n + kvh * sks_h + offs_d[None, :] // G,
                          mask=n_ok[:, None], other=0.0).to(tl.float32)
            vsc = tl.load(vs_ptr + offs_n[:, None] * svs_n + kvh * svs_h + offs_d[None, :] // G,
                          mask=n_ok[:, None], other=0.0).to(tl.float32)
            k = (kq * ksc).to(q.dtype)
            v = (vq * vsc).to(q.dtype)
        else:
            k = tl.load(kp, mask=n_ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(vp, mask=n_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale      # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
        m_i = m_new
    # partials: acc [R, Hq, n_split, D], ml [R, Hq, n_split, 2]
    base = (row * hq + head) * n_split + sid
    tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=m_ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _attn_combine_kernel(acc_ptr, ml_ptr, out_ptr, pos0, n_split, hq,
                         D: tl.constexpr, SPLIT: tl.constexpr):
    """One (row, query head): merge the row's own spans 0..pos//SPLIT in order."""
    pid = tl.program_id(0)
    row = pid // hq
    n_own = (pos0 + row) // SPLIT + 1
    base = pid * n_split
    m = tl.load(ml_ptr + base * 2)
    for j in range(1, n_own):
        m = tl.maximum(m, tl.load(ml_ptr + (base + j) * 2))
    offs_d = tl.arange(0, D)
    l_sum = tl.zeros([1], tl.float32)
    o = tl.zeros([D], tl.float32)
    for j in range(0, n_own):
        w = tl.exp2(tl.load(ml_ptr + (base + j) * 2) - m)
        l_sum += tl.load(ml_ptr + (base + j) * 2 + 1) * w
        o += tl.load(acc_ptr + (base + j) * D + offs_d) * w
    tl.store(out_ptr + pid * D + offs_d, o / l_sum)


def attention_rows_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int, scale: float,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          block_m: int = BLOCK_M, split: int = SPLIT, block_n: int = BLOCK_N,
                          num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Contract of attention_rows_ref (q [R, Hq, D] -> float32 [R, Hq, D]); Q8 when scales are given."""
    r_rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    q8 = k_scale is not None
    if q.stride(-1) != 1:
        q = q.contiguous()
    n_keys = pos0 + r_rows
    n_split = triton.cdiv(n_keys, split)
    n_mt = triton.cdiv(r_rows * rep, block_m)
    acc = torch.empty(r_rows, hq, n_split, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(r_rows, hq, n_split, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(r_rows, hq, d, device=q.device, dtype=torch.float32)
    ks = k_scale if q8 else k_cache
    vs = v_scale if q8 else v_cache
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _attn_split_kernel[(n_split, n_mt, hkv)](
        q, k_cache, v_cache, ks, vs, acc, ml, pos0, r_rows, n_split, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        REP=rep, D=d, G=(d // k_scale.shape[-1]) if q8 else 1, Q8=q8, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split, PREC=prec, num_warps=num_warps, num_stages=num_stages)
    _attn_combine_kernel[(r_rows * hq,)](acc, ml, out, pos0, n_split, hq, D=d, SPLIT=split, num_warps=1)
    return out
