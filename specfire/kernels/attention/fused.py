"""The gated attention's small ops around the rows forward in two launches: `qk_norm_rope_write` (q/k
norms, rotary, the KV write) and `out_gate` (the output times sigmoid(gate)), with the unfused
path's rounding points; one program a (row, head), so row- and shard-invariant. 16-bit / fp32 cache."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from .._triton import triton, tl

from . import q8 as attn_ops
from .. import pdl, xsum
from .. import lanes
from ..norm.ref import rms_norm_ref
from ..pdl import wait as pdl_wait
from ..norm.kernel import XG, store_group_sums
from ..small.ref import apply_rope_ref
from .device import _page_row, _seq, _table_ptr

if TYPE_CHECKING:
    from .multi import Launch


def qk_norm_rope_write_ref(qg: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, pos0, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """qg [T, Hq, 2D] (queries then gates per head), kx, vx [T, Hkv, D], cos/sin [T, R] -> q [T, Hq, D];
    k, v rows written at positions pos0.. of the caches [max_seq, Hkv, D] (paged: through `blocks`)."""
    d = kx.shape[-1]
    q = apply_rope_ref(rms_norm_ref(qg[..., :d], qw, eps), cos, sin)
    k = apply_rope_ref(rms_norm_ref(kx, kw, eps), cos, sin)
    from types import SimpleNamespace
    attn_ops.kv_write(SimpleNamespace(k=k_cache, v=v_cache, blocks=blocks), pos0, k, vx)
    return q


def out_gate_ref(o: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """o [T, Hq, D] float32 attention output, qg [T, Hq, 2D] -> [T, Hq * D] in qg's dtype."""
    t, hq, d = o.shape
    return o.to(qg.dtype).reshape(t, -1) * lanes.sigmoid(qg[..., d:].reshape(t, -1))


@triton.jit
def _norm_rope(src, w_ptr, c_row, s_row, dst, D, R, eps, BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """dst[:D] = rotary(rms_norm(src[:D]) rounded to src's dtype), rounded once, in dst's dtype."""
    dt = src.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    half = R // 2
    i = tl.arange(0, HALF_BLOCK)
    im = i < half
    n1 = (tl.load(src + i, mask=im, other=0.0).to(tl.float32) * inv *
          (1.0 + tl.load(w_ptr + i, mask=im, other=0.0).to(tl.float32))).to(dt).to(tl.float32)
    n2 = (tl.load(src + half + i, mask=im, other=0.0).to(tl.float32) * inv *
          (1.0 + tl.load(w_ptr + half + i, mask=im, other=0.0).to(tl.float32))).to(dt).to(tl.float32)
    c1 = tl.load(c_row + i, mask=im, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(c_row + half + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(s_row + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(s_row + half + i, mask=im, other=0.0).to(dt).to(tl.float32)
    tl.store(dst + i, (n1 * c1 - n2 * s1).to(dt).to(dst.dtype.element_ty), mask=im)
    tl.store(dst + half + i, (n2 * c2 + n1 * s2).to(dt).to(dst.dtype.element_ty), mask=im)
    pm = (offs >= R) & m                                   # past the rotary dims: the norm alone
    w = tl.load(w_ptr + offs, mask=pm, other=0.0).to(tl.float32)
    tl.store(dst + offs, (x * inv * (1.0 + w)).to(dt).to(dst.dtype.element_ty), mask=pm)


@triton.jit
def _qk_kernel(qg_ptr, kx_ptr, vx_ptr, qw_ptr, kw_ptr, c_ptr, s_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, pos_int,
               HQ, D, R, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ct, s_kc, s_kch, s_vc, s_vch, eps,
               POS_PTR: tl.constexpr, BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
               TABLE: tl.constexpr = False, seq_ptr=None, spos_ptr=None, rseq_ptr=None, tab_ptr=None,
               MULTI: tl.constexpr = False, ALIGN: tl.constexpr = False, blk_ptr=None, PAGED: tl.constexpr = False):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if MULTI:   # rows of several sequences (kernels/attention/multi.py): the row's sequence, position, cache
        sq = tl.load(rseq_ptr + t)
        row0, n_rows, pos0 = _seq(seq_ptr, spos_ptr, sq)
        p = pos0.to(tl.int64) + (t - row0)
        kc_ptr = _table_ptr(tab_ptr, sq, 0, kc_ptr, ALIGN)
        vc_ptr = _table_ptr(tab_ptr, sq, 1, vc_ptr, ALIGN)
        if PAGED:
            blk_ptr = _table_ptr(tab_ptr, sq, 4, blk_ptr, False)
    elif POS_PTR:
        p = tl.load(pos_ptr).to(tl.int64) + t
    else:
        p = pos_int + t
    if TABLE:   # cos / sin rows by position (kernels/head rope_table), not by row
        c_row = c_ptr + p * s_ct
        s_row = s_ptr + p * s_ct
    else:
        c_row = c_ptr + t * s_ct
        s_row = s_ptr + t * s_ct
    if h < HQ:
        _norm_rope(qg_ptr + t * s_qt + h * s_qh, qw_ptr, c_row, s_row, qo_ptr + (t * HQ + h) * D, D, R, eps,
                   BLOCK, HALF_BLOCK)
    else:
        kh = h - HQ
        c = _page_row(blk_ptr, p, PAGED)        # the cache row of position p
        _norm_rope(kx_ptr + t * s_kt + kh * s_kh, kw_ptr, c_row, s_row, kc_ptr + c * s_kc + kh * s_kch, D, R, eps,
                   BLOCK, HALF_BLOCK)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        v = tl.load(vx_ptr + t * s_vt + kh * s_vh + offs, mask=m, other=0.0)
        tl.store(vc_ptr + c * s_vc + kh * s_vch + offs, v.to(vc_ptr.dtype.element_ty), mask=m)


def qk_norm_rope_write_triton(qg: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, qw: torch.Tensor,
                              kw: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, pos0, table: bool = False,
                              multi: Launch | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Contract of qk_norm_rope_write_ref, one launch. `pos0`: an int or a one-element device tensor.
    `table`: cos / sin are [n, R] tables over positions 0..n-1 (kernels/head rope_table) and
    row t reads their row pos0 + t: the bits of the reference given those rows.
    `multi` (kernels/attention/multi.py): the rows are several sequences', each written into its own
    cache at its own positions (k_cache, v_cache: the first's; pos0 unused); a row's program does
    what it does when its sequence runs alone. `blocks`: a paged cache (kernels/attention/paged.py;
    with `multi` the first's, each sequence's in its table row)."""
    t, hq, d2 = qg.shape
    hkv, d = kx.shape[1], kx.shape[2]
    r = cos.shape[-1]
    if d2 != 2 * d or r > d or r % 2 or k_cache.shape[1:] != (hkv, d) or v_cache.shape[1:] != (hkv, d):
        raise ValueError(f"qk_norm_rope_write: qg {tuple(qg.shape)}, k {tuple(kx.shape)}, rotary {r}, "
                         f"cache {tuple(k_cache.shape)} do not fit")
    for name, x in (("qg", qg), ("k", kx), ("v", vx), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope_write: {name} must have a unit last stride")
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(t, hq, d, device=qg.device, dtype=qg.dtype)
    pos_t = isinstance(pos0, torch.Tensor) and multi is None
    if multi is not None:
        if not table and cos.shape[0] != t:
            raise ValueError(f"qk_norm_rope_write: {t} rows, {cos.shape[0]} rotary rows")
        if table and multi.n_keys is not None and multi.n_keys > cos.shape[0]:
            raise ValueError(f"qk_norm_rope_write: rows up to position {multi.n_keys - 1} past the rotary table "
                             f"({cos.shape[0]} positions)")
        mkw = dict(seq_ptr=multi.seqs, spos_ptr=multi.pos, rseq_ptr=multi.row_seq, tab_ptr=multi.table, MULTI=True,
                   ALIGN=multi.align)
    else:
        mkw = {}
        if table and not pos_t and int(pos0) + t > cos.shape[0]:
            raise ValueError(f"qk_norm_rope_write: rows at {int(pos0)}..{int(pos0) + t - 1} past the rotary table "
                             f"({cos.shape[0]} positions)")
    if t:
        _qk_kernel[(t, hq + hkv)](
            qg, kx, vx, qw, kw, cos, sin, q, k_cache, v_cache, pos0 if pos_t else q,
            0 if pos_t or multi is not None else int(pos0),
            hq, d, r, qg.stride(0), qg.stride(1), kx.stride(0), kx.stride(1), vx.stride(0), vx.stride(1),
            cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), eps,
            POS_PTR=pos_t, BLOCK=triton.next_power_of_2(d), HALF_BLOCK=triton.next_power_of_2(max(r // 2, 1)),
            **({"TABLE": True} if table else {}), **pdl.kw(qg), **mkw,
            blk_ptr=k_cache if blocks is None else blocks, PAGED=blocks is not None)
    return q


@triton.jit
def _q8_rows_kernel(kq_ptr, vq_ptr, ks_ptr, vs_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, seq_ptr, spos_ptr, rseq_ptr,
                    tab_ptr, D, NS, s_kt, s_kh, s_vt, s_vh, s_st, s_sh, c_kn, c_kh, c_vn, c_vh, c_vd, c_sn, c_sh,
                    BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN: tl.constexpr, PDL: tl.constexpr = False,
                    blk_ptr=None, PAGED: tl.constexpr = False):
    """One (row, KV head) of several sequences' quantized rows: codes and scales copied into the
    row's sequence's Q8 cache at its position (values at any strides: the key-minor layout)."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sq = tl.load(rseq_ptr + t)
    row0, n_rows, pos0 = _seq(seq_ptr, spos_ptr, sq)
    p = pos0.to(tl.int64) + (t - row0)
    if PAGED:
        p = _page_row(_table_ptr(tab_ptr, sq, 4, blk_ptr, False), p, True)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    kc = _table_ptr(tab_ptr, sq, 0, kc_ptr, ALIGN)
    vc = _table_ptr(tab_ptr, sq, 1, vc_ptr, ALIGN)
    tl.store(kc + p * c_kn + h * c_kh + offs, tl.load(kq_ptr + t * s_kt + h * s_kh + offs, mask=m), mask=m)
    tl.store(vc + p * c_vn + h * c_vh + offs * c_vd, tl.load(vq_ptr + t * s_vt + h * s_vh + offs, mask=m), mask=m)
    j = tl.arange(0, BLOCK_S)
    ms = j < NS
    ksc = _table_ptr(tab_ptr, sq, 2, ksc_ptr, ALIGN)
    vsc = _table_ptr(tab_ptr, sq, 3, vsc_ptr, ALIGN)
    tl.store(ksc + p * c_sn + h * c_sh + j, tl.load(ks_ptr + t * s_st + h * s_sh + j, mask=ms), mask=ms)
    tl.store(vsc + p * c_sn + h * c_sh + j, tl.load(vs_ptr + t * s_st + h * s_sh + j, mask=ms), mask=ms)


def q8_write_multi_triton(kx: torch.Tensor, vx: torch.Tensor, lcs: list, multi: Launch) -> None:
    """kv_write of several sequences' rows kx, vx [R, Hkv, D] into their Q8 caches (lcs, laid out
    alike) at their positions: quantized over all rows at once (row by row, as for one sequence's
    rows), then one launch copies each row's codes and scales into its own sequence's cache."""
    first = lcs[0]
    if first.k.stride(-1) != 1 or first.k_scale.stride(-1) != 1 or first.k_scale.stride() != first.v_scale.stride():
        raise ValueError("q8 rows write: keys and scales need their last dim contiguous, scales alike")
    (kq, ks), (vq, vs) = attn_ops.quantize_q8(kx), attn_ops.quantize_q8(vx)
    t, hkv, d = kq.shape
    if t:
        kc, vc, sc = first.k, first.v, first.k_scale
        _q8_rows_kernel[(t, hkv)](
            kq, vq, ks, vs, kc, vc, sc, first.v_scale, multi.seqs, multi.pos, multi.row_seq, multi.table, d,
            ks.shape[-1], kq.stride(0), kq.stride(1), vq.stride(0), vq.stride(1), ks.stride(0), ks.stride(1),
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), vc.stride(2), sc.stride(0), sc.stride(1),
            BLOCK=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(ks.shape[-1]), ALIGN=multi.align,
            **pdl.kw(kq), blk_ptr=kc if getattr(first, "blocks", None) is None else first.blocks,
            PAGED=getattr(first, "blocks", None) is not None)


@triton.jit
def _gate_kernel(o_ptr, qg_ptr, y_ptr, HQ, D, s_qt, s_qh, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                 xs_ptr=None, XS: tl.constexpr = 0):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    t = row // HQ
    h = row % HQ
    offs = tl.arange(0, BLOCK)
    m = offs < D
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32).to(dt).to(tl.float32)
    z = tl.load(qg_ptr + t * s_qt + h * s_qh + D + offs, mask=m, other=0.0).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-z))).to(dt).to(tl.float32)
    y = (o * sg).to(dt)
    tl.store(y_ptr + row * D + offs, y, mask=m)
    if XS > 0:   # the group sums of the written values (kernels/xsum.py); D a multiple of the group
        store_group_sums(xs_ptr, tl.where(m, y.to(tl.float32), 0.0), row * (D // XG), D // XG, BLOCK)


def out_gate_triton(o: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
    """Contract of out_gate_ref, one launch."""
    t, hq, d = o.shape
    if qg.shape != (t, hq, 2 * d) or qg.stride(-1) != 1:
        raise ValueError(f"out_gate: qg {tuple(qg.shape)} does not fit o {tuple(o.shape)} (unit last stride)")
    o = o.contiguous()
    y = torch.empty(t, hq * d, device=o.device, dtype=qg.dtype)
    fold = 1 if xsum.want(y, d) else 0
    xs = xsum.new(y) if fold else y
    if t:
        _gate_kernel[(t * hq,)](o, qg, y, hq, d, qg.stride(0), qg.stride(1), BLOCK=triton.next_power_of_2(d),
                                xs_ptr=xs, XS=fold, **pdl.kw(o))
    return xsum.attach(y, xs) if fold else y
