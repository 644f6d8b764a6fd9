"""Row-invariant elementwise math on the CPU.

PyTorch's CPU elementwise kernels run the vectorised (SLEEF) path on whole vectors and a scalar
path on the tail, and the two differ in the last bits for sigmoid, SiLU, softplus, rsqrt, cos/sin.
Which path an element takes depends on its offset in the whole tensor, so row r of a k+1-row
verify could differ from the same row decoded alone (measured: rows of [7, 300] vs [1, 300]
differed for sigmoid, silu, softplus and rsqrt). In rows mode on the CPU the nonlinear parts are
therefore applied one row at a time, exactly as a one-row decode applies them. CUDA elementwise
kernels compute every element the same way, so the GPU takes the direct path.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def rowwise(fn: Callable[..., Any], rows: bool, *xs: torch.Tensor) -> Any:
    """fn(*xs) with xs sharing the leading row dimension; per row when `rows` on the CPU. `fn` may
    return a tensor or a tuple of tensors (each concatenated over rows)."""
    t = xs[0].shape[0]
    if not rows or t == 1 or xs[0].device.type != "cpu":
        return fn(*xs)
    parts = [fn(*(x[i:i + 1] for x in xs)) for i in range(t)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(list(col)) for col in zip(*parts))
    return torch.cat(parts)
