"""The MTP draft chain's greedy pick, sharded by vocabulary over the mesh.

Why: the MTP head runs whole on rank 0, and each draft step scores the lm_head (27B shape:
248k x 5120 bf16, 2.5 GB, more than the head itself). Rank 0 alone reading the whole of it leaves
the other ranks idle; here every rank scores only its own vocabulary rows (the trunk's lm_head
shard) and the ranks agree on the argmax:

    h        rank 0's post-norm row, on every rank (a sum of it with zeros: exact)
    local    h @ shard^T with the whole matrix's launch settings (each logit has the whole's bits)
    (v, i)   each rank's largest logit and its first (global) index
    token    i of the first rank, in vocabulary order, whose v is the largest (NaN counts largest)

which is `argmax` over the whole vocabulary (the first index of the maximum, NaN first), so the
drafted token equals the one-device draft bit for bit and acceptance is alike on every degree.

A reduced draft vocabulary (the first N ids, `draft_vocab`): each rank scores only its rows below
N (a rank whose shard starts at or past N scores none and offers -inf); where N fits in rank 0's
shard the mesh trunk does not shard the picks at all (parallel/trunk.py: rank 0 scores rows 0..N-1
of its whole copy, no collective).

Rank 0 calls `shard_argmax(h)` inside its draft chain; the other ranks run `k` rounds of it with
h = None at the same time (`WorkerDraft`), so both sides run the same collectives in the same
order. On the GPU both sides replay CUDA graphs: the collectives use a symmetric-memory buffer
pair of their own (comm.Comm.draft_coll), so they never share a buffer with the rows forward.
"""
from __future__ import annotations

import os

import torch

from ..errors import MeshError
from ..kernels.gemv import linear_prefix


MODES = ("shard", "whole")


def draft_mode() -> str | None:
    """SPECFIRE_TP_DRAFT: "shard" (every rank scores its vocabulary rows), "whole" (rank 0 scores
    its whole copy), unset: shard where the mesh replays CUDA graphs, whole on the CPU (a gloo round
    trip costs more there than the whole small lm_head: docs/BENCHMARKS.md)."""
    v = os.environ.get("SPECFIRE_TP_DRAFT", "")
    if v and v not in MODES:
        raise ValueError(f"SPECFIRE_TP_DRAFT={v!r}: allowed values are {', '.join(MODES)} (or unset)")
    return v or None


def local_best(logits: torch.Tensor, v0: int) -> torch.Tensor:
    """logits [1, n] of vocabulary rows v0.. -> [2] float32: the largest and its first index + v0
    (no rows: -inf at v0, which never beats an earlier rank)."""
    if logits.shape[-1] == 0:
        out = torch.full((2,), float(v0), dtype=torch.float32, device=logits.device)
        out[0] = float("-inf")
        return out
    i = logits.argmax(-1)                                                     # [1]
    v = logits.gather(-1, i.view(1, 1)).view(1)
    return torch.cat([v.to(torch.float32), (i + v0).to(torch.float32)])


def pick(pairs: torch.Tensor) -> torch.Tensor:
    """pairs [world, 2] (each rank's best logit and its index, ranks in vocabulary order) -> the
    token [1] int64 that argmax over the concatenated logits gives."""
    v = pairs[:, 0]
    hit = (v == v.max()) | v.isnan()
    r = hit.to(torch.int32).argmax().view(1)                                  # the first such rank
    return pairs[:, 1].index_select(0, r).to(torch.int64)


def draft_end(model) -> int:
    """One past the last token id the draft scores: the draft vocabulary (the first N ids, loaded
    with draft_vocab=N: `model.draft_vocab`), else the whole vocabulary."""
    n = getattr(model, "draft_vocab", None)
    return model.cfg.vocab_size if n is None else n


def local_logits(model, x: torch.Tensor) -> torch.Tensor:
    """x [1, H] -> float32 logits [1, n] of this rank's lm_head rows inside the draft vocabulary
    (its real rows v0.. below `draft_end`: none past it are read; n may be 0), with the launch
    settings of the whole draft product, so each logit has one device's bits."""
    end = draft_end(model)
    n = max(0, min(model.plan.vocab_shard, end - model.plan.vocab[0]))
    if n == 0:
        return torch.empty(1, 0, dtype=torch.float32, device=x.device)
    return linear_prefix(x, model.lm_weight, n, True, end, exact=True).float()   # each logit as in the whole


def shard_argmax(model, coll, h: torch.Tensor | None) -> torch.Tensor:
    """The greedy token [1] of rank 0's post-norm row h [1, H] (None on the other ranks) over the
    draft vocabulary (the whole by default), on every rank. `model`: this rank's ShardedQwen35;
    `coll`: the collectives."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    if h is None:
        x = torch.zeros(1, cfg.hidden_size, dtype=torch.float32, device=model.embed_tokens.weight.device)
    else:
        x = h.reshape(1, cfg.hidden_size).to(torch.float32)
    x = coll.sum(x).to(dtype)                                                 # rank 0's row everywhere
    return pick(coll.all_gather(local_best(local_logits(model, x), model.plan.vocab[0])))


def shard_pick(model, coll, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`shard_argmax` for a row h [1, H] every rank already holds (the sharded MTP head's output,
    parallel/mtp.py): no collective to share it, and the all-gather of the (value, index) pairs
    carries each rank's candidate embedding row too, so every rank gets (token [1], its embedding
    [1, H]) from one collective."""
    cfg = model.cfg
    emb = model.embed_tokens.weight
    v0 = model.plan.vocab[0]
    best = local_best(local_logits(model, h.reshape(1, cfg.hidden_size).to(emb.dtype)), v0)    # [2]
    i = (best[1:] - v0).to(torch.int64).clamp(0, emb.shape[0] - 1)
    pairs = coll.all_gather(torch.cat([best, emb.index_select(0, i).view(-1).to(torch.float32)]))
    v = pairs[:, 0]
    r = ((v == v.max()) | v.isnan()).to(torch.int32).argmax().view(1)        # the first such rank
    won = pairs.index_select(0, r)                                            # [1, 2 + H]
    return won[:, 1].to(torch.int64), won[:, 2:].to(emb.dtype)


def coll_bytes(hidden: int, tp: int, rows: int) -> int:
    """The draft collectives' buffer: a sharded MTP chain's input packet (2 x rows x hidden + 2),
    its trees (rows x hidden) and picks (tp x (hidden + 2)), float32."""
    return 4 * max(2 * rows * hidden + 2, tp * (hidden + 2))


class WorkerDraft:
    """A rank other than 0: its side of rank 0's sharded draft chain, k picks per chain, run
    eagerly or replayed from one CUDA graph per k (captured after an eager run compiled it)."""

    def __init__(self, model, coll):
        self.model, self.coll = model, coll
        self.mesh = getattr(model, "mtp_mesh", None)      # this rank's MTP head shard (parallel/mtp.py)
        self.graphs: dict = {}
        self.pool = None

    def _rounds(self, k: int, chain: tuple | None) -> None:
        if chain is not None:                           # (m, sampled, feed): the sharded head's chain
            m, sampled, feed = chain
            self.mesh.chain(k, feed, m, sampled=sampled)
            return
        for _ in range(k):
            shard_argmax(self.model, self.coll, None)

    @torch.inference_mode()
    def run(self, k, eager: int = 0, replays: int = 0, *chain) -> None:
        """`eager` chains run eagerly, then `replays` replays of the k-pick graph (rank 0 runs as
        many: its chain eagerly, or its capture's warm-ups and replays). `chain` (m, sampled, feed):
        the sharded MTP head's whole chain over m pending rows, not only its picks. k == PREFILL:
        the head's prefill-mode call over `eager` rows at position `replays`."""
        from .mtp import PREFILL

        if k == PREFILL:
            if self.mesh is None:
                raise MeshError("rank 0 runs the sharded MTP head, but this rank has no shard of it")
            self.mesh.prefill(None, None, eager, replays)
            return
        chain = tuple(chain) or None
        if chain is not None and self.mesh is None:
            raise MeshError("rank 0 runs the sharded MTP head, but this rank has no shard of it")
        key = (k, chain)
        for _ in range(eager):
            self._rounds(k, chain)
        if replays <= 0:
            return
        if not torch.cuda.is_available() or self.model.embed_tokens.weight.device.type != "cuda":
            for _ in range(replays):            # rank 0 emulates its graphs (CPU tests): run them eagerly
                self._rounds(k, chain)
            return
        g = self.graphs.get(key)
        if g is None:
            if eager == 0:
                raise MeshError(f"rank 0 replays a sharded draft chain of {k} picks this rank never ran")
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._rounds(k, chain)
            self.graphs[key] = g
        for _ in range(replays):
            g.replay()
