"""PyTorch references of the RMSNorm variants Qwen3.5 uses."""
from __future__ import annotations

import torch

from .. import lanes


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32, cast back."""
    xf = x.float()
    y = xf * lanes.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: plain w (not 1 + w), norm first, then the SiLU gate in float32."""
    dt = x.dtype
    xf = x.float()
    n = (xf * lanes.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    y = (w * n).float() * lanes.silu(z.float())
    return y.to(dt)


def add_rms_norm_ref(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then the norm: (s = x + h in x's dtype, rms_norm(s)); h is rounded to x's
    dtype first (a mesh's float32 row-parallel sum)."""
    s = x + h.to(x.dtype)
    return s, rms_norm_ref(s, w, eps)
