"""Triton kernels of the Gated DeltaNet prefill (the chunked form of kernels/gdn/ref.py
gdn_chunked_ref) in three passes over chunks of C rows:

1. terms, a program per (chunk, value head): the cumulative log decay G, A = beta K K^T decay
   (strictly lower), (I + A)^-1 by forward substitution in registers, W = (I + A)^-1 beta v and
   U = (I + A)^-1 beta exp(G) k;
2. state, a program per (value head, value columns): the chunks in order, each chunk's start
   state and delta = W - U S kept;
3. output, a program per (chunk, value head, value columns): exp(G) q S + (Q K^T decay) delta.

Value head j reads key head j // r in place (no repeated copies). Every program computes one
head from that head's rows alone (no tile spans two heads), so a head's bits do not depend on how
many heads a call holds: the tensor-parallel invariant forward keeps this path.
"""
from __future__ import annotations

import torch

from .._triton import tl, triton

PRECISION = "tf32x3"   # float32 dot inputs as three tf32 products: float32-close on tensor cores
PIECE = 2048           # rows per pass of the three kernels: buffers bounded whatever the prompt length
STATE_BV = 32          # value columns per program of the state pass
OUT_BV = 64            # value columns per program of the output pass


@triton.jit
def _terms_kernel(k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, gc_ptr, t_len, n_chunks,
                  sk_t, sk_h, sv_t, sv_h, sg_t, sb_t,
                  R: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // R
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    rows = c * C + offs_c
    ok = rows < t_len
    k_ptrs = k_ptr + rows[:, None] * sk_t + hk * sk_h + offs_k[None, :]
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)                       # [C, DK]
    g = tl.load(g_ptr + rows * sg_t + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + rows * sb_t + h, mask=ok, other=0.0).to(tl.float32)
    gcum = tl.cumsum(g, 0)                                                                 # [C]
    ri = offs_c[:, None]
    ci = offs_c[None, :]
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)                                      # [C, C]
    # at[j, i] = A[i, j] = beta_i k_i . k_j exp(G_i - G_j) for i > j (the transpose: its rows index j)
    low = ci > ri
    at = tl.where(low, beta[None, :] * kk * tl.exp(tl.where(low, gcum[None, :] - gcum[:, None], 0.0)), 0.0)
    x = tl.where(ri == ci, 1.0, 0.0)                                                       # (I + A)^-1
    for i in range(1, C):       # row i = e_i - sum_{j<i} A[i, j] row j (rows < i final)
        a = tl.sum(tl.where(ci == i, at, 0.0), 1)                                          # A[i, :] over j
        new = tl.sum(a[:, None] * x, 0)
        x = tl.where(ri == i, tl.where(ci == i, 1.0, 0.0) - new[None, :], x)
    v = tl.load(v_ptr + rows[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.dot(x, beta[:, None] * v, input_precision=PREC)                                # [C, DV]
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    u = tl.dot(x, (beta * tl.exp(gcum))[:, None] * k, input_precision=PREC)               # [C, DK]
    hc = h * n_chunks + c
    tl.store(w_ptr + (hc * C + offs_c[:, None]) * DV + offs_v[None, :], w)
    tl.store(u_ptr + (hc * C + offs_c[:, None]) * DK + offs_k[None, :], u)
    tl.store(gc_ptr + hc * C + offs_c, gcum)


@triton.jit
def _state_kernel(k_ptr, u_ptr, w_ptr, gc_ptr, s0_ptr, sc_ptr, d_ptr, sout_ptr, t_len, n_chunks, sk_t, sk_h,
                  R: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr):
    h = tl.program_id(0)
    hk = h // R
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    s_off = offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s0_ptr + h * DK * DV + s_off).to(tl.float32)                              # [DK, BV]
    for c in range(n_chunks):
        hc = h * n_chunks + c
        tl.store(sc_ptr + hc * DK * DV + s_off, s)
        u = tl.load(u_ptr + (hc * C + offs_c[:, None]) * DK + offs_k[None, :])            # [C, DK]
        w = tl.load(w_ptr + (hc * C + offs_c[:, None]) * DV + offs_v[None, :])            # [C, BV]
        delta = w - tl.dot(u, s, input_precision=PREC)
        tl.store(d_ptr + (hc * C + offs_c[:, None]) * DV + offs_v[None, :], delta)
        gcum = tl.load(gc_ptr + hc * C + offs_c)
        glast = tl.load(gc_ptr + hc * C + C - 1)
        rows = c * C + offs_c
        k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=(rows < t_len)[:, None],
                    other=0.0).to(tl.float32)
        kdec = k * tl.exp(glast - gcum)[:, None]
        s = tl.exp(glast) * s + tl.dot(tl.trans(kdec), delta, input_precision=PREC)
    tl.store(sout_ptr + h * DK * DV + s_off, s)


@triton.jit
def _output_kernel(q_ptr, k_ptr, gc_ptr, d_ptr, sc_ptr, o_ptr, t_len, n_chunks, sq_t, sq_h, sk_t, sk_h, so_t, so_h,
                   R: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // R
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = c * C + offs_c
    ok = rows < t_len
    q = tl.load(q_ptr + rows[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    hc = h * n_chunks + c
    gcum = tl.load(gc_ptr + hc * C + offs_c)
    delta = tl.load(d_ptr + (hc * C + offs_c[:, None]) * DV + offs_v[None, :])            # [C, BV]
    s = tl.load(sc_ptr + hc * DK * DV + offs_k[:, None] * DV + offs_v[None, :])           # [DK, BV]
    causal = offs_c[:, None] >= offs_c[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * \
        tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], float("-inf")))           # [C, C]
    o = tl.exp(gcum)[:, None] * tl.dot(q, s, input_precision=PREC) + tl.dot(qk, delta, input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * so_t + h * so_h + offs_v[None, :], o, mask=ok[:, None])


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor, chunk: int) -> None:
    """A clear error for inputs the kernels cannot take."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if tuple(q.shape) != (t, hk, dk) or v.shape[0] != t or hv % hk:
        raise ValueError(f"gdn prefill: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: "
                         "q and k must share [T, Hk, dk] and v [T, Hv, dv] with Hv a multiple of Hk")
    if tuple(g.shape) != (t, hv) or tuple(beta.shape) != (t, hv) or tuple(state.shape) != (hv, dk, dv):
        raise ValueError(f"gdn prefill: g {list(g.shape)}, beta {list(beta.shape)}, state {list(state.shape)} "
                         f"do not match T={t}, Hv={hv}, dk={dk}, dv={dv}")
    if not (_pow2_at_least_16(dk) and _pow2_at_least_16(dv) and _pow2_at_least_16(chunk)):
        raise ValueError(f"gdn prefill: dk={dk}, dv={dv}, chunk={chunk} must be powers of two >= 16")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"gdn prefill: {name} must have a unit last stride")


def gdn_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64, piece: int = PIECE, state_bv: int = STATE_BV,
                       out_bv: int = OUT_BV, precision: str = PRECISION) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of gdn_chunked_ref with q, k [T, Hk, dk] key heads for v [T, Hv, dv] (value head j
    reads key head j // (Hv / Hk)). Rows go through the passes `piece` rows at a time (a multiple
    of `chunk`); the result does not depend on `piece`."""
    check(q, k, v, g, beta, state, chunk)
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    dev = q.device
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(t, hv, dv, device=dev, dtype=torch.float32)
    s = state.float().contiguous().clone()
    if t == 0:
        return o, s
    piece = max(chunk, piece // chunk * chunk)
    rows = min(t, piece)
    n_max = triton.cdiv(rows, chunk)
    f32 = dict(device=dev, dtype=torch.float32)
    w, dbuf = torch.empty(hv, n_max, chunk, dv, **f32), torch.empty(hv, n_max, chunk, dv, **f32)
    u = torch.empty(hv, n_max, chunk, dk, **f32)
    gc = torch.empty(hv, n_max, chunk, **f32)
    sc = torch.empty(hv, n_max, dk, dv, **f32)
    s_next = torch.empty_like(s)
    state_bv, out_bv = min(state_bv, dv), min(out_bv, dv)
    common = dict(R=hv // hk, C=chunk, DK=dk, DV=dv, PREC=precision)
    for lo in range(0, t, piece):
        hi = min(t, lo + piece)
        n = triton.cdiv(hi - lo, chunk)
        qp, kp, vp, gp, bp, op = q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], o[lo:hi]
        _terms_kernel[(n, hv)](kp, vp, gp, bp, w, u, gc, hi - lo, n, kp.stride(0), kp.stride(1), vp.stride(0),
                               vp.stride(1), gp.stride(0), bp.stride(0), **common, num_warps=8, num_stages=1)
        _state_kernel[(hv, dv // state_bv)](kp, u, w, gc, s, sc, dbuf, s_next, hi - lo, n, kp.stride(0), kp.stride(1),
                                            BV=state_bv, **common, num_warps=8, num_stages=1)
        _output_kernel[(n, hv, dv // out_bv)](qp, kp, gc, dbuf, sc, op, hi - lo, n, qp.stride(0), qp.stride(1),
                                              kp.stride(0), kp.stride(1), op.stride(0), op.stride(1), BV=out_bv,
                                              **common, num_warps=8, num_stages=1)
        s, s_next = s_next, s
    return o, s
