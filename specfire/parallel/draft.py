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

import torch

from ..errors import MeshError
from ..kernels.gemv import linear_prefix


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
    n = model.draft_vocab
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


def coll_bytes(hidden: int, tp: int) -> int:
    """The draft collectives' buffer: a pick's shared row (hidden) and its gathered (value, index)
    pairs (tp x 2), float32."""
    return 4 * max(hidden, 2 * tp)


class WorkerDraft:
    """A rank other than 0: its side of rank 0's sharded draft chain, k picks per chain, run
    eagerly or replayed from one CUDA graph per k (captured after an eager run compiled it)."""

    def __init__(self, model, coll):
        self.model, self.coll = model, coll
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _rounds(self, k: int) -> None:
        for _ in range(k):
            shard_argmax(self.model, self.coll, None)

    @torch.inference_mode()
    def run(self, k: int, eager: int = 0, replays: int = 0) -> None:
        """`eager` chains run eagerly, then `replays` replays of the k-pick graph (rank 0 runs as
        many: its chain eagerly, or its capture's warm-ups and replays)."""
        for _ in range(eager):
            self._rounds(k)
        if replays <= 0:
            return
        if not torch.cuda.is_available() or self.model.embed_tokens.weight.device.type != "cuda":
            for _ in range(replays):            # rank 0 emulates its graphs (CPU tests): run them eagerly
                self._rounds(k)
            return
        g = self.graphs.get(k)
        if g is None:
            if eager == 0:
                raise MeshError(f"rank 0 replays a sharded draft chain of {k} picks this rank never ran")
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._rounds(k)
            self.graphs[k] = g
        for _ in range(replays):
            g.replay()
