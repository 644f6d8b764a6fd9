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

* `pick` / `select` (a greedy chain's argmax picks, runtime/drafters.py draft_chain `fused_pick`):
  the argmax of the lm_head's unwidened scores, its write into the drafts and the next position
  in one launch (torch: argmax, a position add, and the drafts' cat at the end); row n of the
  head's outputs and its position in one (torch: two index_selects and an add). Picks equal
  torch.argmax's (first index of the maximum, NaN first).

`enabled(x)`: CUDA and SPECFIRE_CHAIN_FUSE not 0 (the default on; a captured chain keeps what
it was captured with); `set_enabled` overrides it (the CPU tests force it on in the interpreter).
`pick_on()`: SPECFIRE_CHAIN_PICK not 0. The CPU's paths never take them (their bits unchanged).
"""
from __future__ import annotations

import os

import torch
from ._triton import triton, tl

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


_catchup_forced: bool | None = None


def set_catchup(on: bool | None) -> None:
    """True / False force the prompt catch-up's fused kernels on or off (any device); None: the
    default rule (`catchup_enabled`)."""
    global _catchup_forced
    _catchup_forced = on


def catchup_enabled(x: torch.Tensor) -> bool:
    """Whether the head's prefill-mode forward (the prompt catch-up, runtime/drafters.py
    MtpDrafter.begin) takes the kernels of the fused rows step around its GEMMs: `fc_input`
    (gather, both norms, cat), the rotary table with the fused q/k norm + rotary + KV write, and
    the fused output gate (ops/attn_fused.py). CUDA and SPECFIRE_CATCHUP_FUSE not 0 (read at each
    call: a bench can A/B in one process); `set_catchup` overrides it."""
    if _catchup_forced is not None:
        return _catchup_forced
    return x.is_cuda and os.environ.get("SPECFIRE_CATCHUP_FUSE", "1") != "0"


def pick_on() -> bool:
    """With the fused step on, whether a greedy chain also picks through `pick` / `select`
    (SPECFIRE_CHAIN_PICK, default on; 0: torch's argmax, index_select and position adds)."""
    return os.environ.get("SPECFIRE_CHAIN_PICK", "1") != "0"


def _triton_here(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


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
    return (fc_input_triton if _triton_here(hidden) else fc_input_ref)(ids, table, hidden, we, wh, eps_e, eps_h)


# ---- the rotary table -----------------------------------------------------------------------

class RopeTable(tuple):
    """(cos [n, R], sin [n, R]) float32 for positions 0..n-1: the rotary as a table the fused q/k
    kernel indexes by the rows' positions (model/qwen35.py GatedAttention)."""


_TABLES: dict[tuple, RopeTable] = {}
_RETIRED: list[RopeTable] = []   # outgrown tables stay allocated: captured graphs hold their addresses


def rope_table(device: torch.device, rotary_dim: int, theta: float, n: int) -> RopeTable | None:
    """The table for positions 0..n-1 or more, built on first use (by `rope_cos_sin`'s ops over
    all positions); None where it would have to be built inside a CUDA-graph capture (the
    eager warm-up before every capture builds it). A table outgrown by a longer cache is kept
    allocated (a graph captured with it reads its memory at every replay)."""
    key = (str(device), int(rotary_dim), float(theta))
    got = _TABLES.get(key)
    if got is None or got[0].shape[0] < n:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if got is not None:
            _RETIRED.append(got)
        got = _TABLES[key] = RopeTable(rope_cos_sin(torch.arange(n, device=device), rotary_dim, theta))
    return got


# ---- the chain's greedy pick and row selection ------------------------------------------------

def pick_ref(logits: torch.Tensor, out: torch.Tensor, step: int, pos):
    """logits [1, N] -> out[step] = argmax (the first index of the maximum; a NaN counts as the
    maximum, the first NaN wins, as torch.argmax); returns (out[step:step + 1], pos + 1)."""
    out[step] = logits[0].argmax()
    return out[step:step + 1], None if pos is None else pos + 1


@triton.jit
def _pick_kernel(x_ptr, out_ptr, pos_ptr, pos_out_ptr, N, step, BLOCK: tl.constexpr, POS: tl.constexpr,
                 PDL: tl.constexpr = False):
    """One program: the argmax of x[0:N] (lanes keep their first maximum, then the lowest index among
    the lanes' maxima; the first NaN overrides) into out[step]; pos_out = pos + 1 when POS."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (ops/pdl.py)
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


def select_ref(pre: torch.Tensor, post: torch.Tensor, n: torch.Tensor, pos):
    """Rows n ([1], device) of pre and post [R, H], and pos + n."""
    return pre.index_select(0, n), post.index_select(0, n), pos + n


@triton.jit
def _select_kernel(pre_ptr, post_ptr, n_ptr, pos_ptr, a_ptr, b_ptr, p_ptr, pos_int, H, s_pre, s_post,
                   BLOCK: tl.constexpr, POS_PTR: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (ops/pdl.py)
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


PICK_MAX = 65536     # columns one program scans (a draft vocabulary); past it torch's multi-block argmax


def pick(logits: torch.Tensor, out: torch.Tensor, step: int, pos):
    """pick_triton for a draft vocabulary's scores (at most PICK_MAX columns, measured at 32,768);
    the whole vocabulary goes to torch's argmax (pick_ref: the same pick, more launches)."""
    fast = _triton_here(logits) and logits.shape[-1] <= PICK_MAX
    return (pick_triton if fast else pick_ref)(logits, out, step, pos)


def select(pre: torch.Tensor, post: torch.Tensor, n: torch.Tensor, pos):
    return (select_triton if _triton_here(pre) else select_ref)(pre, post, n, pos)
