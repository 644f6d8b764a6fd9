"""Triton kernels of the Gated DeltaNet rows path and the previous prefill scan: the recurrence (state in registers,
rows in order, each row's update terms logged, no state written), the commit that replays rows 0..n
with the same FMAs (bit for bit), the conv window, and the chunk-to-chunk prefill scan."""
from __future__ import annotations

import torch
from .._triton import triton, tl

BV = 16         # value columns per program
NUM_WARPS = 1   # with BV = 16: measured best on the H200 for 2..16 rows
COMMIT_BV = 32  # value columns per program of the commit (27B heads: 48 layers x 48 heads x 4 programs)


@triton.jit
def _gdn_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, out_ptr, dec_ptr, n_rows,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     LOG: tl.constexpr):
    h = tl.program_id(0)
    hv = tl.num_programs(0)
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
        dec = tl.exp(gt)
        s = s * dec
        u = tl.sum(kt[:, None] * s, 0)                                         # [BV] = S^T k
        delta = bt * (vt - u)
        s = tl.fma(kt[:, None], delta[None, :], s)                             # as _gdn_commit_kernel
        o = tl.sum(qt[:, None] * s, 0)                                         # [BV] = S^T q
        tl.store(o_ptr + t * so_t + h * so_h + offs_v, o, mask=v_ok)
        if LOG:
            tl.store(out_ptr + (t * hv + h) * DV + offs_v, delta, mask=v_ok)
            tl.store(dec_ptr + t * hv + h, dec, mask=tl.program_id(1) == 0)
    if not LOG:
        tl.store(out_ptr + h * hs + s_off, s, mask=sm)


def gdn_rows_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, log: bool = False, bv: int = BV,
                    num_warps: int = NUM_WARPS):
    """Contract of gdn_rows_ref: (o [T, Hv, dv] float32, final [Hv, dk, dv]) or with `log`
    (o, (delta [T, Hv, dv], dec [T, Hv]))."""
    t, hv, dk = k.shape
    dv = v.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"gdn_rows: {name} must have a unit last stride")
    g = g.contiguous()
    beta = beta.contiguous()
    state = state.contiguous()
    o = torch.empty(t, hv, dv, device=q.device, dtype=torch.float32)
    out = torch.empty((t, hv, dv) if log else (hv, dk, dv), device=q.device, dtype=torch.float32)
    dec = torch.empty(t, hv, device=q.device, dtype=torch.float32) if log else out
    bv = min(bv, triton.next_power_of_2(dv))
    _gdn_rows_kernel[(hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, o, out, dec, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1),
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, LOG=log, num_warps=num_warps)
    return o, ((out, dec) if log else out)


@triton.jit(do_not_specialize=["n_rows"])   # one binary for every row count
def _gdn_commit_kernel(s_ptr, k_ptr, d_ptr, dec_ptr, n_rows, T, HV,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (layer * HV + head, column block): S := the state after the first n_rows logged rows."""
    lh = tl.program_id(0).to(tl.int64)
    layer = lh // HV
    h = lh % HV
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    sm = k_ok[:, None] & v_ok[None, :]
    ptrs = s_ptr + lh * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(ptrs, mask=sm, other=0.0)
    for t in range(n_rows):
        row = (layer * T + t) * HV + h
        dec = tl.load(dec_ptr + row)
        kt = tl.load(k_ptr + row * DK + offs_k, mask=k_ok, other=0.0)
        dt = tl.load(d_ptr + row * DV + offs_v, mask=v_ok, other=0.0)
        s = tl.fma(kt[:, None], dt[None, :], s * dec)       # the rows kernels' update, operation for operation
    tl.store(ptrs, s, mask=sm)


def commit_rows_triton(states: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, dec: torch.Tensor, rows: int,
                       bv: int = COMMIT_BV, num_warps: int = 2) -> None:
    """Contract of kernels/gdn commit_rows_ref (states modified in place), one launch for every layer."""
    n_l, hv, dk, dv = states.shape
    t = k.shape[1]
    if (tuple(k.shape) != (n_l, t, hv, dk) or tuple(delta.shape) != (n_l, t, hv, dv)
            or tuple(dec.shape) != (n_l, t, hv)):
        raise ValueError(f"commit: logs k {list(k.shape)}, delta {list(delta.shape)}, dec {list(dec.shape)} "
                         f"do not match states {list(states.shape)}")
    for name, x in (("states", states), ("k", k), ("delta", delta), ("dec", dec)):
        if not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError(f"commit: {name} must be contiguous float32")
    if rows == 0:
        return
    bv = min(bv, triton.next_power_of_2(dv))
    _gdn_commit_kernel[(n_l * hv, triton.cdiv(dv, bv))](
        states, k, delta, dec, rows, t, hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, num_warps=num_warps)


@triton.jit
def _conv_window_kernel(full_ptr, w_ptr, out_ptr, n_rows, n_ch,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row block, channel block): a [BLOCK_T, BLOCK_C] tile of the conv + SiLU."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < n_ch
    m = (offs_t < n_rows)[:, None] & c_ok[None, :]
    ptrs = full_ptr + offs_t[:, None] * n_ch + offs_c[None, :]
    acc = tl.load(ptrs, mask=m, other=0.0).to(tl.float32) * \
        tl.load(w_ptr + offs_c * K, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(1, K):
        acc += tl.load(ptrs + j * n_ch, mask=m, other=0.0).to(tl.float32) * \
            tl.load(w_ptr + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_t[:, None] * n_ch + offs_c[None, :], acc / (1.0 + tl.exp(-acc)), mask=m)


def conv_window_triton(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                       block_c: int = 128, block_t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of conv_window_ref: (out [T, C] float32, full [K-1+T, C]), over a grid of row
    blocks x channel blocks. Each output is a fixed chain over the K taps, so a row's value never
    depends on T or on the tile it falls in."""
    t, c = x.shape
    kk = w.shape[1]
    full = torch.cat([window.to(x.dtype), x], dim=0).contiguous()
    wc = w.contiguous()
    out = torch.empty(t, c, device=x.device, dtype=torch.float32)
    block_t = min(block_t, triton.next_power_of_2(max(t, 1)))
    _conv_window_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        full, wc, out, t, c, K=kk, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return out, full
