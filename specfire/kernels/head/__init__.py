"""The MTP head's rows step and prompt catch-up in fewer launches: `fc_input` (embedding gather,
both norms, cat and the 4-bit fc's group sums in one kernel, the bits of the two norm launches),
`rope_table` (the rotary of every cache position, computed once), and the greedy chain's `pick` /
`select` (argmax + the draft's write + the next position; row n and its position)."""
from __future__ import annotations

import os

import torch

from ..small.ref import rope_cos_sin
from .ref import fc_input_ref, pick_ref, select_ref


def _triton_here(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


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
