"""One rank's layers: the canonical target (layers/__init__.py) with this rank's shards of every
projection and of the embedding, so the rank computes each of its elements as one device with
tp_invariant does, and the ranks' partial sums add up in the canonical tree.

Column shards (by head, by MLP row, by vocabulary row) carry the whole matrix's N (`launch_n`)
for the CUDA kernel's launch settings; a row-parallel projection holds this rank's canonical
chunks of K (kernels/splitk) and adds the ranks' subtrees through `combine`.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..kernels.splitk import KSplit, subtree
from ..layers import ExactLinear, Share, SplitLinear, Target, target_for
from .comm import Comm
from .shard import ShardPlan


class ColumnParallelLinear(ExactLinear):
    def __init__(self, in_features: int, out_features: int, whole_out: int):
        super().__init__(in_features, out_features)
        self.launch_n = whole_out


class RowParallelLinear(SplitLinear):
    """This rank's chunks of a reduction over k_total inputs: their float32 subtree, then the
    ranks' subtrees added by `combine` (comm.tree_all_reduce; the sharded MTP head's chain swaps
    in its own collectives, parallel/mtp.py), into where `reserve` wants it (a collective's buffer)."""

    def __init__(self, k_total: int, out_features: int, plan: ShardPlan, comm: Comm):
        super().__init__(k_total, out_features, KSplit.for_rank(k_total, plan.rank, plan.tp))
        self.combine, self.reserve = comm.tree_all_reduce, comm.tree_buffer

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        """The whole sum in float32: the next norm rounds it to the model dtype as its first step
        (the same bits as a cast here, one kernel less)."""
        out = self.reserve(x.shape[0], self.weight.shape[0]) if self.reserve is not None else None
        return self.combine(subtree(x, self.weight, self.ksplit, rows, self._chunks, out=out))


class VocabParallelEmbedding(nn.Module):
    """Holds vocabulary rows [v0, v0 + shard); a token outside them contributes zeros, and the
    all-reduce adds the one rank that has it (exact: x + 0 = x)."""

    def __init__(self, shard: int, hidden: int, v0: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard, hidden), requires_grad=False)
        self.v0, self.comm = v0, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = self.comm.shared_ids(ids)          # in the captured rows forward: rank 0's ids
        local = ids - self.v0
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = self.weight[local.clamp(0, self.weight.shape[0] - 1)]            # [T, H]
        x = torch.where(mine[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        return self.comm.all_reduce(x)


def mesh_target(plan: ShardPlan, comm: Comm) -> Target:
    """Rank `plan.rank`'s layers: always the canonical math (a shard has no other). The MTP head is
    not among them: it is whole on rank 0, built by model/loader.py as one device's."""
    kind = comm.device.type
    i0, i1 = plan.inter
    share = Share(plan.n_heads, plan.n_kv, plan.n_k_heads, plan.n_v_heads, i1 - i0, plan.conv_dim, plan.vocab_shard)

    def row(k_total: int, out_features: int) -> RowParallelLinear:
        return RowParallelLinear(k_total, out_features, plan, comm)

    def embedding(vocab: int, hidden: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(plan.vocab_shard, hidden, plan.vocab[0], comm)

    def shares(cfg: ModelConfig) -> Share:
        return share

    return replace(target_for(kind, canonical=True), name=f"tp{plan.tp} rank {plan.rank}", column=ColumnParallelLinear,
                   row=row, share=shares, embedding=embedding)
