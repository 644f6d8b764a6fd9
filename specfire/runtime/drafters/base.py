"""The Drafter protocol: everything the step and the engine use of a drafter."""
from __future__ import annotations

from typing import Protocol

import torch

from ...params import SamplingParams
from ..rng import DeviceRng
from ..sampling import Penalties

NO_DRAFT = torch.empty(0, dtype=torch.long)


class Drafter(Protocol):
    """Proposes k tokens (and, when sampling, the distribution each was drawn from). A drafter
    sees every token once, through `begin` and `commit`, so the route may change between steps."""

    name: str          # the route that uses it ("mtp", "ngram"; runtime/drafters/registry.py)

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        """A new sequence: its prompt's tokens and the trunk's hidden rows of them."""

    def propose(self, last: int, pos: int, k: int, sp: SamplingParams, gen: DeviceRng | None,
                pen: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts (int64) after `last`, the newest token (at `pos`, not yet seen by the trunk),
        and for a sampled request their distributions [k, V or N] (None: a deterministic proposal).
        `pen`: a penalised request's statistics (used where `penalises(sp)`)."""

    def commit(self, out: list[int], hidden: torch.Tensor, out_dev: torch.Tensor) -> None:
        """After every step, whichever route ran it: the emitted tokens (host list and the same
        on the device) and the trunk's hidden rows of the step's inputs (none for the first token,
        which comes from the prefill)."""

    def prepare(self, hidden: torch.Tensor, targets: torch.Tensor, n: torch.Tensor, pos: int, k: int,
                pen: Penalties | None = None, sp: SamplingParams | None = None, defer: bool = False) -> bool:
        """Right after a greedy verify of k drafts at `pos`, before its result is read (n, the
        accepted count, still on the device): queue the next proposal, or do nothing. `defer`: it
        may be left pending instead (True back), to be queued with other requests' (`queue_many`)."""

    def queue_pending(self) -> None:
        """Queue the proposal `prepare(defer=True)` left pending."""

    def queue_many(self, drafters: list["Drafter"]) -> None:
        """Queue the pending proposals of several requests' drafters of this kind (self among
        them: a round's), together where they can be."""

    def penalises(self, sp: SamplingParams) -> bool:
        """Whether this request's drafts are picked with its penalties (the route reason says so)."""


class HostDrafter:
    """What a drafter that queues nothing ahead and ignores penalties shares (the n-gram drafter,
    scripted drafters): it writes `name`, `begin`, `propose` and `commit`."""

    def prepare(self, hidden: torch.Tensor, targets: torch.Tensor, n: torch.Tensor, pos: int, k: int,
                pen: Penalties | None = None, sp: SamplingParams | None = None, defer: bool = False) -> bool:
        return False

    def queue_pending(self) -> None:
        return None

    def queue_many(self, drafters: list) -> None:
        return None

    def penalises(self, sp: SamplingParams) -> bool:
        return False
