"""The trunk of one rank: Qwen35Trunk built from the rank's layers (parallel/layers.py: its shards
of every projection and of the embedding). The forward is Qwen35Trunk.forward itself; only the
logits differ (gathered to rank 0)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from ..kernels.gemv import linear
from ..model.qwen35 import Qwen35Trunk
from .comm import Comm
from .layers import mesh_target
from .shard import ShardPlan
from .symm import IDS_EXACT


class ShardedQwen35(Qwen35Trunk):
    """Build under torch.device('meta'), then fill with loader.load_module(..., fetch=plan.fetch)."""

    draft_vocab: int | None = None   # the MTP draft's picks score token ids 0..N-1 only (parallel/draft.py)

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Comm):
        if cfg.vocab_size > IDS_EXACT:
            raise ConfigError(f"vocab_size {cfg.vocab_size} exceeds {IDS_EXACT}, the token ids a tensor-parallel "
                              f"step can carry exactly")
        super().__init__(cfg, mesh_target(plan, comm))
        self.plan, self.comm = plan, comm

    def logits(self, h: torch.Tensor, rows: bool) -> torch.Tensor:
        """h [T, H] -> float32 logits [T, V] on rank 0 (this rank's [T, V/tp] slice elsewhere)."""
        local = linear(h, self.lm_weight, rows, self.cfg.vocab_size, exact=True).float()   # [T, vocab_shard]
        full = self.comm.gather(local, dim=-1)                               # [T, tp * vocab_shard]
        return local if full is None else full[:, :self.cfg.vocab_size]
