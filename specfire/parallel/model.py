"""The trunk of one rank: the single-device Qwen35Trunk with its projections swapped for their
sharded forms (tensor parallelism applied to an already-built model, module by module). The
forward is Qwen35Trunk.forward itself; only the embedding, the row-parallel projections (which
all-reduce) and the logits (which gather to rank 0) differ."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import FULL, ModelConfig
from ..model.qwen35 import DecoderLayer, Linear, Qwen35Trunk, SequenceState
from ..ops.linear import linear
from .comm import Comm
from .shard import ShardPlan


class RowParallelLinear(Linear):
    """Holds the input columns of this rank; the partial products are all-reduced."""

    def __init__(self, in_features: int, out_features: int, comm: Comm):
        super().__init__(in_features, out_features)
        self.comm = comm

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        return self.comm.all_reduce(linear(x, self.weight, rows))


class VocabParallelEmbedding(nn.Module):
    """Holds vocabulary rows [v0, v0 + shard); a token outside them contributes zeros, and the
    all-reduce adds the one rank that has it (exact: x + 0 = x)."""

    def __init__(self, shard: int, hidden: int, v0: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard, hidden), requires_grad=False)
        self.v0, self.comm = v0, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = self.weight[local.clamp(0, self.weight.shape[0] - 1)]            # [T, H]
        x = torch.where(mine[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        return self.comm.all_reduce(x)


class ShardedQwen35(Qwen35Trunk):
    """Build under torch.device('meta'), then fill with loader.load_module(..., fetch=plan.fetch)."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Comm):
        super().__init__(cfg)
        self.plan, self.comm = plan, comm
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(plan.vocab_shard, h, plan.vocab[0], comm)
        self.layers = nn.ModuleList(self._layer(kind) for kind in cfg.layer_types)
        if self.lm_head is not None:
            self.lm_head = Linear(h, plan.vocab_shard)

    def _layer(self, kind: str) -> DecoderLayer:
        cfg, p = self.cfg, self.plan
        h = cfg.hidden_size
        layer = DecoderLayer(cfg, kind, n_heads=p.n_heads, n_kv=p.n_kv,
                             n_k_heads=p.n_k_heads, n_v_heads=p.n_v_heads)
        if kind == FULL:
            layer.self_attn.o_proj = RowParallelLinear(p.n_heads * cfg.head_dim, h, self.comm)
        else:
            layer.linear_attn.out_proj = RowParallelLinear(layer.linear_attn.value_dim, h, self.comm)
        i0, i1 = p.inter
        layer.mlp.gate_proj = Linear(h, i1 - i0)
        layer.mlp.up_proj = Linear(h, i1 - i0)
        layer.mlp.down_proj = RowParallelLinear(i1 - i0, h, self.comm)
        return layer

    def new_state(self, max_seq: int, kv_dtype: torch.dtype) -> SequenceState:
        p = self.plan
        return SequenceState.allocate(self.cfg, self.cfg.layer_types, max_seq, self.embed_tokens.weight.device,
                                      kv_dtype, n_kv=p.n_kv, n_v_heads=p.n_v_heads, conv_dim=p.conv_dim)

    def logits(self, h: torch.Tensor, rows: bool) -> torch.Tensor:
        """h [T, H] -> float32 logits [T, V] on rank 0 (this rank's [T, V/tp] slice elsewhere)."""
        local = linear(h, self.lm_weight, rows).float()                      # [T, vocab_shard]
        full = self.comm.gather(local, dim=-1)                               # [T, tp * vocab_shard]
        return local if full is None else full[:, :self.cfg.vocab_size]
