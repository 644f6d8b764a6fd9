"""RMSNorm variants used by Qwen3.5."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import lanes


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


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """One Triton kernel on CUDA (same rounding points as the reference), the reference elsewhere."""
    if x.is_cuda:
        from .triton_small import rms_norm_triton
        return rms_norm_triton(x, w, eps)
    return rms_norm_ref(x, w, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm -> (x + h, rms_norm(x + h))."""
    if x.is_cuda:
        from .triton_small import add_rms_norm_triton
        return add_rms_norm_triton(x, h, w, eps)
    return add_rms_norm_ref(x, h, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from .triton_small import gated_rms_norm_triton
        return gated_rms_norm_triton(x, z, w, eps)
    return gated_rms_norm_ref(x, z, w, eps)
