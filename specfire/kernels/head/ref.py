"""PyTorch references of the MTP head's fused rows-step kernels (kernel.py)."""
from __future__ import annotations

import torch

from ..norm.ref import rms_norm_ref


def fc_input_ref(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, we: torch.Tensor,
                 wh: torch.Tensor, eps_e: float, eps_h: float) -> torch.Tensor:
    """ids [R] token ids, table [V, D] the embedding, hidden [R, D] -> [R, 2D] in hidden's dtype:
    cat([rms_norm(table[ids]), rms_norm(hidden)])."""
    return torch.cat([rms_norm_ref(table[ids], we, eps_e), rms_norm_ref(hidden, wh, eps_h)], dim=-1)


def pick_ref(logits: torch.Tensor, out: torch.Tensor, step: int, pos):
    """logits [1, N] -> out[step] = argmax (the first index of the maximum; a NaN counts as the
    maximum, the first NaN wins, as torch.argmax); returns (out[step:step + 1], pos + 1)."""
    out[step] = logits[0].argmax()
    return out[step:step + 1], None if pos is None else pos + 1


def select_ref(pre: torch.Tensor, post: torch.Tensor, n: torch.Tensor, pos):
    """Rows n ([1], device) of pre and post [R, H], and pos + n."""
    return pre.index_select(0, n), post.index_select(0, n), pos + n
