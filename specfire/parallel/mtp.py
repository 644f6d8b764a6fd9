"""The MTP head split over the mesh like a trunk layer, and the draft chain every rank runs.

Why: whole on rank 0, the head's decoder layer (27B shape: ~0.85 GB a call, three calls in a k=3
chain) ran while the other ranks waited. Here each rank holds the head's layer sharded as the
trunk's full-attention layers are (query heads with their KV heads, MLP rows; o_proj and
down_proj the canonical float32 chunk tree of kernels/splitk, added across ranks in the same tree),
so the head computes on every degree the bits one device computes in the canonical mode. fc and
the norms are replicated (every rank computes them whole: the same bits everywhere).

A chain (`MeshHead.chain`) runs on every rank at once, rank 0 with the inputs, the others with
none: one collective gives every rank rank 0's embeddings, hidden rows, position and starting
row (float32 sums with zeros: exact); the head's two trees per call go through the draft
collectives (comm.Comm.draft_coll, buffers of their own); each greedy pick is the vocabulary-sharded
argmax of parallel/draft.py, whose all-gather also carries the winner's embedding row, so the next
head call needs no collective for its input. A sampled pick is rank 0's (its whole lm_head), the
drawn token's embedding row shared to the others. Prefill-mode calls (a request's prompt rows,
rows piled up while other routes ran) run eagerly on every rank, the rows broadcast first.
"""
from __future__ import annotations

import os

import torch

from ..config import ModelConfig
from ..model.qwen35 import MtpHead
from .draft import shard_pick

MODES = ("shard", "whole")
PREFILL = "mtp_prefill"


def head_mode() -> str | None:
    """SPECFIRE_TP_MTP: "shard" (the head's layer split over the ranks), "whole" (whole on rank 0,
    the default). Opt-in: on 2 H200s the sharded chain's device time was 10% shorter but the k=3
    cycle did not change (docs/BENCHMARKS.md, "Sixth wave: the MTP head sharded")."""
    v = os.environ.get("SPECFIRE_TP_MTP", "")
    if v and v not in MODES:
        raise ValueError(f"SPECFIRE_TP_MTP={v!r}: allowed values are {', '.join(MODES)} (or unset)")
    return v or None


def wanted(device_type: str, graphs: bool | None) -> bool:
    """Whether the ranks load the head sharded (decided by rank 0 before any process starts)."""
    return head_mode() == "shard"


class MeshHead:
    """One rank's head shard, its sequence state and the chain every rank runs."""

    def __init__(self, head: MtpHead, model, max_seq: int, kv_dtype: torch.dtype):
        self.head, self.model = head, model              # model: this rank's ShardedQwen35
        self.comm, self.coll = model.comm, model.comm.draft_coll
        self.state = head.new_state(max_seq, kv_dtype)
        self.dtype = head.fc.weight.dtype if isinstance(head.fc.weight, torch.Tensor) else model.embed_tokens.weight.dtype
        self.in_chain = False                            # the trees go through the draft collectives
        layer = head.layers[0]
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.combine, lin.reserve = self._combine, self._reserve

    def _combine(self, x: torch.Tensor) -> torch.Tensor:
        return self.coll.tree(x) if self.in_chain else self.comm.tree_all_reduce(x)

    def _reserve(self, m: int, n: int):
        return self.coll.reserve(torch.float32, (m, n)) if self.in_chain else None

    @property
    def device(self) -> torch.device:
        return self.state.layers[0].k.device

    # ---- prefill-mode calls (eager) -------------------------------------------------------------
    def prefill(self, emb: torch.Tensor | None, hidden: torch.Tensor | None, t: int, pos0: int) -> None:
        """The head over t rows in prefill mode on every rank: rank 0 passes (emb, hidden) [t, H],
        the others None (rank 0 has told them: `PREFILL` with t and pos0); the rows are broadcast."""
        h = self.head.cfg.hidden_size
        if emb is None:
            emb = torch.empty(t, h, dtype=self.dtype, device=self.device)
            hidden = torch.empty(t, h, dtype=self.dtype, device=self.device)
        emb = self.comm.broadcast(emb.to(self.dtype).contiguous())
        hidden = self.comm.broadcast(hidden.to(self.dtype).contiguous())
        self.head(emb, hidden, pos0, self.state, rows=False)

    # ---- the chain (rows mode; captured into CUDA graphs) ---------------------------------------
    def chain(self, k: int, feed: str, m: int, emb=None, hidden=None, pos=None, n=None, choose=None,
              embed=None, lm_logits=None, sampled: bool = False) -> torch.Tensor:
        """Drafts [k] (int64, device) from m pending rows. Rank 0: emb, hidden [m, H], pos (int or [1]
        tensor), n ([1] device row to chain from, None: the last), `choose` for a sampled pick (its
        whole `lm_logits` and `embed`; None: greedy). Other ranks: no inputs, `sampled` as rank 0's."""
        cfg = self.head.cfg
        h, dev = cfg.hidden_size, self.device
        self.in_chain = True
        try:
            if emb is not None:
                p = pos.view(1).to(torch.float32) if isinstance(pos, torch.Tensor) else \
                    torch.full((1,), float(pos), dtype=torch.float32, device=dev)
                r = n.view(1).to(torch.float32) if n is not None else torch.full((1,), float(m - 1), device=dev)
                pkt = torch.cat([emb.reshape(-1).float(), hidden.reshape(-1).float(), p, r])
            else:
                pkt = torch.zeros(2 * m * h + 2, dtype=torch.float32, device=dev)
            pkt = self.coll.sum(pkt)                      # rank 0's inputs on every rank (x + 0 = x)
            e = pkt[:m * h].view(m, h).to(self.dtype)
            x = pkt[m * h:2 * m * h].view(m, h).to(self.dtype)
            pos_d = pkt[2 * m * h:2 * m * h + 1].to(torch.int64)
            row = pkt[2 * m * h + 1:].to(torch.int64)
            pre, post = self.head(e, x, pos_d, self.state, rows=True)
            h_pre, h_post = pre.index_select(0, row), post.index_select(0, row)
            p = pos_d + row
            drafts = []
            for step in range(k):
                if choose is None and not sampled:
                    tok, e = shard_pick(self.model, self.coll, h_post)
                else:
                    tok, e = self._shared_pick(h_post, choose, embed, lm_logits)
                drafts.append(tok)
                if step + 1 == k:
                    break
                p = p + 1
                h_pre, h_post = self.head(e, h_post if feed == "post" else h_pre, p, self.state, rows=True)
            if k % 2 == 0:     # 3k + 1 collectives: keep the count even, so each chain starts on buffer 0
                self.coll.sum(torch.zeros(1, dtype=torch.float32, device=dev))
            if any(d is None for d in drafts):       # a sampled chain's tokens live on rank 0 only
                return torch.zeros(k, dtype=torch.int64, device=dev)
            return torch.cat(drafts)
        finally:
            self.in_chain = False

    def _shared_pick(self, h_post, choose, embed, lm_logits):
        """Rank 0 draws from its whole logits; every rank gets the drawn token's embedding row."""
        h = self.head.cfg.hidden_size
        if choose is not None:
            tok = choose(lm_logits(h_post))                                     # [1]
            e = embed(tok).reshape(1, h).float()
        else:
            tok, e = None, torch.zeros(1, h, dtype=torch.float32, device=self.device)
        return tok, self.coll.sum(e).to(self.dtype)


def load_head(src, path: str, cfg: ModelConfig, plan, model, dtype: torch.dtype, device: torch.device,
              max_seq: int, kv_dtype: torch.dtype, mtp_path: str | None = None) -> MeshHead | None:
    """This rank's shard of the MTP head (None without one), read through the plan's fetch."""
    from ..model import loader

    msrc = loader.mtp_source(path, src, mtp_path)
    if msrc is None or model.comm.draft_coll is None:
        return None
    with torch.device("meta"):
        head = MtpHead(cfg, model.target)          # this rank's layers: its shard of the decoder layer
    loader.load_module(head, msrc, "mtp.", dtype=dtype, device=device, fetch=plan.fetch,
                       what=f"MTP head shard {plan.rank}/{plan.tp}")
    return MeshHead(head, model, max_seq, kv_dtype)
