"""The MLP activation: SiLU(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import lanes


def silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in g's dtype (silu rounded to the dtype before the product, as eager PyTorch does)."""
    return lanes.silu(g) * u


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One fused kernel on CUDA, the reference elsewhere."""
    if g.is_cuda:
        from .triton_small import silu_mul_triton
        return silu_mul_triton(g, u)
    return silu_mul_ref(g, u)
