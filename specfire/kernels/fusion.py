"""The switch for the fused decode kernels (kernels/gdn/fused.py, kernels/attention/fused.py).

Why a switch: the fused rows path is a GPU-only fast path whose results equal the unfused path's
only up to float32 reduction order, so benchmarks compare the two in one process and a user can
fall back. `SPECFIRE_FUSE=0` turns it off; `set_enabled` overrides the variable. A graph keeps the
choice made when it was captured. The CPU always runs the reference path (its bits unchanged).
"""
from __future__ import annotations

import os

import torch

_forced: bool | None = None


def set_enabled(on: bool | None) -> None:
    """True / False force the fused rows path on CUDA on or off; None follows SPECFIRE_FUSE."""
    global _forced
    _forced = on


def enabled(x: torch.Tensor) -> bool:
    """Whether a rows-mode forward over x takes the fused kernels (CUDA only)."""
    if not x.is_cuda:
        return False
    if _forced is not None:
        return _forced
    return os.environ.get("SPECFIRE_FUSE", "1") != "0"
