"""Row argmax and the greedy accept rule, on the device (no host sync).

`greedy_accept(logits [k+1, V], draft [k])` returns the target token of every row and n, the
number of leading drafts equal to their row's target; the step then emits target[0..n] (n
accepted drafts and the bonus token). Ties go to the lowest token id, as torch.argmax does.
"""
from __future__ import annotations

import torch


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64."""
    return logits.argmax(-1)


def greedy_accept_ref(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [k+1] int64, n accepted as a 0-d int64 tensor)."""
    t = logits.argmax(-1)
    match = t[:-1] == draft.to(t.device, torch.int64)
    return t, match.to(torch.int64).cumprod(0).sum()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:
        from .triton_small import argmax_triton
        return argmax_triton(logits)
    return argmax_ref(logits)


def greedy_accept(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.is_cuda:
        from .triton_small import greedy_accept_triton
        return greedy_accept_triton(logits, draft)
    return greedy_accept_ref(logits, draft)
