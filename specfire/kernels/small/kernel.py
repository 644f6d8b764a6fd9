"""Fused small ops on CUDA, in Triton: RMSNorm (+ residual add), gated RMSNorm, rotary, SiLU-mul,
row argmax and the greedy accept rule.

The norms and SiLU-mul keep the rounding points of their PyTorch references (kernels/norm,
kernels/small): values are cast back to the model dtype exactly where the reference casts, so they
differ from it only by float32 reduction order. Rotary computes in float32 and rounds once (the
reference rounds each product, so the two may differ by one unit in the last place). One
program handles whole rows, so every op is row-invariant.
"""
from __future__ import annotations

import torch
from .._triton import triton, tl

from .. import pdl, xsum
from ..pdl import wait as pdl_wait

XG = tl.constexpr(xsum.G)   # the group of the folded sums (kernels/xsum.py)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """A [rows, D] view with unit stride along D (copies only when no such view exists)."""
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, d)
    except RuntimeError:
        return x.reshape(-1, d)


# ---- group sums (kernels/xsum.py) -----------------------------------------------------------

@triton.jit
def store_group_sums(xs_ptr, y, base_group, n_groups, BLOCK: tl.constexpr):
    """Store the group sums of y ([BLOCK] float32, the values written, zero past the row) at
    xs_ptr + base_group + i for the block's groups i below n_groups: tl.sum over each group, the
    same code for every row (row-invariant; the last bits may differ from the GEMV's own sum(x))."""
    NG: tl.constexpr = BLOCK // XG
    gi = tl.arange(0, NG)
    tl.store(xs_ptr + base_group + gi, tl.sum(tl.reshape(y, (NG, XG)), 1), mask=gi < n_groups)


def _sums_for(y: torch.Tensor, d: int):
    """(xs buffer or a placeholder, XS: 1 when the producer writing y in rows of d stores the group
    sums, else 0) (kernels/xsum.py)."""
    if xsum.want(y, d):
        return xsum.new(y), 1
    return y, 0


# ---- RMSNorm --------------------------------------------------------------------------------

NORM_WARPS = 32      # warps per row of a wide norm (D >= 2048): H200, D 5120: 2.1 us vs 2.9 us at 4 (bench/fuse.py)


def _norm_warps(d: int) -> int:
    return NORM_WARPS if d >= 2048 else 4


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, eps,
                     BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
                     xs_ptr=None, XS: tl.constexpr = 0):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if RESIDUAL:  # sum rounded to the model dtype first, exactly like `x = x + h`; a float32 h
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(x.dtype)  # is rounded first
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv * (1.0 + w)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + offs, y, mask=mask)
    if XS > 0:   # the group sums of the rounded row (kernels/xsum.py); D a multiple of XG
        store_group_sums(xs_ptr, tl.where(mask, y.to(tl.float32), 0.0), row * (D // XG), D // XG, BLOCK)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = _rows2d(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    xs, fold = _sums_for(y, d)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, w, y, y, d, x2.stride(0), 0, eps,
                                         BLOCK=triton.next_power_of_2(d), RESIDUAL=False, num_warps=_norm_warps(d),
                                         xs_ptr=xs, XS=fold, **pdl.kw(x))
    return xsum.attach(y, xs) if fold else y


def add_rms_norm_triton(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x2, h2 = _rows2d(x), _rows2d(h)
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    xs, fold = _sums_for(y, d)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, h2, w, y, s, d, x2.stride(0), h2.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(d), RESIDUAL=True, num_warps=_norm_warps(d),
                                         xs_ptr=xs, XS=fold, **pdl.kw(x))
    return s, (xsum.attach(y, xs) if fold else y)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, D, stride_x, stride_z, eps, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False, xs_ptr=None, XS: tl.constexpr = 0):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    n = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    wn = (w.to(tl.float32) * n).to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    y = (wn * (z / (1.0 + tl.exp(-z)))).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + offs, y, mask=mask)
    if XS > 0:
        store_group_sums(xs_ptr, tl.where(mask, y.to(tl.float32), 0.0), row * (D // XG), D // XG, BLOCK)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2, z2 = _rows2d(x), _rows2d(z)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    xs, fold = _sums_for(y, d)
    if x2.shape[0]:
        _gated_rms_norm_kernel[(x2.shape[0],)](x2, z2, w, y, d, x2.stride(0), z2.stride(0), eps,
                                               BLOCK=triton.next_power_of_2(d), xs_ptr=xs, XS=fold, **pdl.kw(x))
    return xsum.attach(y, xs) if fold else y


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
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), 2147483647, tl.int32)
    start = c * CHUNK
    for k0 in range(start, tl.minimum(start + CHUNK, V), BLOCK):
        idx = k0 + offs
        v = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        take = v > best_v  # strict: the earlier index wins ties within a lane
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    m = tl.max(best_v, axis=0)
    i = tl.min(tl.where(best_v == m, best_i, 2147483647), axis=0)
    tl.store(pv_ptr + row * n_chunks + c, m)
    tl.store(pi_ptr + row * n_chunks + c, i)


@triton.jit
def _accept_kernel(pv_ptr, pi_ptr, d_ptr, t_ptr, n_ptr, R, n_chunks,
                   R_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, ACCEPT: tl.constexpr):
    r = tl.arange(0, R_BLOCK)
    c = tl.arange(0, C_BLOCK)
    mask = (r[:, None] < R) & (c[None, :] < n_chunks)
    pv = tl.load(pv_ptr + r[:, None] * n_chunks + c[None, :], mask=mask, other=float("-inf"))
    pi = tl.load(pi_ptr + r[:, None] * n_chunks + c[None, :], mask=mask, other=2147483647)
    m = tl.max(pv, axis=1)
    tgt = tl.min(tl.where(pv == m[:, None], pi, 2147483647), axis=1)            # [R_BLOCK]
    tl.store(t_ptr + r, tgt.to(tl.int64), mask=r < R)
    if ACCEPT:  # drafts d[0..R-2] are checked against the targets of rows 0..R-2
        d = tl.load(d_ptr + r, mask=r < R - 1, other=-1)
        miss = (r < R - 1) & (d != tgt.to(tl.int64))
        n = tl.min(tl.where(miss | (r >= R - 1), r, R_BLOCK), axis=0)
        tl.store(n_ptr, n.to(tl.int64))


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
    _accept_kernel[(1,)](pv, pi, t, t, t, r, n_chunks, R_BLOCK=triton.next_power_of_2(r),
                         C_BLOCK=triton.next_power_of_2(n_chunks), ACCEPT=False)
    return t


def greedy_accept_triton(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = logits.shape[0]
    pv, pi, n_chunks = _argmax_partials(logits)
    t = torch.empty(r, device=logits.device, dtype=torch.int64)
    n = torch.empty((), device=logits.device, dtype=torch.int64)
    d = draft.to(device=logits.device, dtype=torch.int64).contiguous()
    _accept_kernel[(1,)](pv, pi, d, t, n, r, n_chunks, R_BLOCK=triton.next_power_of_2(max(r, 2)),
                         C_BLOCK=triton.next_power_of_2(n_chunks), ACCEPT=True)
    return t, n
