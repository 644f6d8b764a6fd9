"""Triton kernels of the MTP head's rows step: the fc's input (gather, both norms, cat, group
sums) and the greedy chain's pick / row selection. Contracts: ref.py."""
from __future__ import annotations

import torch

from .._triton import triton, tl
from .. import pdl, xsum
from ..pdl import wait as pdl_wait
from ..norm.kernel import XG, _norm_warps, _sums_for, store_group_sums


@triton.jit
def _fc_input_kernel(ids_ptr, e_ptr, h_ptr, we_ptr, wh_ptr, y_ptr, D, stride_e, stride_h, eps_e, eps_h,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False, xs_ptr=None, XS: tl.constexpr = 0):
    """Program (row, half): half 0 the embedding row of ids[row], half 1 hidden[row]; each through
    the RMSNorm of kernels/norm/kernel.py (_rms_norm_kernel's code, RESIDUAL off) into y[row, half*D:]."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    row = tl.program_id(0)
    half = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    if half == 0:
        tok = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(e_ptr + tok * stride_e + offs, mask=mask, other=0.0)
        w = tl.load(we_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        eps = eps_e
    else:
        x = tl.load(h_ptr + row.to(tl.int64) * stride_h + offs, mask=mask, other=0.0)
        w = tl.load(wh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        eps = eps_h
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * inv * (1.0 + w)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * 2 * D + half * D + offs, y, mask=mask)
    if XS > 0:   # the group sums of the rounded half-row (kernels/xsum.py); D a multiple of XG
        store_group_sums(xs_ptr, tl.where(mask, y.to(tl.float32), 0.0), (row * 2 + half) * (D // XG), D // XG,
                         BLOCK)


def fc_input_triton(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, we: torch.Tensor,
                    wh: torch.Tensor, eps_e: float, eps_h: float) -> torch.Tensor:
    """Contract of fc_input_ref, one launch; the group sums attached for the 4-bit fc (kernels/xsum.py)."""
    if hidden.dim() != 2 or table.dim() != 2 or ids.dim() != 1:
        raise ValueError(f"fc_input: ids [R], table [V, D], hidden [R, D] expected, got ids "
                         f"{tuple(ids.shape)}, table {tuple(table.shape)}, hidden {tuple(hidden.shape)}")
    r, d = hidden.shape
    if ids.shape[0] != r or table.shape[1] != d or we.shape != (d,) or wh.shape != (d,):
        raise ValueError(f"fc_input: ids {tuple(ids.shape)}, table {tuple(table.shape)}, hidden "
                         f"{tuple(hidden.shape)}, norm weights {tuple(we.shape)} / {tuple(wh.shape)} do not fit")
    if table.dtype != hidden.dtype:
        raise ValueError(f"fc_input: the embedding is {table.dtype} but hidden is {hidden.dtype}")
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if table.stride(-1) != 1:
        raise ValueError("fc_input: the embedding must have a unit last stride")
    ids = ids.contiguous()
    y = torch.empty(r, 2 * d, device=hidden.device, dtype=hidden.dtype)
    xs, fold = _sums_for(y, 2 * d) if d % xsum.G == 0 else (y, 0)
    if r:
        _fc_input_kernel[(r, 2)](ids, table, hidden, we, wh, y, d, table.stride(0), hidden.stride(0), eps_e, eps_h,
                                 BLOCK=triton.next_power_of_2(d), num_warps=_norm_warps(d), xs_ptr=xs, XS=fold,
                                 **pdl.kw(hidden))
    return xsum.attach(y, xs) if fold else y


@triton.jit
def _pick_kernel(x_ptr, out_ptr, pos_ptr, pos_out_ptr, N, step, BLOCK: tl.constexpr, POS: tl.constexpr,
                 PDL: tl.constexpr = False):
    """One program: the argmax of x[0:N] (lanes keep their first maximum, then the lowest index among
    the lanes' maxima; the first NaN overrides) into out[step]; pos_out = pos + 1 when POS."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    offs = tl.arange(0, BLOCK)
    m0 = offs < N
    best_v = tl.load(x_ptr + offs, mask=m0, other=float("-inf")).to(tl.float32)
    best_i = tl.where(m0, offs, 2147483647)
    nan_i = tl.min(tl.where(m0 & (best_v != best_v), offs, 2147483647), axis=0)
    for k0 in range(BLOCK, N, BLOCK):
        idx = k0 + offs
        mk = idx < N
        v = tl.load(x_ptr + idx, mask=mk, other=float("-inf")).to(tl.float32)
        take = v > best_v                                   # strict: a lane keeps its earlier index on ties
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
        nan_i = tl.minimum(nan_i, tl.min(tl.where(mk & (v != v), idx, 2147483647), axis=0))
    best_v = tl.where(best_v != best_v, float("-inf"), best_v)    # a NaN lane start: its NaN is counted above
    m = tl.max(best_v, axis=0)
    i = tl.min(tl.where(best_v == m, best_i, 2147483647), axis=0)
    i = tl.where(nan_i < 2147483647, nan_i, i)
    tl.store(out_ptr + step, i.to(tl.int64))
    if POS:
        tl.store(pos_out_ptr, tl.load(pos_ptr) + 1)


PICK_BLOCK = 8192     # elements a loop step (the program's 16 warps hold 16 each)


def pick_triton(logits: torch.Tensor, out: torch.Tensor, step: int, pos):
    """Contract of pick_ref, one launch (pos an int: pos + 1 on the host; a one-element device tensor:
    written by the same launch; None: none)."""
    if logits.dim() != 2 or logits.shape[0] != 1 or logits.stride(-1) != 1:
        raise ValueError(f"pick: logits must be one contiguous row [1, N], got {tuple(logits.shape)}")
    if out.dtype != torch.int64 or out.dim() != 1 or not 0 <= step < out.shape[0]:
        raise ValueError(f"pick: out must be int64 [k] with step < k, got {out.dtype} {tuple(out.shape)}, step {step}")
    n = logits.shape[1]
    pos_t = isinstance(pos, torch.Tensor)
    nxt = torch.empty_like(pos) if pos_t else None
    _pick_kernel[(1,)](logits, out, pos if pos_t else out, nxt if pos_t else out, n, step,
                       BLOCK=min(PICK_BLOCK, triton.next_power_of_2(max(n, 1))), POS=pos_t, num_warps=16,
                       **pdl.kw(logits))
    return out[step:step + 1], (nxt if pos_t else None if pos is None else pos + 1)


@triton.jit
def _select_kernel(pre_ptr, post_ptr, n_ptr, pos_ptr, a_ptr, b_ptr, p_ptr, pos_int, H, s_pre, s_post,
                   BLOCK: tl.constexpr, POS_PTR: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    n = tl.load(n_ptr).to(tl.int64)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    tl.store(a_ptr + c, tl.load(pre_ptr + n * s_pre + c, mask=m), mask=m)
    tl.store(b_ptr + c, tl.load(post_ptr + n * s_post + c, mask=m), mask=m)
    if tl.program_id(0) == 0:
        if POS_PTR:
            tl.store(p_ptr, tl.load(pos_ptr) + n)
        else:
            tl.store(p_ptr, pos_int + n)


def select_triton(pre: torch.Tensor, post: torch.Tensor, n: torch.Tensor, pos):
    """Contract of select_ref, one launch (rows copied as they are)."""
    if pre.shape != post.shape or pre.dim() != 2 or pre.stride(-1) != 1 or post.stride(-1) != 1:
        raise ValueError(f"select: pre {tuple(pre.shape)} and post {tuple(post.shape)} must be [R, H], unit last stride")
    if n.numel() != 1:
        raise ValueError(f"select: n must hold one row index, got {tuple(n.shape)}")
    h = pre.shape[1]
    a = torch.empty(1, h, device=pre.device, dtype=pre.dtype)
    b = torch.empty(1, h, device=post.device, dtype=post.dtype)
    pos_t = isinstance(pos, torch.Tensor)
    p = torch.empty(1, device=n.device, dtype=torch.int64)
    blk = 1024
    _select_kernel[(triton.cdiv(h, blk),)](pre, post, n, pos if pos_t else p, a, b, p, 0 if pos_t else int(pos), h,
                                           pre.stride(0), post.stride(0), BLOCK=blk, POS_PTR=pos_t,
                                           **pdl.kw(pre))
    return a, b, p
