"""The MTP head's rows step in fewer launches on CUDA (the draft chain, runtime/drafters.py).

A head step of the draft chain was ~30 small launches for ~70 MB of weights; two groups of them
go here:

* `fc_input`: the fc's input, cat([rms_norm(embed(ids)), rms_norm(hidden)]), as one kernel: the
  embedding rows gathered by the token ids on the device, both norms, the concatenation, and (the
  sum(x) fold, kernels/xsum.py) the group sums of the rounded values for the 4-bit fc GEMV. Five
  launches (gather, two norms, cat, the GEMV's sum(x)) become one. Each half of a row is computed
  by the code of kernels/small/kernel.py's RMSNorm kernel with the same block and warps, so the
  values are those of the two norm launches bit for bit; the folded sums are the producers' sums
  of the fold's mode (possibly a last bit off the GEMV's own sum(x) in the `plain` mode, as every
  folded producer of the trunk).
* `rope_table`: the rotary cos / sin of every position of the head's KV cache, computed once by
  the same torch ops as `rope_cos_sin` (elementwise on CUDA: each element's bits do not depend on
  the tensor it sits in), read by the fused q/k norm + rotary + KV write kernel at the rows'
  positions (kernels/attention/fused.py, `table=True`). About nine launches a step (positions, the
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

from ..small.ref import rope_cos_sin
from .ref import fc_input_ref, pick_ref, select_ref

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
    the fused output gate (kernels/attention/fused.py). CUDA and SPECFIRE_CATCHUP_FUSE not 0 (read at each
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


def fc_input(ids, table, hidden, we, wh, eps_e, eps_h) -> torch.Tensor:
    if _triton_here(hidden):
        from .kernel import fc_input_triton
        return fc_input_triton(ids, table, hidden, we, wh, eps_e, eps_h)
    return fc_input_ref(ids, table, hidden, we, wh, eps_e, eps_h)


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


PICK_MAX = 65536     # columns one program scans (a draft vocabulary); past it torch's multi-block argmax


def pick(logits: torch.Tensor, out: torch.Tensor, step: int, pos):
    """pick_triton for a draft vocabulary's scores (at most PICK_MAX columns, measured at 32,768);
    the whole vocabulary goes to torch's argmax (pick_ref: the same pick, more launches)."""
    if _triton_here(logits) and logits.shape[-1] <= PICK_MAX:
        from .kernel import pick_triton
        return pick_triton(logits, out, step, pos)
    return pick_ref(logits, out, step, pos)


def select(pre: torch.Tensor, post: torch.Tensor, n: torch.Tensor, pos):
    if _triton_here(pre):
        from .kernel import select_triton
        return select_triton(pre, post, n, pos)
    return select_ref(pre, post, n, pos)
