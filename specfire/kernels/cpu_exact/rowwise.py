"""Row-invariant elementwise math on the CPU.

PyTorch's CPU elementwise kernels run the vectorised (SLEEF) path on whole vectors and a scalar
path on the tail, and the two differ in the last bits for sigmoid, SiLU, softplus, rsqrt, cos/sin.
Which path an element takes depends on its offset in the whole tensor, so row r of a k+1-row
verify could differ from the same row decoded alone (measured: rows of [7, 300] vs [1, 300]
differed for sigmoid, silu, softplus and rsqrt). In rows mode on the CPU the nonlinear parts are
therefore applied one row at a time, exactly as a one-row decode applies them. CUDA elementwise
kernels compute every element the same way, so the GPU takes the direct path.

One CPU device may pass `batch=True` for an fn made of elementwise math and row-wise norms: then
the rows go in one call when every tensor's last dimension is a whole number of STEP elements
(every element on the vectorised path, in each row alone as in all rows) and no loop is split
between threads; torch's rms_norm reduces each row alike whatever the row count (measured, T =
2..16 rows, 1 and 2 threads: tests/kernels/test_onecpu.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


STEP = 64        # elements: whole steps of ATen's vector loop on AVX2 (16) and AVX-512 (32)
GRAIN = 32768    # at::internal::GRAIN_SIZE: above it a loop is split between threads


def whole_steps(*xs: torch.Tensor) -> bool:
    """Every x's rows run entirely through ATen's vectorised CPU code, in one thread's loop."""
    return all(x.shape[-1] % STEP == 0 and x.stride(-1) == 1 for x in xs) and (
        torch.get_num_threads() == 1 or all(x.numel() <= GRAIN for x in xs))


def rowwise(fn: Callable[..., Any], rows: bool, *xs: torch.Tensor, batch: bool = False) -> Any:
    """fn(*xs) with xs sharing the leading row dimension; per row when `rows` on the CPU (all rows
    at once when `batch` and whole_steps). `fn` may return a tensor or a tuple of tensors (each
    concatenated over rows)."""
    t = xs[0].shape[0]
    if not rows or t == 1 or xs[0].device.type != "cpu" or (batch and whole_steps(*xs)):
        return fn(*xs)
    parts = [fn(*(x[i:i + 1] for x in xs)) for i in range(t)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(list(col)) for col in zip(*parts))
    return torch.cat(parts)
