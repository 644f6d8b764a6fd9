"""One Triton kernel for a Gated DeltaNet layer's rows forward, from the projections to what out_proj
reads (conv + SiLU, q/k norms, gates, the delta rule, the gated norm on whole heads); it writes no
state but logs what commit replays, and T rows equal T chained one-row calls bit for bit."""
from __future__ import annotations

import torch
from .._triton import triton, tl

from . import FUSED_MAX_CONV as MAX_CONV
from . import ref as gdn_ops
from .. import pdl
from .. import lanes
from ..norm.ref import gated_rms_norm_ref
from ..pdl import wait as pdl_wait

BV = 32         # value columns per program (the gated norm then runs as its own launch)
NUM_WARPS = 2   # the H200's best for the 27B heads (128 x 128) with BV = 32


def gdn_decode_ref(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, hk: int, dk: int, dv: int,
                   z: torch.Tensor | None = None, norm_w: torch.Tensor | None = None,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused composition (model/qwen35.py GatedDeltaNet, rows mode). qkv [T, C] projections,
    a, b [T, Hv], window [K-1, C] float32, w [C, K], state [Hv, dk, dv] float32, optionally z
    [T, Hv * dv] and the gated norm's weight [dv] -> (o [T, Hv, dv] in qkv's dtype, normed when z
    is given; the rows' log (k [T, Hv, dk], delta [T, Hv, dv], dec [T, Hv]) that kernels/gdn
    commit_rows replays; full window [K-1+T, C])."""
    t, hv = qkv.shape[0], a.shape[1]
    conv_out, full = gdn_ops.conv_window_ref(qkv.float(), window, w)
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    beta = lanes.sigmoid(b.float())
    g = -lanes.exp(a_log.float()) * lanes.softplus(a.float() + dt_bias.float())
    q = q * lanes.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * (dk ** -0.5)
    k = k * lanes.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    rep = hv // hk
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    o, (delta, dec) = gdn_ops.gdn_rows_ref(q, k, v, g, beta, state, log=True)
    o = o.to(qkv.dtype)
    if z is not None:
        o = gated_rms_norm_ref(o, z.reshape(t, hv, dv), norm_w, eps)
    return o, (k, delta, dec), full


@triton.jit
def _add4(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _conv_taps(c1, c2, c3, x, w0, w1, w2, w3, K: tl.constexpr):
    """The causal conv's output row from the last K full-window rows held in registers (c1, c2, c3
    the three before the projection row x; K <= 4), tap j times weight j, explicit FMAs."""
    if K == 4:
        acc = c1 * w0
        acc = tl.fma(c2, w1, acc)
        acc = tl.fma(c3, w2, acc)
        acc = tl.fma(x, w3, acc)
    elif K == 3:
        acc = c2 * w0
        acc = tl.fma(c3, w1, acc)
        acc = tl.fma(x, w2, acc)
    else:
        acc = c3 * w0
        acc = tl.fma(x, w1, acc)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _win_row(win_ptr, i: tl.constexpr, ch, ok, C):
    """Window row i (float32) at channels ch; zeros for i < 0 (a conv shorter than 4 taps)."""
    if i >= 0:
        r = tl.load(win_ptr + i * C + ch, mask=ok, other=0.0).to(tl.float32)
    else:
        r = tl.load(win_ptr + ch, mask=ok & (i >= 0), other=0.0).to(tl.float32)
    return r


@triton.jit
def _w_tap(w_ptr, ch, ok, j: tl.constexpr, K: tl.constexpr):
    return tl.load(w_ptr + ch * K + j, mask=ok & (j < K), other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["n_rows"])   # one binary for every row count: row t runs the same code
def _gdn_merged_kernel(x_ptr, a_ptr, b_ptr, win_ptr, w_ptr, alog_ptr, dtb_ptr, s_ptr, z_ptr, nw_ptr,
                       o_ptr, klog_ptr, dlog_ptr, declog_ptr, full_ptr, n_rows, sx, sa, sb, sz, C, KEY_DIM, q_scale,
                       eps, REP: tl.constexpr, K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, KM1P: tl.constexpr, NORM: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Row t's terms that do not depend on the state
    (conv window + SiLU from registers, the gates) are made one row ahead, and the one cross-lane
    reduction a row needs runs as a single four-operand reduce over the key axis: row t+1's
    sum(q^2), sum(k^2), sum(k * S_t exp(g_t+1)) with row t's sum(q * S_t). So
    u_t+1 = rsqrt(sum(k^2) + 1e-6) * sum(k * S exp(g)) (the unnormalised k against the state, then
    scaled), o_t = sum(q * S) * (rsqrt(sum(q^2) + 1e-6) * scale), and the update writes
    S = fma(k_hat, delta, S exp(g)) with k_hat = k * rsqrt(...) as logged (the commit replays it).
    Every row runs this code whatever the row count (past the last row the next row's inputs are
    masked zeros, in operands of their own), so T rows == T chained single rows bit for bit."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    h = tl.program_id(0)
    vb = tl.program_id(1)
    hv = tl.num_programs(0)
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < DK
    ar = tl.arange(0, BV)
    # the value columns: 4-element runs as far as the compiler can tell, and no mask where BV divides
    # DV, so the [BV] vectors' loads and stores take the layout the reductions leave them in (no
    # shared-memory round trip per row)
    offs_v = vb * BV + ar
    if DV % BV == 0:
        v_ok = ar < BV
    else:
        v_ok = offs_v < DV
    cq = (h // REP) * DK + offs_k
    ck = KEY_DIM + cq
    cv = 2 * KEY_DIM + h * DV + offs_v
    own = offs_k < DK * ((vb + h % REP) == 0).to(tl.int32)   # one program writes a key head's q/k window
    first_k = offs_k < DK * (vb == 0).to(tl.int32)           # one program writes a value head's logged k
    offs_r = tl.arange(0, KM1P)
    r_ok = offs_r < K - 1
    wm_k = r_ok[:, None] & own[None, :]
    wm_v = r_ok[:, None] & v_ok[None, :]
    win_q = tl.load(win_ptr + offs_r[:, None] * C + cq[None, :], mask=wm_k, other=0.0)
    win_k = tl.load(win_ptr + offs_r[:, None] * C + ck[None, :], mask=wm_k, other=0.0)
    win_v = tl.load(win_ptr + offs_r[:, None] * C + cv[None, :], mask=wm_v, other=0.0)
    hs = DK * DV
    sm = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptr + h * hs + offs_k[:, None] * DV + offs_v[None, :], mask=sm, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    # loop-invariant: the conv weights, and the window's last K-1 rows in registers (c1 c2 c3, oldest first)
    wq0, wq1 = _w_tap(w_ptr, cq, k_ok, 0, K), _w_tap(w_ptr, cq, k_ok, 1, K)
    wq2, wq3 = _w_tap(w_ptr, cq, k_ok, 2, K), _w_tap(w_ptr, cq, k_ok, 3, K)
    wk0, wk1 = _w_tap(w_ptr, ck, k_ok, 0, K), _w_tap(w_ptr, ck, k_ok, 1, K)
    wk2, wk3 = _w_tap(w_ptr, ck, k_ok, 2, K), _w_tap(w_ptr, ck, k_ok, 3, K)
    wv0, wv1 = _w_tap(w_ptr, cv, v_ok, 0, K), _w_tap(w_ptr, cv, v_ok, 1, K)
    wv2, wv3 = _w_tap(w_ptr, cv, v_ok, 2, K), _w_tap(w_ptr, cv, v_ok, 3, K)
    q1 = _win_row(win_ptr, K - 4, cq, k_ok, C)
    q2 = _win_row(win_ptr, K - 3, cq, k_ok, C)
    q3 = _win_row(win_ptr, K - 2, cq, k_ok, C)
    k1 = _win_row(win_ptr, K - 4, ck, k_ok, C)
    k2 = _win_row(win_ptr, K - 3, ck, k_ok, C)
    k3 = _win_row(win_ptr, K - 2, ck, k_ok, C)
    v1 = _win_row(win_ptr, K - 4, cv, v_ok, C)
    v2 = _win_row(win_ptr, K - 3, cv, v_ok, C)
    v3 = _win_row(win_ptr, K - 2, cv, v_ok, C)
    # rows 0 and 1's own inputs (projections, a, b, z), masked past the last row; int-product masks
    go0 = (h * 0 < n_rows).to(tl.int32)
    go = go0
    gk = k_ok & (offs_k < BK * go)
    gv = v_ok & (tl.arange(0, BV) < BV * go)
    xq = tl.load(x_ptr + cq, mask=gk, other=0.0).to(tl.float32)
    xk = tl.load(x_ptr + ck, mask=gk, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + cv, mask=gv, other=0.0).to(tl.float32)
    xa = tl.load(a_ptr + h, mask=go > 0, other=0.0).to(tl.float32)
    xb = tl.load(b_ptr + h, mask=go > 0, other=0.0).to(tl.float32)
    if NORM:
        zn = tl.load(z_ptr + h * DV + offs_v, mask=gv, other=0.0).to(tl.float32)
    go = (h * 0 + 1 < n_rows).to(tl.int32)
    gk = k_ok & (offs_k < BK * go)
    gv = v_ok & (tl.arange(0, BV) < BV * go)
    pq = tl.load(x_ptr + sx + cq, mask=gk, other=0.0).to(tl.float32)
    pk = tl.load(x_ptr + sx + ck, mask=gk, other=0.0).to(tl.float32)
    pv = tl.load(x_ptr + sx + cv, mask=gv, other=0.0).to(tl.float32)
    pa = tl.load(a_ptr + sa + h, mask=go > 0, other=0.0).to(tl.float32)
    pb = tl.load(b_ptr + sb + h, mask=go > 0, other=0.0).to(tl.float32)
    if NORM:
        pz = tl.load(z_ptr + sz + h * DV + offs_v, mask=gv, other=0.0).to(tl.float32)
    # row 0's state-free terms and its reduce (no row before it: the o operand is zeros); q and k are
    # carried as columns [BK, 1] and v as a row [1, BV] of the state's layout
    qn = _conv_taps(q1, q2, q3, xq, wq0, wq1, wq2, wq3, K)
    kn = _conv_taps(k1, k2, k3, xk, wk0, wk1, wk2, wk3, K)
    vn = _conv_taps(v1, v2, v3, xv, wv0, wv1, wv2, wv3, K)
    q1, q2, q3, k1, k2, k3, v1, v2, v3 = q2, q3, xq, k2, k3, xk, v2, v3, xv
    at = xa + dtb
    decn = tl.exp(neg_a * tl.where(at > 20.0, at, tl.log(1.0 + tl.exp(at))))   # exp(g), softplus threshold 20
    betan = 1.0 / (1.0 + tl.exp(-xb))
    s_dec = s * decn
    kk2 = tl.broadcast_to(kn[:, None], (BK, BV))
    qq2 = tl.broadcast_to(qn[:, None], (BK, BV))
    sq, sk, su, so = tl.reduce((qq2 * qq2, kk2 * kk2, kk2 * s_dec, tl.zeros([BK, BV], tl.float32)), 0, _add4)
    rq = 1.0 / tl.sqrt(sq + 1e-6)
    rk = 1.0 / tl.sqrt(sk + 1e-6)
    tl.store(klog_ptr + h * DK + offs_k, kn * tl.max(rk, 0), mask=first_k & (offs_k < BK * go0))
    qn = qn[:, None]
    kn = kn[:, None]
    for t in range(n_rows):
        # the next-but-one row's inputs, loaded ahead (masked past the last row)
        go = (h * 0 + t + 2 < n_rows).to(tl.int32)
        gk = k_ok & (offs_k < BK * go)
        gv = v_ok & (tl.arange(0, BV) < BV * go)
        nq = tl.load(x_ptr + (t + 2) * sx + cq, mask=gk, other=0.0).to(tl.float32)
        nk = tl.load(x_ptr + (t + 2) * sx + ck, mask=gk, other=0.0).to(tl.float32)
        nv = tl.load(x_ptr + (t + 2) * sx + cv, mask=gv, other=0.0).to(tl.float32)
        na = tl.load(a_ptr + (t + 2) * sa + h, mask=go > 0, other=0.0).to(tl.float32)
        nb = tl.load(b_ptr + (t + 2) * sb + h, mask=go > 0, other=0.0).to(tl.float32)
        if NORM:
            nz = tl.load(z_ptr + (t + 2) * sz + h * DV + offs_v, mask=gv, other=0.0).to(tl.float32)
        # row t's inputs (its u, norms and gates came with the previous reduce); its window row stored
        q, k, dec, beta, v, su_t, rk_t, rq_t = qn, kn, decn, betan, vn, su, rk, rq
        if NORM:
            zt = zn
            zn = pz
            pz = nz
        tl.store(full_ptr + (K - 1 + t) * C + cv, v3, mask=v_ok)
        tl.store(full_ptr + (K - 1 + t) * C + cq, q3, mask=own)
        tl.store(full_ptr + (K - 1 + t) * C + ck, k3, mask=own)
        # row t+1's state-free terms first: their loads came a row earlier, and their layout changes
        # (shared memory) overlap row t's update below instead of following it
        qn = _conv_taps(q1, q2, q3, pq, wq0, wq1, wq2, wq3, K)
        kn = _conv_taps(k1, k2, k3, pk, wk0, wk1, wk2, wk3, K)
        vn = _conv_taps(v1, v2, v3, pv, wv0, wv1, wv2, wv3, K)
        q1, q2, q3, k1, k2, k3, v1, v2, v3 = q2, q3, pq, k2, k3, pk, v2, v3, pv
        at = pa + dtb
        decn = tl.exp(neg_a * tl.where(at > 20.0, at, tl.log(1.0 + tl.exp(at))))
        betan = 1.0 / (1.0 + tl.exp(-pb))
        kk2 = tl.broadcast_to(kn[:, None], (BK, BV))
        qq2 = tl.broadcast_to(qn[:, None], (BK, BV))
        # row t: the update
        delta = beta * (v - su_t * rk_t)                                       # [BV]
        s = tl.fma(k * rk_t[None, :], delta[None, :], s_dec)                   # as _gdn_commit_kernel
        # from the state's layout: the [BK, BV] broadcast, its first key row stored (no layout change)
        tl.store(dlog_ptr + (t * hv + h) * DV + offs_v[None, :] + 0 * offs_k[:, None],
                 tl.broadcast_to(delta[None, :], (BK, BV)), mask=(offs_k[:, None] == 0) & v_ok[None, :])
        tl.store(declog_ptr + t * hv + h, dec, mask=vb == 0)
        s_dec = s * decn
        # one reduce: row t+1's norms and S^T k, row t's S^T q
        sq, sk, su, so = tl.reduce((qq2 * qq2, kk2 * kk2, kk2 * s_dec, tl.broadcast_to(q, (BK, BV)) * s), 0, _add4)
        rq = 1.0 / tl.sqrt(sq + 1e-6)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
        o = so * (rq_t * q_scale)                                              # [BV]
        dt = o_ptr.dtype.element_ty
        if NORM:   # the gated RMSNorm with kernels/norm/kernel.py's rounding points (o rounded first)
            ob = o.to(dt).to(tl.float32)
            n = (ob * (1.0 / tl.sqrt(tl.sum(ob * ob, 0) / DV + eps))).to(dt).to(tl.float32)
            o = (nw * n).to(dt).to(tl.float32) * (zt / (1.0 + tl.exp(-zt)))
        tl.store(o_ptr + (t * hv + h) * DV + offs_v, o.to(dt), mask=v_ok)
        tl.store(klog_ptr + ((t + 1) * hv + h) * DK + offs_k, kn * tl.max(rk, 0),
                 mask=first_k & (offs_k < BK * (h * 0 + t + 1 < n_rows).to(tl.int32)))
        qn = qn[:, None]
        kn = kn[:, None]
        pq, pk, pv, pa, pb = nq, nk, nv, na, nb
    tl.store(full_ptr + offs_r[:, None] * C + cv[None, :], win_v, mask=wm_v)
    tl.store(full_ptr + offs_r[:, None] * C + cq[None, :], win_q, mask=wm_k)
    tl.store(full_ptr + offs_r[:, None] * C + ck[None, :], win_k, mask=wm_k)


def gdn_decode_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                      a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, hk: int, dk: int, dv: int,
                      z: torch.Tensor | None = None, norm_w: torch.Tensor | None = None, eps: float = 1e-6,
                      bv: int | None = None, num_warps: int | None = None,
                      out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """Contract of gdn_decode_ref. `out`: where to write the log and the full window, (k [T, Hv,
    dk], delta [T, Hv, dv], dec [T, Hv], full [K-1+T, C]), contiguous float32 (default: new). bv (default BV; None: the whole head) splits a head's value
    columns over programs and num_warps (default NUM_WARPS) the reductions' lanes: neither changes
    a row's dependence on other rows or heads. The gated norm (z given) runs inside the launch on
    whole heads, else as kernels/norm/kernel.py's kernel after it."""
    t, c = qkv.shape
    hv, kk = a.shape[1], w.shape[-1]
    if c != 2 * hk * dk + hv * dv or hv % hk or not 2 <= kk <= MAX_CONV:
        raise ValueError(f"gdn_decode: channels {c} != 2*{hk}*{dk} + {hv}*{dv}, or Hv % Hk, or conv K={kk} "
                         f"outside 2..{MAX_CONV}")
    if z is not None and (norm_w is None or tuple(z.shape) != (t, hv * dv)):
        raise ValueError(f"gdn_decode: the gated norm needs its weight and z of shape [{t}, {hv * dv}] "
                         f"(got {list(z.shape)})")
    for name, x in (("qkv", qkv), ("a", a), ("b", b), ("z", z)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"gdn_decode: {name} must have a unit last stride")
    bv = bv or BV
    bv = triton.next_power_of_2(dv) if bv is None else min(bv, triton.next_power_of_2(dv))
    norm = z is not None and bv >= dv
    window, w, state = window.contiguous(), w.contiguous(), state.contiguous()
    o = torch.empty(t, hv, dv, device=qkv.device, dtype=qkv.dtype)
    if out is None:
        out = (torch.empty(t, hv, dk, device=qkv.device, dtype=torch.float32),
               torch.empty(t, hv, dv, device=qkv.device, dtype=torch.float32),
               torch.empty(t, hv, device=qkv.device, dtype=torch.float32),
               torch.empty(kk - 1 + t, c, device=qkv.device, dtype=torch.float32))
    shapes = ((t, hv, dk), (t, hv, dv), (t, hv), (kk - 1 + t, c))
    if any(tuple(x.shape) != sh or x.dtype != torch.float32 or not x.is_contiguous() for x, sh in zip(out, shapes)):
        raise ValueError(f"gdn_decode: out must be contiguous float32 of shapes {shapes}, "
                         f"got {[tuple(x.shape) for x in out]}")
    klog, dlog, declog, full = out
    zz = z if norm else o
    _gdn_merged_kernel[(hv, triton.cdiv(dv, bv))](
        qkv, a, b, window, w, a_log, dt_bias, state, zz, norm_w if norm else a_log, o, klog, dlog, declog, full,
        t, qkv.stride(0), a.stride(0), b.stride(0), zz.stride(0), c, hk * dk, dk ** -0.5, eps,
        REP=hv // hk, K=kk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
        KM1P=triton.next_power_of_2(kk - 1), NORM=norm, num_warps=num_warps or NUM_WARPS, **pdl.kw(qkv))
    if z is not None and not norm:      # split heads: the norm as its own launch
        from ..norm.kernel import gated_rms_norm_triton
        o = gated_rms_norm_triton(o, z.view(t, hv, dv), norm_w, eps)
    return o, (klog, dlog, declog), full
