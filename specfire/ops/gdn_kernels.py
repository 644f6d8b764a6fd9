"""Triton kernels for the Gated DeltaNet rows path (decode, verify): the recurrence and the conv window.

The recurrence kernel reads the state once into registers (one program per value head and BV
value columns; columns of S evolve independently), applies the rows in order, and writes each
row's output and, with capture, the state after every row ([T, Hv, dk, dv] float32) so that
commit(n) is a copy. Every row runs the same instructions in the same order whatever T is, and a
later row starts from exactly the state an earlier row wrote, so verify rows equal decode rows
bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 32  # value columns per program


@triton.jit
def _gdn_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, cap_ptr, n_rows,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     CAPTURE: tl.constexpr):
    h = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    sm = k_ok[:, None] & v_ok[None, :]
    s_off = offs_k[:, None] * DV + offs_v[None, :]
    hs = DK * DV
    s = tl.load(s_ptr + h * hs + s_off, mask=sm, other=0.0).to(tl.float32)   # [BK, BV]
    for t in range(n_rows):
        kt = tl.load(k_ptr + t * sk_t + h * sk_h + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + t * sq_t + h * sq_h + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + t * sv_t + h * sv_h + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + t * sg_t + h).to(tl.float32)
        bt = tl.load(b_ptr + t * sb_t + h).to(tl.float32)
        s = s * tl.exp(gt)
        u = tl.sum(kt[:, None] * s, 0)                                         # [BV] = S^T k
        delta = bt * (vt - u)
        s = s + kt[:, None] * delta[None, :]
        o = tl.sum(qt[:, None] * s, 0)                                         # [BV] = S^T q
        tl.store(o_ptr + t * so_t + h * so_h + offs_v, o, mask=v_ok)
        if CAPTURE:
            tl.store(cap_ptr + (t * tl.num_programs(0) + h) * hs + s_off, s, mask=sm)
    if not CAPTURE:
        tl.store(cap_ptr + h * hs + s_off, s, mask=sm)


def gdn_rows_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, capture: bool = False, bv: int = BV,
                    num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of gdn_rows_ref: (o [T, Hv, dv] float32, states [T, Hv, dk, dv] or final [Hv, dk, dv])."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"gdn_rows: {name} must have a unit last stride")
    g = g.contiguous()
    beta = beta.contiguous()
    state = state.contiguous()
    o = torch.empty(t, hv, dv, device=q.device, dtype=torch.float32)
    out_s = torch.empty((t, hv, dk, dv) if capture else (hv, dk, dv), device=q.device, dtype=torch.float32)
    bv = min(bv, triton.next_power_of_2(dv))
    _gdn_rows_kernel[(hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, o, out_s, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1),
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, CAPTURE=capture, num_warps=num_warps)
    return o, out_s


@triton.jit
def _conv_window_kernel(full_ptr, w_ptr, out_ptr, n_rows, n_ch,
                        K: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < n_ch
    for t in range(n_rows):
        acc = tl.load(full_ptr + t * n_ch + offs_c, mask=c_ok, other=0.0).to(tl.float32) * \
            tl.load(w_ptr + offs_c * K, mask=c_ok, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            acc += tl.load(full_ptr + (t + j) * n_ch + offs_c, mask=c_ok, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * n_ch + offs_c, acc / (1.0 + tl.exp(-acc)), mask=c_ok)


def conv_window_triton(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                       block_c: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of conv_window_ref: (out [T, C] float32, full [K-1+T, C]). Each output is a fixed
    chain over the K taps, so a row's value never depends on T."""
    t, c = x.shape
    kk = w.shape[1]
    full = torch.cat([window.to(x.dtype), x], dim=0).contiguous()
    wc = w.contiguous()
    out = torch.empty(t, c, device=x.device, dtype=torch.float32)
    _conv_window_kernel[(triton.cdiv(c, block_c),)](full, wc, out, t, c, K=kk, BLOCK_C=block_c, num_warps=4)
    return out, full
