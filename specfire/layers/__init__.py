"""The layers a model is built from, one implementation of each kind per target, picked once.

`target_for(device_type, canonical)` returns the table for one device; a mesh builds its own
(parallel/layers.py). model/qwen35.py is written once against a table: nothing in a forward asks
where it runs.

| target | projections | norms, elementwise rows | mixers |
|---|---|---|---|
| one GPU | `Linear` (Triton rows, cuBLAS prefill) | Triton | fused decode kernels |
| one CPU device | `Linear` (one mm per row on W^T; one product per input group) | `Cpu*` norms, rows batched on whole vector steps | `CpuGatedDeltaNet` |
| canonical (`exact`: a mesh's bits on one device) | `ExactLinear`, `SplitLinear` (kernels/splitk) | the references, CPU rows one at a time, elementwise math padded (kernels/lanes.py) | the GPU's fused kernels; no autotuned library |
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch.nn as nn

from ..config import ModelConfig
from ..kernels import lanes
from .attention import FusedGatedAttention, GatedAttention
from .gdn import CpuGatedDeltaNet, FusedGatedDeltaNet, GatedDeltaNet
from .linear import ExactLinear, Linear, SplitLinear
from .norm import CpuGatedRMSNorm, CpuRMSNorm, GatedRMSNorm, RMSNorm
from .rows import BATCHED, DIRECT, PER_ROW, Direct

__all__ = ["CPU", "CPU_EXACT", "CUDA", "CUDA_EXACT", "ExactLinear", "GatedAttention", "GatedDeltaNet",
           "GatedRMSNorm", "Linear", "RMSNorm", "Share", "SplitLinear", "Target", "target_for"]


@dataclass(frozen=True)
class Share:
    """The heads and MLP rows one device holds (the whole model but on a mesh)."""

    n_heads: int
    n_kv: int
    n_k_heads: int
    n_v_heads: int
    inter: int
    conv_dim: int
    vocab: int          # embedding and lm_head rows

    @classmethod
    def whole(cls, cfg: ModelConfig) -> "Share":
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.linear_num_key_heads,
                   cfg.linear_num_value_heads, cfg.intermediate_size, cfg.conv_dim, cfg.vocab_size)


def _column(cls: type[Linear], in_features: int, out_features: int, whole_out: int | None = None) -> Linear:
    """A projection whose outputs a mesh splits (`whole_out`: the whole matrix's); whole here."""
    return cls(in_features, out_features)


_QUIET = nullcontext()


@dataclass(frozen=True)
class Target:
    """Factories of each layer kind (model/qwen35.py calls them with the whole model's sizes) and
    the target's flags."""

    name: str
    column: Callable[..., Linear]            # (in, out here, out of the whole) -> a column projection
    row: Callable[[int, int], Linear]        # (in of the whole, out) -> a reduction a mesh splits
    replicated: Callable[[int, int], Linear]  # (in, out) -> a projection every rank computes whole
    norm: Callable[[int, float], RMSNorm]
    gated_norm: Callable[[int, float], GatedRMSNorm]
    attention: type[GatedAttention]
    gdn: type[GatedDeltaNet]
    rowmap: Direct                          # how elementwise math meets verify rows (layers/rows.py)
    exact: bool = False                     # tensor-parallel invariant math (a mesh, or tp_invariant)
    fused_head: bool = False                # the MTP head's fused step (kernels/head): one GPU
    packed_rows: bool = False               # the packed decode / verify forward (model/cpu.py): one CPU device
    share: Callable[[ModelConfig], Share] = field(default=Share.whole)
    embedding: Callable[[int, int], nn.Module] = field(default=nn.Embedding)

    def scope(self):
        """The context a forward runs in: elementwise math padded to whole vectors when exact."""
        return lanes.invariant() if self.exact else _QUIET


CUDA = Target("cuda", partial(_column, Linear), Linear, Linear, RMSNorm, GatedRMSNorm,
              FusedGatedAttention, FusedGatedDeltaNet, DIRECT, fused_head=True)
CPU = Target("cpu", partial(_column, Linear), Linear, Linear, CpuRMSNorm, CpuGatedRMSNorm,
             GatedAttention, CpuGatedDeltaNet, BATCHED, packed_rows=True)
CUDA_EXACT = replace(CUDA, name="cuda-exact", column=partial(_column, ExactLinear), row=SplitLinear,
                     replicated=ExactLinear, exact=True, fused_head=False)
CPU_EXACT = Target("cpu-exact", partial(_column, ExactLinear), SplitLinear, ExactLinear,
                   partial(RMSNorm, rowmap=PER_ROW), partial(GatedRMSNorm, rowmap=PER_ROW),
                   GatedAttention, GatedDeltaNet, PER_ROW, exact=True)


def target_for(device_type: str, canonical: bool = False) -> Target:
    """One device's table: CUDA or else the CPU's; `canonical`, the mesh-equal math
    (LLM(tp_invariant=True), passed down by model/loader.py)."""
    if device_type == "cuda":
        return CUDA_EXACT if canonical else CUDA
    return CPU_EXACT if canonical else CPU
