"""RMSNorm variants used by Qwen3.5: Triton on CUDA (the references' rounding points), ref.py elsewhere."""
from __future__ import annotations

import torch

from .ref import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref

__all__ = ["add_rms_norm", "add_rms_norm_ref", "gated_rms_norm", "gated_rms_norm_ref", "rms_norm", "rms_norm_ref"]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """One Triton kernel on CUDA (same rounding points as the reference), the reference elsewhere."""
    if x.is_cuda:
        from .kernel import rms_norm_triton
        return rms_norm_triton(x, w, eps)
    return rms_norm_ref(x, w, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm -> (x + h, rms_norm(x + h))."""
    if x.is_cuda:
        from .kernel import add_rms_norm_triton
        return add_rms_norm_triton(x, h, w, eps)
    return add_rms_norm_ref(x, h, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from .kernel import gated_rms_norm_triton
        return gated_rms_norm_triton(x, z, w, eps)
    return gated_rms_norm_ref(x, z, w, eps)
