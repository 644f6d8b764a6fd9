"""The canonical mode: one device computes a mesh's bits (the canonical split-K of
kernels/splitk, CPU elementwise math padded to whole vectors, kernels/lanes.py)."""
from __future__ import annotations

import torch

_enabled: bool | None = None   # None: the default (off on one device), see enabled()


def enabled(x: torch.Tensor | None = None) -> bool:
    """Whether a single device computes row-parallel projections as the canonical split (and, on
    the CPU, pads elementwise math to whole vectors). Default: no (one device has no shard to match,
    and the split costs decode time); `set_enabled(True)` makes one device bit-equal to a mesh."""
    return bool(_enabled)


def set_enabled(on: bool | None) -> None:
    """Force the canonical split on or off on a single device (None: the default above). Read
    when a model is built (model/loader.py `one_device`: its layers are the canonical target's),
    so set it before loading."""
    global _enabled
    _enabled = None if on is None else bool(on)
