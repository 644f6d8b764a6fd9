"""Zero-centred RMSNorm (scale 1 + w, with the residual add fused in `add`) and Gated DeltaNet's
gated output norm.

`RMSNorm` / `GatedRMSNorm`: the kernels of kernels/norm (Triton on CUDA, the references on the
CPU, elementwise math padded inside a canonical forward: kernels/lanes.py). `CpuRMSNorm`
/ `CpuGatedRMSNorm`, one CPU device's: torch's rms_norm on a cached (1 + w) instead of the
reference's chain of seven calls (about 3x faster a norm on the 2-core CPU); the last bits differ
from the reference's, and a verify row still equals a decode (layers/rows.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import norm as kn
from .rows import BATCHED, DIRECT, Direct


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, rowmap: Direct = DIRECT):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.rowmap = rowmap

    def forward(self, x: torch.Tensor, rows: bool = False) -> torch.Tensor:
        return self.rowmap(self.norm, rows, x)

    def add(self, x: torch.Tensor, h: torch.Tensor, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)) in one op; h is rounded to x's dtype first (a mesh's row-parallel
        sums arrive in float32)."""
        return self.rowmap(self.add_norm, rows, x, h)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return kn.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kn.add_rms_norm(x, h, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """norm(x) w (plain w), then the SiLU gate of z."""

    def __init__(self, dim: int, eps: float, rowmap: Direct = DIRECT):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.rowmap = rowmap

    def forward(self, x: torch.Tensor, z: torch.Tensor, rows: bool = False) -> torch.Tensor:
        return self.rowmap(self.norm, rows, x, z)

    def norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return kn.gated_rms_norm(x, z, self.weight, self.eps)


def cached(w: torch.Tensor, tag: str, fn) -> torch.Tensor:
    """fn(w), kept on w (attribute `tag`) until w changes."""
    hit = getattr(w, tag, None)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    out = fn(w)
    if not w.is_inference():
        setattr(w, tag, (w._version, out))
    return out


class CpuRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float, rowmap: Direct = BATCHED):
        super().__init__(dim, eps, rowmap)

    def norm(self, x):
        w = cached(self.weight, "_specfire_p1", lambda t: 1.0 + t.float())
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)

    def add_norm(self, x, h):
        s = x + h.to(x.dtype)
        return s, self.norm(s)


class CpuGatedRMSNorm(GatedRMSNorm):
    def __init__(self, dim: int, eps: float, rowmap: Direct = BATCHED):
        super().__init__(dim, eps, rowmap)

    def norm(self, x, z):
        dt = x.dtype
        if dt == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight.float(), self.eps) * F.silu(z.float())
        n = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dt)
        return ((self.weight * n).float() * F.silu(z.float())).to(dt)
