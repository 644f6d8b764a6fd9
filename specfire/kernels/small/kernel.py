"""Small ops on CUDA, in Triton: rotary (float32, rounded once), SiLU-mul (the reference's rounding
points, with the 4-bit GEMV's group sums), row argmax and the greedy accept rule; one program
handles whole rows, so every op is row-invariant."""
from __future__ import annotations

import torch
from .._triton import triton, tl

from .. import pdl, xsum
from ..pdl import wait as pdl_wait

from ..norm.kernel import XG, _rows2d, _sums_for, store_group_sums


# ---- rotary ---------------------------------------------------------------------------------

@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, H, D, R, stride_t, stride_h, stride_c,
                 BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    t = row // H
    h = row % H
    src = x_ptr + t * stride_t + h * stride_h
    dst = y_ptr + row * D
    half = R // 2
    # rotated part: out[i] = x[i] c[i] - x[i+half] s[i], out[i+half] = x[i+half] c[i+half] + x[i] s[i+half]
    i = tl.arange(0, HALF_BLOCK)
    im = i < half
    x1 = tl.load(src + i, mask=im, other=0.0)
    x2 = tl.load(src + half + i, mask=im, other=0.0)
    dt = x1.dtype
    c1 = tl.load(c_ptr + t * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(c_ptr + t * stride_c + half + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(s_ptr + t * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(s_ptr + t * stride_c + half + i, mask=im, other=0.0).to(dt).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c1 - x2f * s1).to(dt)                                   # rounded once
    o2 = (x2f * c2 + x1f * s2).to(dt)
    tl.store(dst + i, o1, mask=im)
    tl.store(dst + half + i, o2, mask=im)
    j = tl.arange(0, BLOCK)
    jm = (j >= R) & (j < D)
    tl.store(dst + j, tl.load(src + j, mask=jm, other=0.0), mask=jm)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(t, h, d, device=x.device, dtype=x.dtype)
    if t * h:
        _rope_kernel[(t * h,)](x, cos, sin, y, h, d, r, x.stride(0), x.stride(1), cos.stride(0),
                               BLOCK=triton.next_power_of_2(d), HALF_BLOCK=triton.next_power_of_2(max(r // 2, 1)),
                               **pdl.kw(x))
    return y


# ---- SiLU-mul -------------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, D, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                     xs_ptr=None, XS: tl.constexpr = 0):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)   # silu rounded, as F.silu does
    y = (a * u).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + offs, y, mask=mask)
    if XS > 0:   # this block's groups (BLOCK a multiple of XG)
        store_group_sums(xs_ptr, tl.where(mask, y.to(tl.float32), 0.0),
                         row * (D // XG) + tl.program_id(1) * (BLOCK // XG), D // XG - tl.program_id(1) * (BLOCK // XG),
                         BLOCK)


def silu_mul_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    d = g.shape[-1]
    g2, u2 = _rows2d(g), _rows2d(u)
    y = torch.empty(g.shape, device=g.device, dtype=g.dtype)
    blk = min(1024, triton.next_power_of_2(d))
    xs, fold = _sums_for(y, d)
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(d, blk))](g2, u2, y, d, g2.stride(0), u2.stride(0), BLOCK=blk,
                                                             xs_ptr=xs, XS=fold, **pdl.kw(g))
    return xsum.attach(y, xs) if fold else y


# ---- argmax and greedy accept ---------------------------------------------------------------

@triton.jit
def _argmax_partial_kernel(x_ptr, pv_ptr, pi_ptr, V, stride_x, CHUNK, n_chunks, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's maximum and its first index, as torch.argmax: a NaN counts
    as the maximum (the chunk's first NaN, stored as NaN); a chunk of -inf gives its first index."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), 2147483647, tl.int32)
    start = c * CHUNK
    for k0 in range(start, tl.minimum(start + CHUNK, V), BLOCK):
        idx = k0 + offs
        v = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        # strict: the earlier index wins ties within a lane; a lane's first NaN wins and stays
        take = (v > best_v) | ((v != v) & (best_v == best_v))
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    nan_i = tl.min(tl.where(best_v != best_v, best_i, 2147483647), axis=0)
    finite = tl.where(best_v != best_v, float("-inf"), best_v)
    m = tl.max(finite, axis=0)
    i = tl.min(tl.where(finite == m, best_i, 2147483647), axis=0)
    i = tl.where(m == float("-inf"), start, i)             # nothing above -inf: the chunk's first index
    i = tl.where(nan_i < 2147483647, nan_i, i)
    m = tl.where(nan_i < 2147483647, float("nan"), m)
    tl.store(pv_ptr + row * n_chunks + c, m)
    tl.store(pi_ptr + row * n_chunks + c, i)


@triton.jit
def _accept_kernel(pv_ptr, pi_ptr, d_ptr, spans_ptr, t_ptr, n_ptr, R, n_chunks, D_OFF,
                   R_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, ACCEPT: tl.constexpr, SPANS: tl.constexpr):
    """Program j: rows [a, b) of the argmax partials, spans[j] = (a, b) with SPANS (a member of a
    packed verify), else rows 0..R-1: each row's target; with ACCEPT, n[j] = the leading drafts
    d[a + D_OFF ..] equal to their row's target. One kernel whether a member runs alone or packed,
    so a packed member's (targets, n) are the bits it gets alone."""
    j = tl.program_id(0)
    if SPANS:
        a = tl.load(spans_ptr + 2 * j)
        R = tl.load(spans_ptr + 2 * j + 1) - a
    else:
        a = 0
    r = tl.arange(0, R_BLOCK)
    c = tl.arange(0, C_BLOCK)
    mask = (r[:, None] < R) & (c[None, :] < n_chunks)
    off = (a + r[:, None]) * n_chunks + c[None, :]
    pv = tl.load(pv_ptr + off, mask=mask, other=float("-inf"))
    pi = tl.load(pi_ptr + off, mask=mask, other=2147483647)
    nan_i = tl.min(tl.where(pv != pv, pi, 2147483647), axis=1)                # a NaN chunk: its first NaN
    pv = tl.where(pv != pv, float("-inf"), pv)
    m = tl.max(pv, axis=1)
    tgt = tl.min(tl.where(pv == m[:, None], pi, 2147483647), axis=1)            # [R_BLOCK]
    tgt = tl.where(nan_i < 2147483647, nan_i, tgt)
    tl.store(t_ptr + a + r, tgt.to(tl.int64), mask=r < R)
    if ACCEPT:  # drafts d[a + D_OFF ..] are checked against the targets of rows 0..R-2
        d = tl.load(d_ptr + a + D_OFF + r, mask=r < R - 1, other=-1)
        miss = (r < R - 1) & (d != tgt.to(tl.int64))
        n = tl.min(tl.where(miss | (r >= R - 1), r, R_BLOCK), axis=0)
        tl.store(n_ptr + j, n.to(tl.int64))


def _argmax_partials(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    r, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    blk = 1024
    chunk = max(blk, triton.cdiv(triton.cdiv(v, 64), blk) * blk)   # at most 64 chunks per row
    n_chunks = triton.cdiv(v, chunk)
    pv = torch.empty(r, n_chunks, device=logits.device, dtype=torch.float32)
    pi = torch.empty(r, n_chunks, device=logits.device, dtype=torch.int32)
    _argmax_partial_kernel[(r, n_chunks)](logits, pv, pi, v, logits.stride(0), chunk, n_chunks, BLOCK=blk)
    return pv, pi, n_chunks


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    r = logits.shape[0]
    pv, pi, n_chunks = _argmax_partials(logits)
    t = torch.empty(r, device=logits.device, dtype=torch.int64)
    _accept_kernel[(1,)](pv, pi, t, t, t, t, r, n_chunks, 0, R_BLOCK=triton.next_power_of_2(r),
                         C_BLOCK=triton.next_power_of_2(n_chunks), ACCEPT=False, SPANS=False)
    return t


_SPANS: dict[tuple, torch.Tensor] = {}


def greedy_accept_many_triton(logits: torch.Tensor, ids: torch.Tensor, spans: list[tuple[int, int]]
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_accept_triton of every member of a packed verify in two launches (see the reference)."""
    m = len(spans)
    pv, pi, n_chunks = _argmax_partials(logits)
    t = torch.empty(logits.shape[0], device=logits.device, dtype=torch.int64)
    n = torch.empty(m, device=logits.device, dtype=torch.int64)
    key = (logits.device, tuple(spans))
    st = _SPANS.get(key)
    if st is None:                       # a round's row pattern recurs: its table is uploaded once
        if len(_SPANS) >= 256:
            _SPANS.clear()
        st = _SPANS[key] = torch.tensor([x for sp in spans for x in sp], dtype=torch.int64, device=logits.device)
    widest = max(b - a for a, b in spans)
    _accept_kernel[(m,)](pv, pi, ids.to(torch.int64).contiguous(), st, t, n, 0, n_chunks, 1,
                         R_BLOCK=triton.next_power_of_2(max(widest, 2)), C_BLOCK=triton.next_power_of_2(n_chunks),
                         ACCEPT=True, SPANS=True)
    return t, n


def greedy_accept_triton(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = logits.shape[0]
    pv, pi, n_chunks = _argmax_partials(logits)
    t = torch.empty(r, device=logits.device, dtype=torch.int64)
    n = torch.empty((), device=logits.device, dtype=torch.int64)
    d = draft.to(device=logits.device, dtype=torch.int64).contiguous()
    _accept_kernel[(1,)](pv, pi, d, t, t, n, r, n_chunks, 0, R_BLOCK=triton.next_power_of_2(max(r, 2)),
                         C_BLOCK=triton.next_power_of_2(n_chunks), ACCEPT=True, SPANS=False)
    return t, n
