"""Every drafter the engine routes to, in one place: its route name (the SpecPolicy mode that asks
for it), how route reasons name it, and how it is built over a loaded trunk. The order is the
order `auto` measures them in. A new drafter is one entry here and its class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping

import torch

from ...model.qwen35 import MtpHead
from ..trunk import Trunk
from .base import Drafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter


@dataclass(frozen=True)
class DraftSource:
    """What a drafter may be built from: the trunk, the MTP head when one was loaded, the state
    dtype, the n-gram sizes."""

    trunk: Trunk
    mtp_head: MtpHead | None
    kv_dtype: torch.dtype
    ngram: tuple[int, int] = (1, 4)


@dataclass(frozen=True)
class DrafterKind:
    name: str                                      # the route, and the SpecPolicy mode that asks for it
    short: str                                     # in reasons: "MTP and n-gram measured per cycle"
    what: str                                      # in reasons: "MTP head requested", "(no MTP head loaded)"
    make: Callable[[DraftSource], Drafter | None]  # None: this model has no such drafter
    absent: str = ""                               # why a request for it is refused when it is not built
    seeded: bool = False                           # auto's fixed route for a seeded sampled request
    draft_vocab: bool = False                      # it scores the trunk's draft vocabulary (reasons say so)


KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(MtpDrafter.name, "MTP", "MTP head",
                lambda s: None if s.mtp_head is None else MtpDrafter(s.mtp_head, s.trunk, s.kv_dtype),
                absent="no MTP head is loaded (the checkpoint has no mtp.* tensors or the model was loaded "
                       "with spec mode 'off')", seeded=True, draft_vocab=True),
    DrafterKind(NgramDrafter.name, "n-gram", "n-gram prompt lookup", lambda s: NgramDrafter(*s.ngram)),
)
BY_NAME: dict[str, DrafterKind] = {k.name: k for k in KINDS}


def make_drafters(src: DraftSource) -> dict[str, Drafter]:
    """Route name -> drafter, for every kind this model has, in `KINDS` order."""
    out = {}
    for kind in KINDS:
        d = kind.make(src)
        if d is not None:
            out[kind.name] = d
    return out


def drafting_routes(built: Collection[str] | Mapping[str, Drafter]) -> tuple[str, ...]:
    """The drafting routes among `built`, in `KINDS` order (auto's candidates)."""
    return tuple(k.name for k in KINDS if k.name in built)
