"""A request's grammar in the one step: the token masks of the first token and of every verify row.

Row i of a verify conditions on the output so far plus drafts 0..i-1, so it takes the mask of the
matcher advanced over exactly those drafts (llguidance advances, masks and rolls back in one call).
Masking the logits before either accept rule keeps both exact: every row's greedy pick is AR's
masked pick, so greedy constrained speculation equals greedy constrained AR token for token, and
the sampled accept tests drafts against the masked distribution (a forbidden draft has p = 0 and
is rejected). The matcher lives on the host: the drafts are read there before the masks are built
(one read of the MTP drafts per step), and each step is read before the next is queued.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..params import MAX_SPEC_K

if TYPE_CHECKING:
    from ..grammar import GrammarSpec, Matcher


class Constraint:
    """One request's matcher and the buffers its masks go through: bit masks [rows, words] int32
    built on the host (pinned where the device is a GPU), unpacked on the device into -inf at every
    forbidden id. `done` once the grammar is complete (nothing but EOS may follow): the output ends
    there. `after`: a token id (a think block's end) before which nothing is masked; the grammar
    starts at the token after it. `host_s` counts the host time spent on masks and advancing (the
    benchmark's figure)."""

    def __init__(self, matcher: "Matcher", spec: "GrammarSpec", vocab: int, device: torch.device,
                 after: int | None = None):
        self.matcher, self.spec, self.vocab = matcher, spec, vocab
        self.after = after
        self.waiting = after is not None
        pinned = device.type == "cuda"
        self.host = torch.zeros(MAX_SPEC_K + 1, matcher.words, dtype=torch.int32, pin_memory=pinned)
        self.dev = torch.empty_like(self.host, device=device) if pinned else self.host
        self.bit = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
        self.done = False
        self.host_s = 0.0

    def mask(self, logits: torch.Tensor, drafts: torch.Tensor | list[int]) -> torch.Tensor:
        """logits [k+1, V] of a verify over `drafts` (k, host or device; none for the first token or
        an AR step) -> a new tensor with every token row i's grammar forbids at -inf."""
        t0 = time.perf_counter()
        d = drafts.tolist() if isinstance(drafts, torch.Tensor) else list(drafts)   # the MTP drafts' read
        if logits.shape[0] != len(d) + 1:
            raise ValueError(f"constraint: {logits.shape[0]} rows need {logits.shape[0] - 1} drafts, got {len(d)}")
        start = 0                               # rows before it condition on text before the grammar
        if self.waiting:
            if self.after not in d:
                return logits
            start = d.index(self.after) + 1
        r = len(d) + 1 - start
        self.matcher.masks(self.host, d[start:])
        self.host_s += time.perf_counter() - t0
        dev = self.dev[:r]
        if self.dev is not self.host:
            dev.copy_(self.host[:r], non_blocking=True)
        # token t is bit t % 8 of byte t // 8 (the int32 words in little-endian memory): [r, V], nonzero = allowed
        bits = (dev.view(torch.uint8).unsqueeze(-1) & self.bit).view(r, -1)[:, :logits.shape[-1]]
        masked = torch.where(bits.bool(), logits[start:], float("-inf"))
        return masked if start == 0 else torch.cat([logits[:start], masked])

    def advance(self, tokens: list[int]) -> int:
        """Consume the emitted tokens; the number that stand: all, or those up to the one that
        completes the grammar (then `done`). A token the grammar refuses is an engine fault."""
        t0 = time.perf_counter()
        try:
            for i, t in enumerate(tokens):
                if self.waiting:
                    self.waiting = t != self.after
                    continue
                if self.matcher.advance([t]) != 1:
                    raise RuntimeError(f"the grammar ({self.spec.param}) refused emitted token {t}: "
                                       f"{self.matcher.error() or 'outside the mask'}")
                if self.matcher.is_done():
                    self.done = True
                    return i + 1
            return len(tokens)
        finally:
            self.host_s += time.perf_counter() - t0
