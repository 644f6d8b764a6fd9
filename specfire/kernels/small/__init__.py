"""Small ops: SiLU-mul, rotary embedding, row argmax and the greedy accept rule (no host sync).
Triton on CUDA, the references of ref.py elsewhere."""
from __future__ import annotations

import torch

from .ref import apply_rope_ref, argmax_ref, greedy_accept_many_ref, greedy_accept_ref, rope_cos_sin, silu_mul_ref

__all__ = ["apply_rope", "apply_rope_ref", "argmax", "argmax_ref", "greedy_accept", "greedy_accept_many",
           "greedy_accept_many_ref", "greedy_accept_ref",
           "rope_cos_sin", "silu_mul", "silu_mul_ref"]


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if g.is_cuda:
        from .kernel import silu_mul_triton
        return silu_mul_triton(g, u)
    return silu_mul_ref(g, u)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from .kernel import apply_rope_triton
        return apply_rope_triton(x, cos, sin)
    return apply_rope_ref(x, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:
        from .kernel import argmax_triton
        return argmax_triton(logits)
    return argmax_ref(logits)


def greedy_accept(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.is_cuda:
        from .kernel import greedy_accept_triton
        return greedy_accept_triton(logits, draft)
    return greedy_accept_ref(logits, draft)


def greedy_accept_many(logits: torch.Tensor, ids: torch.Tensor, spans: list[tuple[int, int]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_accept` of every member (its rows spans[j]) of a packed verify at once (two
    launches for the round, not two a request); each member's (targets, n) are the bits it gets
    alone."""
    if logits.is_cuda:
        from .kernel import greedy_accept_many_triton
        return greedy_accept_many_triton(logits, ids, spans)
    return greedy_accept_many_ref(logits, ids, spans)
