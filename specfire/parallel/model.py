"""The trunk of one rank: the single-device Qwen35Trunk with its projections swapped for their
sharded forms (tensor parallelism applied to an already-built model, module by module). The
forward is Qwen35Trunk.forward itself; only the embedding, the row-parallel projections (this
rank's canonical chunks of K, kernels/splitk, then the cross-rank tree) and the logits (gathered
to rank 0) differ. Column shards carry the whole matrix's N (`launch_n`) for the CUDA kernel."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import FULL, ModelConfig
from ..errors import ConfigError
from ..model.qwen35 import DecoderLayer, Linear, Qwen35Trunk, SequenceState
from ..kernels.gemv import linear
from ..kernels.splitk import KSplit
from .comm import Comm
from .shard import ShardPlan
from .symm import IDS_EXACT


def row_parallel(k_total: int, out_features: int, plan: ShardPlan, comm: Comm) -> Linear:
    """This rank's input columns of a row-parallel projection: its canonical chunks of the
    k_total-wide reduction, their subtree summed here, the ranks' subtrees by comm.tree_all_reduce."""
    split = KSplit.for_rank(k_total, plan.rank, plan.tp)
    lin = Linear(split.k_local, out_features, row_parallel=True)
    lin.ksplit, lin.combine, lin.reserve = split, comm.tree_all_reduce, comm.tree_buffer
    return lin


def column_parallel(in_features: int, out_shard: int, out_total: int) -> Linear:
    lin = Linear(in_features, out_shard)
    lin.launch_n = out_total
    return lin


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


class ShardedQwen35(Qwen35Trunk):
    """Build under torch.device('meta'), then fill with loader.load_module(..., fetch=plan.fetch)."""

    canonical = True     # every rank's CPU elementwise math padded as tp = 1's canonical mode
    draft_vocab: int | None = None   # the MTP draft's picks score token ids 0..N-1 only (parallel/draft.py)

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Comm):
        if cfg.vocab_size > IDS_EXACT:
            raise ConfigError(f"vocab_size {cfg.vocab_size} exceeds {IDS_EXACT}, the token ids a tensor-parallel "
                              f"step can carry exactly")
        super().__init__(cfg)
        self.plan, self.comm = plan, comm
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(plan.vocab_shard, h, plan.vocab[0], comm)
        self.layers = nn.ModuleList(self._layer(kind) for kind in cfg.layer_types)
        if self.lm_head is not None:
            self.lm_head = column_parallel(h, plan.vocab_shard, cfg.vocab_size)

    def _layer(self, kind: str) -> DecoderLayer:
        cfg, p = self.cfg, self.plan
        h = cfg.hidden_size
        layer = DecoderLayer(cfg, kind, n_heads=p.n_heads, n_kv=p.n_kv,
                             n_k_heads=p.n_k_heads, n_v_heads=p.n_v_heads)
        d = cfg.head_dim
        if kind == FULL:
            a = layer.self_attn
            a.o_proj = row_parallel(cfg.num_attention_heads * d, h, p, self.comm)
            a.q_proj.launch_n = 2 * cfg.num_attention_heads * d
            a.k_proj.launch_n = a.v_proj.launch_n = cfg.num_key_value_heads * d
        else:
            g = layer.linear_attn
            g.out_proj = row_parallel(cfg.linear_num_value_heads * cfg.linear_value_head_dim, h, p, self.comm)
            g.in_proj_qkv.launch_n = cfg.conv_dim
            g.in_proj_z.launch_n = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            g.in_proj_a.launch_n = g.in_proj_b.launch_n = cfg.linear_num_value_heads
        i0, i1 = p.inter
        layer.mlp.gate_proj = column_parallel(h, i1 - i0, cfg.intermediate_size)
        layer.mlp.up_proj = column_parallel(h, i1 - i0, cfg.intermediate_size)
        layer.mlp.down_proj = row_parallel(cfg.intermediate_size, h, p, self.comm)
        return layer

    def new_state(self, max_seq: int, kv_dtype: torch.dtype) -> SequenceState:
        p = self.plan
        return SequenceState.allocate(self.cfg, self.cfg.layer_types, max_seq, self.embed_tokens.weight.device,
                                      kv_dtype, n_kv=p.n_kv, n_v_heads=p.n_v_heads, conv_dim=p.conv_dim)

    def logits(self, h: torch.Tensor, rows: bool) -> torch.Tensor:
        """h [T, H] -> float32 logits [T, V] on rank 0 (this rank's [T, V/tp] slice elsewhere)."""
        local = linear(h, self.lm_weight, rows, self.cfg.vocab_size).float()   # [T, vocab_shard]
        full = self.comm.gather(local, dim=-1)                               # [T, tp * vocab_shard]
        return local if full is None else full[:, :self.cfg.vocab_size]
