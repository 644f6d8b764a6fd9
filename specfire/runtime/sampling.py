"""The one target distribution: temperature, top-k, top-p, min-p applied to float32 logits.

The AR route samples from `probs(...)`; the speculative accept rule tests drafts against exactly
the same distribution, so both routes produce the same output distribution.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from .rng import DeviceRng, race_sample


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [R, V] float32 -> probabilities [R, V] after temperature, top-k, top-p and min-p."""
    x = logits.float() / max(sp.temperature, 1e-6)
    v = x.shape[-1]
    if 0 < sp.top_k < v:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sp_sorted, idx = torch.sort(p, dim=-1, descending=True)
        before = sp_sorted.cumsum(-1) - sp_sorted          # mass strictly before each token
        drop_sorted = before >= sp.top_p                    # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        p = p.masked_fill(drop, 0.0)
    if sp.min_p > 0.0:
        p = p.masked_fill(p < sp.min_p * p.max(dim=-1, keepdim=True).values, 0.0)
    return p / p.sum(-1, keepdim=True)


def sample(p: torch.Tensor, rng: DeviceRng | None) -> torch.Tensor:
    """One token per row from probabilities [R, V] -> [R] int64, drawn from `rng` (runtime/rng.py:
    device-side state, graph-capturable); None draws from a fresh unseeded stream."""
    if rng is None:
        rng = DeviceRng(p.device).seed(None)
    return race_sample(p, rng)


def pick(logits: torch.Tensor, sp: SamplingParams, rng: DeviceRng | None) -> torch.Tensor:
    """The AR choice per row: argmax when greedy, else a sample of `probs`."""
    if sp.greedy:
        return logits.argmax(-1)
    return sample(probs(logits, sp), rng)


def sampling_key(sp: SamplingParams) -> tuple | None:
    """What a captured sampling graph bakes in (None for greedy)."""
    return None if sp.greedy else (float(sp.temperature), int(sp.top_k), float(sp.top_p), float(sp.min_p))
