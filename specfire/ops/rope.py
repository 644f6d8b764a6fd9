"""Partial NeoX-style rotary embedding (the first `rotary_dim` dims of each head rotate)."""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim] in float32 for integer positions [T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] with R <= D. Dims [R:] pass through unchanged."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = r // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One Triton kernel on CUDA (same rounding points as the reference), the reference elsewhere."""
    if x.is_cuda:
        from .triton_small import apply_rope_triton
        return apply_rope_triton(x, cos, sin)
    return apply_rope_ref(x, cos, sin)
