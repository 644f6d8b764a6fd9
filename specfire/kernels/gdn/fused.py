"""One Triton kernel for a Gated DeltaNet layer's rows forward, from the projections to what out_proj
reads (conv + SiLU, q/k norms, gates, the delta rule, the gated norm on whole heads); it writes no
state but logs what commit replays, and T rows equal T chained one-row calls bit for bit."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from .._triton import triton, tl

from . import FUSED_MAX_CONV as MAX_CONV
from . import ref as gdn_ops
from .. import pdl
from .. import lanes
from ..norm.ref import gated_rms_norm_ref
from ..pdl import wait as pdl_wait

BV = 32         # value columns per program (the gated norm then runs as its own launch)
SEQ_COLS = 8    # a sequence's table row: first row, row count, addresses of rec, conv, k, delta, dec, full
_SEQ_COLS = tl.constexpr(SEQ_COLS)   # (the kernel's copy: a jit function reads constexpr globals only)
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


@triton.jit
def _seq_ptr(row_ptr, col: tl.constexpr, ALIGNED: tl.constexpr):
    """The float32 buffer whose address is column `col` of a sequence's table row (16-byte aligned
    as the host checked, told to the compiler: the loads and stores vectorise as on a pointer argument)."""
    p = tl.load(row_ptr + col).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit(do_not_specialize=["layer"])   # one binary for every layer (a layer index of 1 is no constant)
def _gdn_merged_kernel(x_ptr, a_ptr, b_ptr, w_ptr, alog_ptr, dtb_ptr, z_ptr, nw_ptr, o_ptr, seq_ptr, layer,
                       sx, sa, sb, sz, C, KEY_DIM, q_scale,
                       eps, REP: tl.constexpr, K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, KM1P: tl.constexpr, NORM: tl.constexpr,
                       ALIGNED: tl.constexpr, PDL: tl.constexpr = False):
    """Sequence program_id(2)'s rows: its first row and row count, and the addresses of its state
    and log (each the base of a [L, ...] stack whose slice `layer` is this layer's) come from its
    row of the table `seq_ptr` (SEQ_COLS int64s); the row count is data, not a constant, so one
    binary serves every row count and every mix of them. Row t's terms that do not depend on the state
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
    # this sequence: its rows of the packed inputs and output, its layer's slice of each stack
    row_ptr = seq_ptr + tl.program_id(2) * _SEQ_COLS
    row0 = tl.load(row_ptr)
    n_rows = tl.load(row_ptr + 1).to(tl.int32)
    x_ptr += row0 * sx
    a_ptr += row0 * sa
    b_ptr += row0 * sb
    z_ptr += row0 * sz
    o_ptr += row0 * (hv * DV)
    s_ptr = _seq_ptr(row_ptr, 2, ALIGNED) + layer * hv * (DK * DV)
    win_ptr = _seq_ptr(row_ptr, 3, ALIGNED) + layer * (K - 1) * C
    klog_ptr = _seq_ptr(row_ptr, 4, ALIGNED) + layer * n_rows * hv * DK
    dlog_ptr = _seq_ptr(row_ptr, 5, ALIGNED) + layer * n_rows * hv * DV
    declog_ptr = _seq_ptr(row_ptr, 6, ALIGNED) + layer * n_rows * hv
    full_ptr = _seq_ptr(row_ptr, 7, ALIGNED) + layer * (K - 1 + n_rows) * C
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


def _check(qkv, a, b, w, hk, dk, dv, z, norm_w) -> tuple[int, int, int, int]:
    """The launch's rows T, channels C, value heads Hv and conv taps K, after checking the shapes."""
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
    return t, c, hv, kk


@dataclass(frozen=True)
class SeqTable:
    """Where each sequence of a multi-sequence launch lives: `data` int64 [S, SEQ_COLS] on the
    kernel's device, row s = (first row, row count T, addresses of its float32 rec [L, Hv, dk, dv],
    conv [L, K-1, C], k [L, T, Hv, dk], delta [L, T, Hv, dv], dec [L, T, Hv], full [L, K-1+T, C]);
    `spans` the same rows on the host, `layers` L, `dims` (Hv, dk, dv, K-1, C), `aligned` every
    address a multiple of 16 bytes. A CUDA graph reads `data` at replay: build it outside the
    capture and keep it while the graph lives."""
    data: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    layers: int
    dims: tuple[int, ...]
    aligned: bool


def seq_table(spans: list[tuple[int, int]], bufs: list[tuple[torch.Tensor, ...]], device: torch.device) -> SeqTable:
    """The table of sequences at rows spans[s] over the buffers bufs[s] = (rec, conv, k, delta, dec,
    full), each contiguous float32 of SeqTable's shapes (the same L and dims for every sequence)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gdn_decode: a sequence table is made outside a CUDA graph capture "
                           "(the capture's warm-up runs make it; keep it for the replays)")
    if not bufs or len(bufs) != len(spans) or any(len(b) != SEQ_COLS - 2 for b in bufs):
        raise ValueError("gdn_decode: each sequence's buffers are (rec, conv, k, delta, dec, full)")
    n_l, hv, dk, dv = bufs[0][0].shape
    km1, c = bufs[0][1].shape[1:]
    for (i, j), b in zip(spans, bufs):
        t = j - i
        shapes = ((n_l, hv, dk, dv), (n_l, km1, c), (n_l, t, hv, dk), (n_l, t, hv, dv), (n_l, t, hv), (n_l, km1 + t, c))
        if any(tuple(x.shape) != sh or x.dtype != torch.float32 or not x.is_contiguous() for x, sh in zip(b, shapes)):
            raise ValueError(f"gdn_decode: a sequence's buffers (rec, conv, k, delta, dec, full) must be contiguous "
                             f"float32 of shapes {shapes}, got {[tuple(x.shape) for x in b]}")
    rows = [[i, j - i, *(x.data_ptr() for x in b)] for (i, j), b in zip(spans, bufs)]
    data = torch.tensor(rows, dtype=torch.int64)
    # pinned and asynchronous on a GPU: no host wait on the stream (the pinned block outlives the copy)
    data = data.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else data.to(device)
    return SeqTable(data, tuple((i, j) for i, j in spans), n_l, (hv, dk, dv, km1, c),
                    all(p % 16 == 0 for r in rows for p in r[2:]))


def gdn_rows_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor, hk: int, dk: int, dv: int, table: SeqTable, layer: int = 0,
                    z: torch.Tensor | None = None, norm_w: torch.Tensor | None = None, eps: float = 1e-6,
                    bv: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Every sequence of `table` in one launch: rows spans[s] of qkv [T, C], a, b [T, Hv] (and z)
    over sequence s's state and log, slice `layer` of each (SeqTable) -> o [T, Hv, dv] (qkv's
    dtype, gated-normed when z is given); each sequence's rows, log and window get the bits of its
    own launch (one binary: the row count and addresses are data; programs of one sequence read
    nothing of another's). bv, num_warps: as gdn_decode_triton."""
    t, c, hv, kk = _check(qkv, a, b, w, hk, dk, dv, z, norm_w)
    ends = [0] + [j for _, j in table.spans]
    if any(i != e for (i, _), e in zip(table.spans, ends)) or ends[-1] != t or any(j < i for i, j in table.spans):
        raise ValueError(f"gdn_decode: the table's row spans {list(table.spans)} must tile the {t} rows in order")
    if table.data.device != qkv.device or tuple(table.data.shape) != (len(table.spans), SEQ_COLS):
        raise ValueError(f"gdn_decode: the table must be int64 [{len(table.spans)}, {SEQ_COLS}] on {qkv.device}")
    if table.dims != (hv, dk, dv, kk - 1, c) or not 0 <= layer < table.layers:
        raise ValueError(f"gdn_decode: the table's states (Hv, dk, dv, K-1, C) {table.dims} over {table.layers} "
                         f"layer(s) do not hold layer {layer} of {(hv, dk, dv, kk - 1, c)}")
    bv = bv or BV
    bv = min(bv, triton.next_power_of_2(dv))
    norm = z is not None and bv >= dv
    w = w.contiguous()
    o = torch.empty(t, hv, dv, device=qkv.device, dtype=qkv.dtype)
    zz = z if norm else o
    if table.spans:
        _gdn_merged_kernel[(hv, triton.cdiv(dv, bv), len(table.spans))](
            qkv, a, b, w, a_log, dt_bias, zz, norm_w if norm else a_log, o, table.data, layer,
            qkv.stride(0), a.stride(0), b.stride(0), zz.stride(0), c, hk * dk, dk ** -0.5, eps,
            REP=hv // hk, K=kk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
            KM1P=triton.next_power_of_2(kk - 1), NORM=norm, ALIGNED=table.aligned,
            num_warps=num_warps or NUM_WARPS, **pdl.kw(qkv))
    if z is not None and not norm:      # split heads: the norm as its own launch
        from ..norm.kernel import gated_rms_norm_triton
        o = gated_rms_norm_triton(o, z.view(t, hv, dv), norm_w, eps)
    return o


def gdn_decode_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                      a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, hk: int, dk: int, dv: int,
                      z: torch.Tensor | None = None, norm_w: torch.Tensor | None = None, eps: float = 1e-6,
                      bv: int | None = None, num_warps: int | None = None,
                      out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """Contract of gdn_decode_ref: one sequence through gdn_rows_triton (the same kernel as a
    multi-sequence launch, so alone == packed). `out`: where to write the log and the full window, (k [T, Hv,
    dk], delta [T, Hv, dv], dec [T, Hv], full [K-1+T, C]), contiguous float32 (default: new). bv (default BV; None: the whole head) splits a head's value
    columns over programs and num_warps (default NUM_WARPS) the reductions' lanes: neither changes
    a row's dependence on other rows or heads. The gated norm (z given) runs inside the launch on
    whole heads, else as kernels/norm/kernel.py's kernel after it. Its sequence table is made per
    call (eager only: a CUDA graph's launches take a kept table through gdn_rows_triton)."""
    t, c, hv, kk = _check(qkv, a, b, w, hk, dk, dv, z, norm_w)
    if window.dtype != torch.float32 or state.dtype != torch.float32:
        raise ValueError(f"gdn_decode: window and state must be float32 (got {window.dtype}, {state.dtype})")
    window, state = window.contiguous(), state.contiguous()
    if out is None:
        out = (torch.empty(t, hv, dk, device=qkv.device, dtype=torch.float32),
               torch.empty(t, hv, dv, device=qkv.device, dtype=torch.float32),
               torch.empty(t, hv, device=qkv.device, dtype=torch.float32),
               torch.empty(kk - 1 + t, c, device=qkv.device, dtype=torch.float32))
    shapes = ((t, hv, dk), (t, hv, dv), (t, hv), (kk - 1 + t, c))
    if any(tuple(x.shape) != sh or x.dtype != torch.float32 or not x.is_contiguous() for x, sh in zip(out, shapes)):
        raise ValueError(f"gdn_decode: out must be contiguous float32 of shapes {shapes}, "
                         f"got {[tuple(x.shape) for x in out]}")
    if tuple(state.shape) != (hv, dk, dv) or tuple(window.shape) != (kk - 1, c):
        raise ValueError(f"gdn_decode: state must be [{hv}, {dk}, {dv}] and window [{kk - 1}, {c}] "
                         f"(got {list(state.shape)}, {list(window.shape)})")
    table = seq_table([(0, t)], [tuple(x[None] for x in (state, window, *out))], qkv.device)
    o = gdn_rows_triton(qkv, a, b, w, a_log, dt_bias, hk, dk, dv, table, 0, z, norm_w, eps, bv, num_warps)
    klog, dlog, declog, full = out
    return o, (klog, dlog, declog), full
