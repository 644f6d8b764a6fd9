"""Projections: y = x W^T, bias-free, the weight [out, in] (or a 4-bit QuantWeight in its place).

`Linear` is one device's product (kernels/gemv `linear`: Triton rows and cuBLAS prefill on CUDA,
one `mm` per row on a cached W^T on the CPU). `ExactLinear` computes every output element as it
is computed inside any column shard of the matrix (kernels/gemv, `exact`); `SplitLinear` is a
reduction that tensor parallelism splits (o_proj, out_proj, down_proj) as the canonical float32
chunk tree of kernels/splitk, so one device computes a mesh's bits. The mesh's own projections
(parallel/layers.py) extend these two.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.gemv import linear, linear_group
from ..kernels.splitk import ChunkCache, KSplit, subtree


class Linear(nn.Module):
    exact = False
    launch_n: int | None = None       # the whole matrix's out when this is a column shard (CUDA launches)

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        return linear(x, self.weight, rows, self.launch_n, exact=self.exact)

    def group(self, x: torch.Tensor, rows: bool, *lins: "Linear") -> list[torch.Tensor]:
        """The projections of one input by self and `lins` (MLP gate + up; q, k, v; GDN qkv, z, b,
        a): one product for all on one CPU device (their W^T concatenated, cached on self), one
        launch with the whole matrices' settings on CUDA (kernels/gemv linear_group)."""
        every = (self, *lins)
        return linear_group(x, [m.weight for m in every], rows, [m.launch_n for m in every],
                            exact=self.exact, owner=self)


class ExactLinear(Linear):
    exact = True


class SplitLinear(ExactLinear):
    """The canonical chunks `ksplit` of the reduction over k_total inputs (all of them on one
    device); the sum comes back in x's dtype."""

    def __init__(self, k_total: int, out_features: int, split: KSplit | None = None):
        split = split if split is not None else KSplit(k_total)
        super().__init__(split.k_local, out_features)
        self.ksplit = split
        self._chunks = ChunkCache()

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        return subtree(x, self.weight, self.ksplit, rows, self._chunks, x.dtype)
