"""Group sums of a 4-bit GEMV's input, made by the kernel that writes the input.

The 4-bit GEMV (kernels/q4/gemv.py) needs, per row and per group of G = 128 inputs, the sum of
its input x (the zero-point term (z - 128 s) sum(x)). Made by a small kernel of its own, that is a
launch before every 4-bit GEMV (257 in a 27B step). The kernels that write those inputs on CUDA
(the RMSNorm and add + RMSNorm, the GDN gated norm, the attention output gate, SiLU-mul) can
store them as they write x: `xs`, float32, the sums of each run of G consecutive elements of
their contiguous output, of the ROUNDED values (those the GEMV reads).

How the sums travel: the producer attaches them to the output tensor it has just allocated
(`attach`); the GEMV asks `take(x, G)` for the sums of exactly its x, which answers only when x
is that tensor object (or a reshape of it made by `reshaped`, which carries them: views made in
inference mode do not record their base) and, where the tensor keeps a version counter, nothing
wrote into it since. Anything else (a copy, a slice, a Hadamard-rotated x, a concatenation) gets
None and the GEMV sums x itself, as before. No
global state: the sums live and die with the tensor; under CUDA-graph capture they are one more
buffer of the graph's pool, written by the captured producer and read by the captured GEMV.

Bits: with the fold on, every group sum, in a producer and in the GEMV's own sum(x) kernel, is
the same fixed pairwise tree (adjacent pairs, then pairs of those, ... : `group_sums_ref` below;
the kernels' `group_sums` in kernels/small/kernel.py), each addition a float32 elementwise add, so it
does not depend on a kernel's thread layout: the folded sums equal the GEMV's own bit for bit,
and a row's sums never depend on the other rows (row-invariant). The tree's order differs from
the plain reduction (tl.sum) the sum(x) kernel uses with the fold off, so outputs can differ in
the last bits between the two settings (greedy MTP == AR holds in each).

SPECFIRE_XSUM_FOLD picks the form (read at each call, so one process can A/B; a captured graph
keeps what it captured): `plain` (the default) sums each group with tl.sum in the producer: few
instructions, row-invariant (each row's program runs the same code whatever the row count), its
last bits possibly not those of the GEMV's own sum(x) kernel; `1` / `tree` the pairwise tree above
(bit for bit the GEMV's own, but ~300-400 more instructions a producer); `0` off. Measured on the
H200 (docs/BENCHMARKS.md "Eighth wave: the sum(x) fold"): the 4-bit 27B step 6.92 ms off, 7.08
tree, 6.72 plain (144.5 -> 148.9 tok/s), MTP == AR in every form.
"""
from __future__ import annotations

import os

import torch

G = 128          # the group of the sums: the 4-bit format's default group (kernels/q4 DEFAULT_GROUP)
MAX_ROWS = 16    # producers fold only for at most this many rows (kernels/gemv ROW_PATH_MAX: decode, verify)


OFF, TREE, PLAIN = 0, 1, 2
_MODES = {"0": OFF, "1": TREE, "tree": TREE, "": PLAIN, "plain": PLAIN}


def mode() -> int:
    """SPECFIRE_XSUM_FOLD: unset / plain (the default: tl.sum in each producer; the 4-bit 27B step
    6.92 -> 6.72 ms on the H200, MTP == AR, docs/BENCHMARKS.md "Eighth wave: the sum(x) fold"); 1 /
    tree: the producers' sums by the pairwise tree, bit for bit the GEMV's own (GPU-checked; slower,
    7.08 ms); 0: off (every 4-bit GEMV sums its input in its own launch)."""
    v = os.environ.get("SPECFIRE_XSUM_FOLD", "plain").strip().lower()
    if v not in _MODES:
        raise ValueError(f"SPECFIRE_XSUM_FOLD must be 0, 1 / tree or plain, got {v!r}")
    return _MODES[v]


def enabled() -> bool:
    return mode() != OFF


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
    (or the CPU tests' Triton interpreter), the fold on, a 4-bit GEMV seen on y's device
    (`consumer_on`), d a whole number of groups, a decode / verify-sized output (at most MAX_ROWS
    tokens: y's leading dimension)."""
    return ((y.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and enabled() and d > 0 and d % G == 0
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
    """Reference: float32 sums of each run of g consecutive elements of y (flattened), by the
    kernels' pairwise tree: v[0] + v[1], v[2] + v[3], ..., then the same on those sums."""
    v = y.reshape(-1).float().reshape(-1, g)
    while v.shape[1] > 1:
        v = v[:, 0::2] + v[:, 1::2]
    return v[:, 0]
