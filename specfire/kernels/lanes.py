"""Transcendental elementwise functions whose CPU result does not depend on where an element sits.

ATen's CPU loops run whole steps of VEC elements through the vectorised (SLEEF) code and the
remainder through scalar code, and the two differ in the last bits for exp, sigmoid, SiLU,
softplus and rsqrt. So an element's value would depend on the tensor's size and its offset in
it: a tensor-parallel shard of a head dimension (or a verify row among others) would round
differently from the whole. Here a tensor whose size is not a whole number of steps is padded
to one, and one larger than ATen's parallel grain is cut at grain bounds (multiples of VEC),
so every element takes the vectorised path, which is the same for every lane. CUDA computes
every element the same way and takes the direct path.

Only a tensor-parallel forward needs this: the padding is on inside `invariant()` scopes (the
forward of a model built with an exact target, layers/__init__.py: a mesh rank, or one device with
LLM(tp_invariant=True)) and off elsewhere. Verify rows get their row invariance from per-row
application (layers/rows.py) instead.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

VEC = 32        # elements per step of ATen's vectorised loop (2 vectors of 16 floats on AVX-512)
GRAIN = 32768   # at::internal::GRAIN_SIZE: above it a loop is split between threads
_scope = threading.local()   # .on: inside an invariant() scope of this thread


def invariant_now() -> bool:
    """Inside an invariant() scope: CPU math must give a tensor-parallel shard the whole's bits."""
    return getattr(_scope, "on", False)


@contextmanager
def invariant(on: bool = True) -> Iterator[None]:
    """Within the scope (when `on`), this thread's CPU math is tensor-parallel invariant (elementwise
    math padded to whole vectors); a nested scope keeps an outer one's setting."""
    prev = getattr(_scope, "on", False)
    _scope.on = prev or bool(on)
    try:
        yield
    finally:
        _scope.on = prev


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed by the vectorised path for every element on the CPU
    inside an `invariant()` scope; fn(x) itself otherwise."""
    if x.device.type != "cpu" or not getattr(_scope, "on", False):
        return fn(x)
    n = x.numel()
    if n % VEC == 0 and x.is_contiguous() and (n <= GRAIN or torch.get_num_threads() == 1):
        return fn(x)
    flat = x.reshape(-1)
    if n % VEC:
        flat = F.pad(flat, (0, VEC - n % VEC))
    if flat.numel() <= GRAIN or torch.get_num_threads() == 1:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i:i + GRAIN]) for i in range(0, flat.numel(), GRAIN)])
    return out[:n].view(x.shape)


def exp(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.exp, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return lanewise(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return lanewise(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return lanewise(F.softplus, x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x): both correctly rounded in the vector and the scalar code, so no padding (ATen's
    own rsqrt differs between the two)."""
    if x.device.type != "cpu":
        return torch.rsqrt(x)
    return torch.sqrt(x).reciprocal()
