"""Group sums of a 4-bit GEMV's input made by the kernel that writes it (norms, the gated norm, the
attention gate, SiLU-mul), so the GEMV needs no sum(x) launch: attached to the producer's own output
tensor, taken only for that very tensor unchanged (else None: the GEMV sums x itself)."""
from __future__ import annotations

import os

import torch

G = 128          # the group of the sums: the 4-bit format's default group (kernels/q4 DEFAULT_GROUP)
MAX_ROWS = 16    # producers fold only for at most this many rows (kernels/gemv ROW_PATH_MAX: decode, verify)

# Devices on which a 4-bit GEMV has run: only there do producers fold, so a model without 4-bit
# weights (bf16) never pays for sums nobody reads. Only a cost switch: a fold that no GEMV takes, or
# a GEMV that finds none, computes the same result.
_CONSUMERS: set[str] = set()


def consumer_on(device: torch.device) -> None:
    """A 4-bit GEMV runs on `device` (kernels/q4 q4_rows): producers there fold from now on
    (the eager warm-up forwards before a CUDA-graph capture make the captured graphs fold)."""
    _CONSUMERS.add(str(device))


def want(y: torch.Tensor, d: int) -> bool:
    """Whether a producer writing y (rows of d elements) should also write its group sums: CUDA
    (or the CPU tests' Triton interpreter), a 4-bit GEMV seen on y's device
    (`consumer_on`), d a whole number of groups, a decode / verify-sized output (at most MAX_ROWS
    tokens: y's leading dimension)."""
    return ((y.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and d > 0 and d % G == 0
            and y.dim() >= 1 and 0 < y.shape[0] <= MAX_ROWS and y.numel() > 0
            and str(y.device) in _CONSUMERS)


def new(y: torch.Tensor) -> torch.Tensor:
    """The float32 buffer of y's group sums (y.numel() / G of them)."""
    return torch.empty(y.numel() // G, device=y.device, dtype=torch.float32)


def attach(y: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """Hand xs (the sums of y's contiguous groups, just written) along with y; returns y."""
    y._specfire_xs = (xs, None if y.is_inference() else y._version)
    return y


def take(x: torch.Tensor, g: int) -> torch.Tensor | None:
    """The group sums of x [M, K] as [M, K / g] when a producer attached them to x (or `reshaped`
    carried them to it) and, where x keeps a version counter, nothing was written into x since;
    else None."""
    hit = getattr(x, "_specfire_xs", None)
    if hit is None or g != G or x.dim() != 2 or x.shape[1] % G or not x.is_contiguous():
        return None
    xs, ver = hit
    if ver is not None and (x.is_inference() or x._version != ver):
        return None
    if xs.numel() * G != x.numel():
        return None
    return xs.view(x.shape[0], x.shape[1] // G)


def reshaped(y: torch.Tensor, shape) -> torch.Tensor:
    """y.reshape(shape), carrying y's group sums when the result is a view of the same memory
    (a view is a new tensor object: nothing attached to y reaches it otherwise)."""
    out = y.reshape(shape)
    hit = getattr(y, "_specfire_xs", None)
    if hit is not None and y.is_contiguous() and out.data_ptr() == y.data_ptr():
        out._specfire_xs = hit
    return out


def group_sums_ref(y: torch.Tensor, g: int = G) -> torch.Tensor:
    """Reference: float32 sums of each run of g consecutive elements of y (flattened)."""
    return y.reshape(-1).float().reshape(-1, g).sum(-1)
