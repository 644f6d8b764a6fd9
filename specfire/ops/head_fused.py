"""The MTP head's rows step in fewer launches on CUDA (the draft chain, runtime/drafters.py).

A head step of the draft chain was ~30 small launches for ~70 MB of weights; two groups of them
go here:

* `fc_input`: the fc's input, cat([rms_norm(embed(ids)), rms_norm(hidden)]), as one kernel: the
  embedding rows gathered by the token ids on the device, both norms, the concatenation, and (the
  sum(x) fold, ops/xsum.py) the group sums of the rounded values for the 4-bit fc GEMV. Five
  launches (gather, two norms, cat, the GEMV's sum(x)) become one. Each half of a row is computed
  by the code of ops/triton_small.py's RMSNorm kernel with the same block and warps, so the
  values are those of the two norm launches bit for bit; the folded sums are the producers' sums
  of the fold's mode (possibly a last bit off the GEMV's own sum(x) in the `plain` mode, as every
  folded producer of the trunk).
* `rope_table`: the rotary cos / sin of every position of the head's KV cache, computed once by
  the same torch ops as `rope_cos_sin` (elementwise on CUDA: each element's bits do not depend on
  the tensor it sits in), read by the fused q/k norm + rotary + KV write kernel at the rows'
  positions (ops/attn_fused.py, `table=True`). About nine launches a step (positions, the
  frequencies, cos, sin) become none.

`enabled(x)`: CUDA and SPECFIRE_CHAIN_FUSE not 0 (the default on; a captured chain keeps what
it was captured with); `set_enabled` overrides it (the CPU tests force it on in the interpreter).
The CPU's paths never take it (their bits unchanged).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl, xsum
from .norm import rms_norm_ref
from .pdl import wait as pdl_wait
from .rope import rope_cos_sin
from .triton_small import _norm_warps, _sums_for, store_group_sums, XG

_forced: bool | None = None


def set_enabled(on: bool | None) -> None:
    """True / False force the fused head step on or off (any device); None: the default rule."""
    global _forced
    _forced = on


def enabled(x: torch.Tensor) -> bool:
    if _forced is not None:
        return _forced
    return x.is_cuda and os.environ.get("SPECFIRE_CHAIN_FUSE", "1") != "0"


# ---- the fc's input -------------------------------------------------------------------------

def fc_input_ref(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, we: torch.Tensor,
                 wh: torch.Tensor, eps_e: float, eps_h: float) -> torch.Tensor:
    """ids [R] token ids, table [V, D] the embedding, hidden [R, D] -> [R, 2D] in hidden's dtype:
    cat([rms_norm(table[ids]), rms_norm(hidden)])."""
    return torch.cat([rms_norm_ref(table[ids], we, eps_e), rms_norm_ref(hidden, wh, eps_h)], dim=-1)


@triton.jit
def _fc_input_kernel(ids_ptr, e_ptr, h_ptr, we_ptr, wh_ptr, y_ptr, D, stride_e, stride_h, eps_e, eps_h,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False, xs_ptr=None, XS: tl.constexpr = 0):
    """Program (row, half): half 0 the embedding row of ids[row], half 1 hidden[row]; each through
    the RMSNorm of ops/triton_small.py (_rms_norm_kernel's code, RESIDUAL off) into y[row, half*D:]."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (ops/pdl.py)
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
    if XS > 0:   # the group sums of the rounded half-row (ops/xsum.py); D a multiple of XG
        store_group_sums(xs_ptr, tl.where(mask, y.to(tl.float32), 0.0), (row * 2 + half) * (D // XG), D // XG,
                         BLOCK, XS)


def fc_input_triton(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, we: torch.Tensor,
                    wh: torch.Tensor, eps_e: float, eps_h: float) -> torch.Tensor:
    """Contract of fc_input_ref, one launch; the group sums attached for the 4-bit fc (ops/xsum.py)."""
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


def fc_input(ids, table, hidden, we, wh, eps_e, eps_h) -> torch.Tensor:
    if hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return fc_input_triton(ids, table, hidden, we, wh, eps_e, eps_h)
    return fc_input_ref(ids, table, hidden, we, wh, eps_e, eps_h)


# ---- the rotary table -----------------------------------------------------------------------

class RopeTable(tuple):
    """(cos [n, R], sin [n, R]) float32 for positions 0..n-1: the rotary as a table the fused q/k
    kernel indexes by the rows' positions (model/qwen35.py GatedAttention)."""


_TABLES: dict[tuple, RopeTable] = {}


def rope_table(device: torch.device, rotary_dim: int, theta: float, n: int) -> RopeTable | None:
    """The table for positions 0..n-1 or more, built on first use (by `rope_cos_sin`'s ops over
    all positions); None where it would have to be built inside a CUDA-graph capture (the
    eager warm-up before every capture builds it)."""
    key = (str(device), int(rotary_dim), float(theta))
    got = _TABLES.get(key)
    if got is None or got[0].shape[0] < n:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        got = _TABLES[key] = RopeTable(rope_cos_sin(torch.arange(n, device=device), rotary_dim, theta))
    return got
