"""The one speculative step and its accept rule, shared by every drafter and every topology.

    draft  = drafter.propose(last, pos, k)          # k tokens (+ their distributions if sampling)
    rows   = trunk.verify([last] + draft, pos)      # k+1 logits and hidden rows, one forward
    n, out = accept(rows.logits, draft, q, ...)     # greedy prefix match or rejection sampling
    trunk.commit(n)                                 # recurrent state := state after row n
    drafter.commit(out, rows.hidden[:n+1])          # drafter catches up

Plain AR decoding is this step with no drafter (k = 0): one row, n = 0, out = [the target's pick].
Greedy: the drafts stay on the device, the accept runs there (ops/greedy.py), and the step's one
host read is n and the target tokens together.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import SamplingParams
from ..ops.greedy import greedy_accept
from .drafters import NO_DRAFT, Drafter
from .sampling import pick, probs
from .trunk import Trunk


def accept(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, sp: SamplingParams,
           gen: torch.Generator | None) -> tuple[int, list[int]]:
    """logits [k+1, V] of the verify rows; draft [k]; q [k, V] the drafter's distributions (None
    for a deterministic proposal such as n-gram or greedy MTP). Returns (n accepted, emitted
    tokens = n drafts + one token from the target)."""
    k = len(draft)
    if sp.greedy:
        return accept_greedy(logits, torch.tensor(draft, dtype=torch.long))
    p = probs(logits, sp)                                              # [k+1, V]
    for i, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[i, d])
        pd = float(p[i, d])
        u = float(torch.rand((), generator=gen, device=gen.device if gen is not None else "cpu"))
        if qd > 0 and u < pd / qd:
            continue
        if q is None:
            resid = p[i].clone()
            resid[d] = 0.0
        else:
            resid = (p[i] - q[i]).clamp_min(0.0)
        if float(resid.sum()) <= 0.0:
            resid = p[i]
        tok = int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
        return i, draft[:i] + [tok]
    tok = int(pick(logits[k:], sp, gen))
    return k, draft + [tok]


def accept_greedy(logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, list[int]]:
    """The greedy rule on the device: n = the leading drafts equal to their row's argmax; emitted =
    targets[0..n] (the n drafts, then the target's own token). One host read: n and the targets."""
    targets, n = greedy_accept(logits, draft)
    got = torch.cat([n.view(1), targets]).tolist()
    return got[0], got[1:got[0] + 2]


OnCycle = Callable[[int, int, list[int]], None]


@dataclass
class SpecStats:
    """Counts over a request's speculative cycles. `on_cycle(k, n, emitted)`, when set, is called
    after every step (k = 0 for an AR step), so callers can watch cycles without patching."""

    on_cycle: OnCycle | None = None
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, k: int, n: int, out: list[int]) -> None:
        if self.on_cycle is not None:
            self.on_cycle(k, n, out)
        if k == 0:
            return
        self.cycles += 1
        self.drafted += k
        self.accepted += n
        while len(self.drafted_per_pos) < k:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(k):
            self.drafted_per_pos[i] += 1
            if i < n:
                self.accepted_per_pos[i] += 1

    @property
    def mean_accept_len(self) -> float:
        return 1.0 + self.accepted / self.cycles if self.cycles else 0.0

    @property
    def accept_per_pos(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]


def spec_step(trunk: Trunk, drafter: Drafter | None, last: int, pos: int, k: int, sp: SamplingParams,
              gen: torch.Generator | None, stats: SpecStats) -> list[int]:
    """One draft -> verify -> accept -> commit cycle. Returns the emitted tokens (1..k+1)."""
    draft, q = drafter.propose(last, pos, k, sp, gen) if drafter is not None else (NO_DRAFT, None)
    ids = torch.empty(draft.shape[0] + 1, dtype=torch.long, device=trunk.device)
    ids[:1] = last                  # a fill and a copy: no host read of drafts made on the device
    ids[1:] = draft
    rows = trunk.verify(ids, pos)
    if sp.greedy:
        n, out = accept_greedy(rows.logits, ids[1:])
    else:
        n, out = accept(rows.logits, draft.tolist(), q, sp, gen)
    trunk.commit(n)
    if drafter is not None:
        drafter.commit(out, rows.hidden[:n + 1])
    stats.record(draft.shape[0], n, out)
    return out
