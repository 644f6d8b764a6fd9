"""The n-gram drafter: prompt lookup, no model."""
from __future__ import annotations

import torch

from ...params import SamplingParams
from ..rng import DeviceRng
from ..sampling import Penalties
from .base import NO_DRAFT, HostDrafter


def follow(ctx: list[int], j: int, k: int) -> list[int]:
    """The k tokens from ctx[j] on, where a follower that runs to the end of the context goes on
    into its own drafts (the repeat it matched, continued): every match drafts k, so a request's
    verifies keep one row count (a batch's CUDA graphs, one per row pattern, stay few)."""
    out = ctx[j:j + k]
    while len(out) < k:
        at = j + len(out)
        out.append(ctx[at] if at < len(ctx) else out[at - len(ctx)])
    return out


class NgramDrafter(HostDrafter):
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram
    (n from n_max down to n_min) and propose the k tokens that followed it (`follow`). No model.

    An index per n maps each n-gram to the start of its latest occurrence that has a follower; it
    is updated as tokens arrive (O(n_max) per token), so a proposal costs O(n_max) dict lookups
    whatever the context length, instead of a scan of the whole context."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4):
        for nm, v in (("n_min", n_min), ("n_max", n_max)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"ngram {nm} must be an integer, got {v!r}")
        if not (1 <= n_min <= n_max):
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.tokens = []
        self._index = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self._extend(prompt.tolist())

    def _extend(self, toks: list[int]) -> None:
        ctx = self.tokens
        for t in toks:
            ctx.append(t)
            end = len(ctx) - 1                      # the n-grams ending just before `t` now have a follower
            for n, idx in self._index.items():
                if end >= n:
                    idx[tuple(ctx[end - n:end])] = end - n

    def propose(self, last: int, pos: int, k: int, sp: SamplingParams, gen: DeviceRng | None,
                pen: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k <= 0:
            return NO_DRAFT, None
        ctx = self.tokens
        L = len(ctx)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            i = self._index[n].get(tuple(ctx[L - n:]))
            if i is not None:
                return torch.tensor(follow(ctx, i + n, k), dtype=torch.long), None
        return NO_DRAFT, None

    def commit(self, out: list[int], hidden: torch.Tensor | None, out_dev: torch.Tensor | None = None) -> None:
        self._extend(out)
