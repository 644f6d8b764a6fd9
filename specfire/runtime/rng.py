"""Random numbers whose state lives in a device tensor, so sampling can be captured in CUDA graphs.

A torch.Generator keeps its state on the host side of a graph: a replay would draw the numbers of
the capture again. Here the state is (key, counter) in one int64 tensor on the device; a draw of n
numbers hashes counter .. counter+n-1 with the key (counter-based, like Philox) and advances the
counter in place, so every replay draws fresh numbers and a seed reproduces the whole request,
whether its steps ran eagerly or from graphs. The hash is lowbias32 (Wellons) applied in two keyed
rounds, in int64 arithmetic that is exact on the CPU and on CUDA.

Sampling uses the exponential race: token = argmax_v p_v / E_v with E_v ~ Exp(1) independent;
P(token = v) = p_v exactly, and zero-probability tokens are never drawn.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 values in [0, 2^32); products wrap mod 2^64, the low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def hash_bits(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) per counter value, for a key; both non-negative int64.
    Two rounds with two subkeys that every key bit reaches, so the streams of different keys are
    not shifted copies of one sequence."""
    k1 = _mix32((key & M32) ^ 0x9E3779B9)
    k2 = _mix32(((key >> 32) & M32) ^ k1 ^ 0x85EBCA6B)
    x = _mix32((counter & M32) ^ k1)
    return _mix32(x ^ k2 ^ ((counter >> 32) & M32))


class DeviceRng:
    """(key, counter) in `state` [2] int64 on `device`. `seed` writes it in place, so a graph that
    captured this object keeps reading the current request's state."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.state = torch.zeros(2, dtype=torch.long, device=device)

    def seed(self, seed: int | None) -> "DeviceRng":
        """Start a stream: `seed` (0 .. 2^63-1), or a fresh key from torch's global generator."""
        key = int(torch.randint(0, 2 ** 62, (1,)).item()) if seed is None else int(seed)
        self.state.copy_(torch.tensor([key, 0], dtype=torch.long))
        return self

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        """float64 uniforms in (0, 1) of `shape`; advances the counter by their number."""
        n = 1
        for s in shape:
            n *= s
        c = self.state[1] + torch.arange(n, dtype=torch.long, device=self.state.device)
        bits = hash_bits(c, self.state[0])
        self.state[1:].add_(n)
        return ((bits.double() + 0.5) * 2.0 ** -32).view(shape)


def race_sample(p: torch.Tensor, rng: DeviceRng) -> torch.Tensor:
    """One token per row of probabilities p [R, V] -> [R] int64 (the exponential race)."""
    e = -torch.log(rng.uniform(tuple(p.shape)))
    return (p.double() / e).argmax(-1)
