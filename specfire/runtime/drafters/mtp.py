"""The MTP drafter: the checkpoint's MTP head chained k times over the trunk's vocabulary."""
from __future__ import annotations

import torch

from ...layers.attention import fuses
from ...model.qwen35 import MtpHead
from ...params import MAX_SPEC_K, SamplingParams
from ..graphs import DraftGraphs, PackedChains, penalty_key
from ..rng import DeviceRng
from ..sampling import Penalties, probs, sample
from ..trunk import Trunk
from .base import NO_DRAFT
from .chain import already_picked, argmax, draft_chain, packed_chain_after, penalized_argmax

AHEAD = MAX_SPEC_K + 1      # positions the head's catch-up and chain write past the trunk's rows


class MtpDrafter:
    """The model's own MTP head, chained k times (`draft_chain`).

    Step 1 at position pos-1 takes the trunk's post-norm hidden there and the newest token; later
    steps feed the head its own output (`feed`: "post" = after mtp.norm, "pre" = before, the better
    measured: docs/PERFORMANCE.md) and its previous draft, one position further. Before step 1 it
    catches its KV cache up with the rows the trunk committed last cycle, in the same forward.
    Where the trunk replays CUDA graphs, the chain is replayed too, greedy or sampled.

    Everything it asks of the trunk is in the `Trunk` protocol: `embed` / `embed_weight` for the
    head's input, `lm_logits` for a step's scores (over the draft vocabulary when the trunk has
    one: a greedy pick is already a whole-vocabulary id, a sampled q is [N], zero past N), and for
    greedy picks `lm_scores`, or `draft_pick` with `draft_rounds` where the trunk makes them itself
    (`draft_sharded`: every rank of a mesh scores its vocabulary rows).

    Penalties (a greedy request with repetition / frequency / presence penalties): each greedy
    step picks the argmax of its logits penalised as the verify row it becomes will be
    (`penalized_argmax`), eagerly and in the captured chains. Not where the trunk makes the picks,
    and never for sampled drafts (their q must stay the distribution they were drawn from).
    """

    name = "mtp"
    penalty_aware = True          # greedy picks penalised as their verify rows (False: they ignore penalties)

    def __init__(self, head: MtpHead, trunk: Trunk, kv_dtype: torch.dtype, feed: str = "pre"):
        self.graphs: DraftGraphs | None = None     # set before `feed`, whose setter resets captured graphs
        self.head, self.trunk, self.feed = head, trunk, feed
        self.state = self._new_state(head, trunk, kv_dtype)
        self._hidden: list[torch.Tensor] = []      # trunk hidden rows not yet fed to the head
        self._tokens: list[torch.Tensor] = []      # the tokens following them, on the device
        self._pos0 = 0                             # position of the first pending row
        self._pre = None                           # ((k, pos, penalty key), drafts) queued by `prepare`
        self._want = None                          # (hidden, targets, n, pos, k): a chain `prepare` left pending
        self.ahead = True                          # `prepare` queues the next chain (off: after the read)
        # a queued chain of more drafts than asked serves a shorter cycle with its first k (off: it is
        # dropped, and the pending rows are caught up in prefill mode before a new chain)
        self.prefix = True
        self._graphs_trunk_picks = False           # the pick mode the captured greedy chains hold
        if trunk.graphs_enabled:
            self.graphs = DraftGraphs(self._chain_for, head.fc.weight.device)

    @staticmethod
    def _new_state(head: MtpHead, trunk: Trunk, kv_dtype: torch.dtype):
        """The head's KV: in the trunk's KV pool, over the trunk sequence's own block table, where
        the pool holds the head's layers after the trunk's (model/kvpool.py; a mesh: rank 0's pool
        and its shard of the slot); the trunk then grows MAX_SPEC_K + 1 positions past its rows,
        what the head's catch-up and chain reach past them (a mesh's ranks all do: parallel/worker.py
        agree_pool)."""
        pool = trunk.kv_pool
        st = trunk.kv_state
        n_trunk = sum(lc.rec is None for lc in st.layers) if st is not None else 0
        if pool is None or st is None or len(pool.k) != n_trunk + len(head.kv_heads()):
            return head.new_state(trunk.max_seq, kv_dtype)
        st.ahead = AHEAD
        return head.new_state(trunk.max_seq, kv_dtype, pool, n_trunk, st.table)

    @property
    def feed(self) -> str:
        return self._feed

    @feed.setter
    def feed(self, feed: str) -> None:
        """Changeable between requests (to measure both); captured draft graphs bake it in, so
        they are dropped and captured again."""
        if feed not in ("post", "pre"):
            raise ValueError(f"feed must be 'post' or 'pre', got {feed!r}")
        self._feed = feed
        if self.graphs is not None:
            self.graphs.clear()

    def _chain(self, toks, hidden, pos, k, choose=None, n=None, pen=None, sp=None) -> torch.Tensor:
        """draft_chain with this drafter's head; `choose` None: the greedy pick (the trunk's own
        where `draft_sharded`; the penalised argmax when `pen` and `sp` carry penalties; else the
        argmax, fused into the chain's launches where the trunk hands its embedding table)."""
        t = self.trunk
        lm = t.lm_logits
        if choose is None:
            if self._trunk_picks:
                lm, choose = t.draft_pick, already_picked
            elif penalty_key(pen, sp) is not None:
                choose = penalized_argmax(pen, sp)
            else:
                choose = argmax
                if fuses(self.head, hidden) and t.embed_weight is not None:
                    # the argmax of the unwidened logits: the same pick
                    return draft_chain(self.head, t.embed, t.lm_scores, self.state, toks, hidden, pos, k, self.feed,
                                       choose, n, t.embed_weight, fused_pick=True)
        return draft_chain(self.head, t.embed, lm, self.state, toks, hidden, pos, k, self.feed, choose, n,
                           t.embed_weight)

    def _chain_after(self, toks, hidden, pos, n, k, pen=None, sp=None) -> torch.Tensor:
        """The greedy chain from row n of a verify's k+1 rows (`prepare`)."""
        return self._chain(toks, hidden, pos, k, n=n, pen=pen, sp=sp)

    def _chain_for(self, toks, hidden, pos, k, sp: SamplingParams | None,
                   rng: DeviceRng | None, pen: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain greedy (sp None or greedy; penalised picks when `pen` is given and sp has
        penalties), or sampled from `rng` with the distributions kept (never penalised)."""
        if sp is None or sp.greedy:
            return self._chain(toks, hidden, pos, k, pen=pen, sp=sp), None
        qs: list[torch.Tensor] = []

        def choose(logits: torch.Tensor) -> torch.Tensor:
            q = probs(logits, sp)
            qs.append(q[0])
            return sample(q, rng)
        drafts = self._chain(toks, hidden, pos, k, choose)
        return drafts, torch.stack(qs)

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor) -> None:
        t = prompt.shape[0]
        if t > 1:  # rows 0..t-2: (h_p, x_{p+1})
            self._prefill(prompt[1:], hidden[:-1], 0)
        self._hidden, self._tokens, self._pos0 = [hidden[-1:]], [], t - 1
        self._pre = self._want = None

    @torch.inference_mode()
    def propose(self, last: int, pos: int, k: int, sp: SamplingParams, gen: DeviceRng | None,
                pen: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k <= 0:
            return NO_DRAFT, None
        self._check_mode()
        if not self.penalises(sp):
            pen = None
        pre, self._pre = self._pre, None
        if (pre is not None and (pre[0][0] == k or (self.prefix and pre[0][0] > k))
                and pre[0][1:] == (self._pos0, penalty_key(pen, sp)) and sp.greedy and len(self._hidden) == 1):
            # queued by `prepare` over exactly these pending rows (this position): the same chain; one
            # queued for more drafts (a shorter cycle at the KV room's end) gives its first k, those of a
            # k-draft chain (`prefix`: each step sees only the steps before it)
            self._hidden, self._tokens, self._pos0 = [], [], self._pos0 + self._hidden[0].shape[0]
            return (pre[1] if pre[0][0] == k else pre[1][:k]), None
        hidden = self._hidden[0] if len(self._hidden) == 1 else torch.cat(self._hidden)
        toks = self._tokens[0] if len(self._tokens) == 1 else torch.cat(self._tokens)
        pos0, m = self._pos0, hidden.shape[0]
        if m > k + 1:  # rows piled up while other routes ran: catch up all but the last in one prefill-mode
            # forward, so the draft graphs only ever see the pending-row counts an MTP cycle leaves (1..k+1)
            self._prefill(toks[:-1], hidden[:-1], pos0)
            pos0, hidden, toks = pos0 + m - 1, hidden[-1:], toks[-1:]
        self._hidden, self._tokens, self._pos0 = [], [], self._pos0 + m
        trunk_picks = sp.greedy and self._trunk_picks  # e.g. a mesh's other ranks run their side alongside
        if self.graphs is not None and (sp.greedy or gen is not None):
            if trunk_picks:
                fresh = not self.graphs.captured(toks.shape[0], k)
                self.trunk.draft_rounds(k, self.graphs.warmup if fresh else 0, 1)
            return self.graphs.draft(toks, hidden, pos0, k, None if sp.greedy else sp, gen,
                                     pen=pen, pen_sp=sp)
        if trunk_picks:
            self.trunk.draft_rounds(k, 1, 0)
        return self._chain_for(toks, hidden, pos0, k, sp, gen, pen)

    def _prefill(self, toks: torch.Tensor, hidden: torch.Tensor, pos0: int) -> None:
        """The head over rows in prefill mode: hidden [m, H] at positions pos0.., toks [m] the
        tokens after them. With the catch-up's fused kernels on (layers/attention.py fuses)
        and the trunk's embedding table at hand, the head gathers the rows itself (`fc_input`),
        else they are looked up here."""
        ew = self.trunk.embed_weight
        if ew is not None and fuses(self.head, hidden):
            self.head(None, hidden, pos0, self.state, rows=False, ids=toks, embed_weight=ew)
        else:
            self.head(self.trunk.embed(toks), hidden, pos0, self.state, rows=False)

    @torch.inference_mode()
    def prepare(self, hidden: torch.Tensor, targets: torch.Tensor, n: torch.Tensor, pos: int, k: int,
                pen: Penalties | None = None, sp: SamplingParams | None = None, defer: bool = False) -> bool:
        """Queue the next greedy chain (k drafts) right after a verify of k drafts at `pos`, before its
        result is read: over all k+1 rows (hidden, targets) from row n (the accepted count, still on
        the device). The next `propose` returns it when its pending rows are exactly this verify's
        and it asks for k drafts; otherwise it is dropped. Where the chain replays CUDA graphs, so
        the device drafts while the host reads the step and commits (no idle gap between them).
        `pen`, `sp`: the request's statistics (already counting this step's emitted tokens) and
        parameters: a penalised chain picks penalised, as `propose` would. `defer`: a plain greedy
        chain is left pending instead (True comes back), for `queue_many` to queue with the other
        requests' chains of a round in one packed chain."""
        self._pre = self._want = None
        if not self.ahead or self.graphs is None or k <= 0 or pos + 2 * k > self.trunk.max_seq:
            return False                           # (its steps reach pos + n + k - 1)
        self._check_mode()
        if sp is None or not self.penalises(sp):
            pen = None
        pkey = penalty_key(pen, sp)
        if defer and pkey is None and not self._trunk_picks:
            self._want = (hidden, targets, n, pos, k)
            return True
        if self._trunk_picks:
            fresh = not self.graphs.captured(k + 1, k, "after")
            self.trunk.draft_rounds(k, self.graphs.warmup if fresh else 0, 1, now=True)
        drafts = self.graphs.draft_after(self._chain_after, targets, hidden, pos, n.view(1), k,
                                         pen=pen if pkey is not None else None, pen_sp=sp)
        self._pre = ((k, pos, pkey), drafts)
        return False

    @torch.inference_mode()
    def queue_pending(self) -> None:
        """Queue the chain `prepare(defer=True)` left pending, alone (its own graph)."""
        hidden, targets, n, pos, k = self._want
        self._want = None
        self._pre = ((k, pos, None), self.graphs.draft_after(self._chain_after, targets, hidden, pos, n.view(1), k))

    @torch.inference_mode()
    def queue_many(self, drafters: list["MtpDrafter"]) -> None:
        """The chains a round's steps left pending: those of one head, k and feed as one packed chain
        (`packed_chain_after`: each weight read once for every request's step), a lone one alone.
        Greedy drafts change only what is accepted, never what is emitted. Replayed from the
        head's packed chain graphs (runtime/graphs.py PackedChains)."""
        groups: dict[tuple, list[MtpDrafter]] = {}
        for d in drafters:
            groups.setdefault((id(d.head), d._want[4], d.feed), []).append(d)
        for (_, k, feed), group in groups.items():
            if len(group) == 1:
                group[0].queue_pending()
                continue
            t, wants, g = group[0].trunk, [d._want for d in group], group[0].graphs
            head = group[0].head
            chains = PackedChains.for_head(head, g.pos.device, g.fns.emulate)
            drafts = chains.run(lambda *a: packed_chain_after(head, t.lm_scores, t.embed, t.embed_weight, *a),
                                [d.state for d in group], [w[1] for w in wants], [w[0] for w in wants],
                                [w[3] for w in wants], [w[2] for w in wants], k, feed)
            for i, (d, w) in enumerate(zip(group, wants)):
                d._want, d._pre = None, ((k, w[3], None), drafts[i])

    def _check_mode(self) -> None:
        """Captured greedy chains keep the picks they were captured with: a changed mode drops them."""
        if self.graphs is not None and self._trunk_picks != self._graphs_trunk_picks:
            self.graphs.clear()
            self._graphs_trunk_picks = self._trunk_picks

    def penalises(self, sp: SamplingParams) -> bool:
        """Greedy, penalised, and the picks are this drafter's (not the trunk's)."""
        return self.penalty_aware and sp.greedy and sp.penalized and not self._trunk_picks

    @property
    def _trunk_picks(self) -> bool:
        """The greedy picks are the trunk's own (`draft_pick`), not this drafter's."""
        return self.trunk.draft_sharded

    def commit(self, out: list[int], hidden: torch.Tensor, out_dev: torch.Tensor) -> None:
        # rows of the trunk at the step's positions, followed by the emitted tokens
        if hidden.shape[0]:
            self._hidden.append(hidden)
        self._tokens.append(out_dev)
