"""How a layer applies elementwise math to decode / verify rows, so a verify row gets the bits a
one-row decode gets (greedy speculation == AR).

PyTorch's CPU elementwise kernels run whole vectors through the vectorised (SLEEF) code and the
tail through scalar code, and the two differ in the last bits for sigmoid, SiLU, softplus, rsqrt,
cos / sin: row r of a k+1-row verify could differ from the row decoded alone. So on the CPU the
rows mode applies that math one row at a time (`PerRow`); one CPU device may also take all rows in
one call where every row is a whole number of STEP elements and no loop is split between threads
(`Batched`: every element then takes the vector path; torch's rms_norm reduces each row alike
whatever the row count, tests/model/test_onecpu.py). CUDA computes every element alike (`Direct`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..kernels.gdn import conv_window
from ..kernels.small import rope_cos_sin

STEP = 64        # elements: whole steps of ATen's vector loop on AVX2 (16) and AVX-512 (32)
GRAIN = 32768    # at::internal::GRAIN_SIZE: above it a loop is split between threads


def whole_steps(*xs: torch.Tensor) -> bool:
    """Every x's rows run entirely through ATen's vectorised CPU code, in one thread's loop."""
    return all(x.shape[-1] % STEP == 0 and x.stride(-1) == 1 for x in xs) and (
        torch.get_num_threads() == 1 or all(x.numel() <= GRAIN for x in xs))


def per_row(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """fn(*xs) one row of the xs at a time (they share the leading row dimension); fn may return a
    tensor or a tuple of tensors (each concatenated over the rows)."""
    parts = [fn(*(x[i:i + 1] for x in xs)) for i in range(xs[0].shape[0])]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(list(col)) for col in zip(*parts))
    return torch.cat(parts)


class Direct:
    """A GPU's: every element is computed alike whatever the tensor, so rows need nothing."""

    def __call__(self, fn: Callable[..., Any], rows: bool, *xs: torch.Tensor) -> Any:
        """fn(*xs) for elementwise / row-wise fn (rows of the xs in the leading dimension)."""
        return fn(*xs)

    each = __call__      # the same, for an fn whose rows must never be batched on the CPU

    def conv(self, x: torch.Tensor, window: torch.Tensor, w: torch.Tensor, rows: bool):
        """The causal conv window (kernels/gdn conv_window) of rows x [T, C] after `window`."""
        return conv_window(x, window, w)

    def rotary(self, pos: torch.Tensor, dim: int, theta: float, rows: bool):
        return rope_cos_sin(pos, dim, theta)


class PerRow(Direct):
    """The CPU's: in rows mode each row alone, as a one-row decode computes it."""

    def __call__(self, fn, rows, *xs):
        if not rows or xs[0].shape[0] == 1:
            return fn(*xs)
        return per_row(fn, *xs)

    each = __call__

    def split(self, rows: bool, x: torch.Tensor) -> bool:
        return rows and x.shape[0] > 1

    def conv(self, x, window, w, rows):
        if not self.split(rows, x):
            return conv_window(x, window, w)
        full = torch.cat([window.to(x.dtype), x], dim=0)
        kw = window.shape[0]
        return torch.cat([conv_window(x[i:i + 1], full[i:i + kw], w)[0] for i in range(x.shape[0])]), full

    def rotary(self, pos, dim, theta, rows):
        if not rows or pos.shape[0] == 1:
            return rope_cos_sin(pos, dim, theta)
        cs = [rope_cos_sin(pos[i:i + 1], dim, theta) for i in range(pos.shape[0])]
        return torch.cat([c for c, _ in cs]), torch.cat([s for _, s in cs])


class Batched(PerRow):
    """One CPU device's: all rows in one call where every row is on whole vector steps."""

    def __call__(self, fn, rows, *xs):
        if not rows or xs[0].shape[0] == 1 or whole_steps(*xs):
            return fn(*xs)
        return per_row(fn, *xs)

    each = PerRow.__call__

    def split(self, rows, x):
        return rows and x.shape[0] > 1 and not whole_steps(x)


DIRECT, PER_ROW, BATCHED = Direct(), PerRow(), Batched()
