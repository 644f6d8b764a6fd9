"""RMSNorm (+ residual add) and the gated RMSNorm on CUDA, in Triton, with the references' rounding
points (they differ from ref.py only by float32 reduction order); one program a row, so
row-invariant. Also the group-sum helpers the 4-bit GEMV's producers share (kernels/xsum.py)."""
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


NORM_WARPS = 32      # warps per row of a wide norm (D >= 2048): measured faster than 4 on the H200


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
