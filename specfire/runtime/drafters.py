"""Drafters: propose k tokens (and, when sampling, the distribution each was drawn from).

Interface: `begin(prompt, hidden)` at the start of a sequence (the prompt's tokens and trunk
hidden rows); `commit(out, hidden, out_dev)` after every step, whichever route ran it: the tokens
emitted (host list and the same on the device) and the trunk's hidden rows of the step's inputs
(none for the first token, which comes from the prefill); `propose(last, pos, k, sp, gen)` where
`last` is the newest token (at position `pos`, not yet seen by the trunk). A drafter sees every
token once, through `begin` and `commit`, so the route may change between steps.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..config import SamplingParams
from ..layers.attention import fuses
from ..model.qwen35 import MtpHead, SequenceState
from ..kernels import head as head_fused
from .rng import DeviceRng
from .sampling import Penalties, penalize_draft, probs, sample
from .trunk import Trunk


class Drafter(Protocol):
    name: str

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor) -> None: ...
    def propose(self, last: int, pos: int, k: int, sp: SamplingParams,
                gen: DeviceRng | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def commit(self, out: list[int], hidden: torch.Tensor, out_dev: torch.Tensor) -> None: ...


NO_DRAFT = torch.empty(0, dtype=torch.long)


def draft_chain(head: MtpHead, embed: Callable[[torch.Tensor], torch.Tensor],
                lm_logits: Callable[[torch.Tensor], torch.Tensor], state: SequenceState, toks: torch.Tensor,
                hidden: torch.Tensor, pos: int | torch.Tensor, k: int, feed: str,
                choose: Callable[[torch.Tensor], torch.Tensor], n: torch.Tensor | None = None,
                embed_weight: torch.Tensor | None = None, fused_pick: bool = False) -> torch.Tensor:
    """The MTP draft chain, written once: run eagerly, and captured into a CUDA graph (greedy)
    by runtime/graphs.py. Catch-up over the pending rows (hidden [m, H] at positions pos.., toks
    [m] the tokens after them), then k steps of `choose(logits [1, V]) -> [1]` each feeding the
    head its own output (`feed`) and its own draft. `pos` is an int, or a one-element device
    tensor under capture. `n` (device, [1]): chain from row n, not the last (the rows after it
    are a verify's rejected ones: their KV entries lie past row n and are rewritten before any
    step reads them, as a rejected draft's are). `embed_weight`: the table `embed` looks up, where
    the head may gather from it itself (one device: MtpHead's fused rows step, kernels/head).
    `fused_pick` (greedy argmax picks only, `choose` unused): each pick, its write into the drafts
    and the next position in one launch, and row n with its position in one
    (kernels/head pick / select): the same drafts in fewer launches.
    Returns the drafts [k], int64, on the device: no host read."""
    def run(tk: torch.Tensor, hid: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor]:
        if embed_weight is not None:
            return head(None, hid, p, state, rows=True, ids=tk, embed_weight=embed_weight)
        return head(embed(tk), hid, p, state, rows=True)

    pre, post = run(toks, hidden, pos)
    if n is None:
        h_pre, h_post = pre[-1:], post[-1:]
        p = pos + (toks.shape[0] - 1)                                         # position of the last row
    elif fused_pick:
        h_pre, h_post, p = head_fused.select(pre, post, n, pos)
    else:
        h_pre, h_post = pre.index_select(0, n), post.index_select(0, n)
        p = pos + n
    if fused_pick:
        out = torch.empty(k, dtype=torch.long, device=h_post.device)
        for step in range(k):
            last = step + 1 == k
            tok, p = head_fused.pick(lm_logits(h_post), out, step, None if last else p)
            if last:
                break
            fed = h_post if feed == "post" else h_pre
            h_pre, h_post = run(tok, fed, p)
        return out
    drafts = []
    for step in range(k):
        tok = choose(lm_logits(h_post))                                       # [1]
        drafts.append(tok)
        if step + 1 == k:
            break
        p = p + 1
        fed = h_post if feed == "post" else h_pre
        h_pre, h_post = run(tok, fed, p)
    return torch.cat(drafts)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def _picked(tok: torch.Tensor) -> torch.Tensor:
    return tok


def penalized_argmax(pen: Penalties, sp: SamplingParams) -> Callable[[torch.Tensor], torch.Tensor]:
    """A greedy chain's pick that applies the request's penalties: step j takes the argmax of
    its logits penalised with the request's counts plus drafts 0..j-1 (`penalize_draft`), the
    counts the verify's row j uses. A fresh closure per chain (it keeps the chain's picks)."""
    picked: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> torch.Tensor:
        tok = penalize_draft(logits, pen, sp, picked).argmax(-1)
        picked.append(tok)
        return tok
    return choose


def penalty_key(pen: Penalties | None, sp: SamplingParams | None) -> tuple | None:
    """What a captured penalty-aware greedy chain bakes in: the penalty values and the device
    statistics it reads (fixed buffers, updated in place); None for a chain without penalties."""
    if pen is None or sp is None or not sp.penalized:
        return None
    return (float(sp.repetition_penalty), float(sp.frequency_penalty), float(sp.presence_penalty),
            pen.counts.data_ptr(), pen.prompt.data_ptr())


class MtpDrafter:
    """The model's own MTP head, chained k times (`draft_chain`).

    Step 1 at position pos-1 takes the trunk's post-norm hidden there and the newest token; later
    steps feed the head its own output (`feed`: "post" = after mtp.norm, "pre" = before) and its
    previous draft, one position further. Before step 1 it catches its KV cache up with the rows
    the trunk committed last cycle (their true hidden states and tokens), in the same forward.
    Where the trunk replays CUDA graphs, the chain is replayed too, greedy or sampled (one graph
    per sampling configuration; the random stream is device-side, runtime/rng.py).

    Each step is scored by `trunk.lm_logits`: over the trunk's draft vocabulary when it was loaded
    with one (`draft_vocab=N`: token ids 0..N-1, so a greedy pick is already a whole-vocabulary id
    and a sampled step's q is [N], zero past N for the accept), else over the whole vocabulary.

    The default feed is "pre", the better of the two measured (bench/spec_cpu.py and
    bench/bundled_accept.py, greedy, mean_accept_len at k = 2/3/4): on a head fitted for one step
    (tests/specfit.py) pre 2.149/2.255/2.269 vs post 2.131/2.161/2.168; on the first-wave bundled
    model (its head trained chained with the post feed) pre 2.461/3.006/3.303 vs post
    2.449/3.000/3.303. Not re-measured on the model shipped now.

    Penalties (`propose(..., pen=)`, a greedy request with repetition / frequency / presence
    penalties): each greedy step picks the argmax of its logits penalised as the verify row it
    becomes will be (`penalized_argmax`), eagerly and in the captured chains (keyed by the penalty
    values and the statistics' buffers, which the graph reads in place). Not on a mesh or with
    sharded picks (there the picks stay unpenalised), and never for sampled drafts: their q must
    stay the distribution they were drawn from. Drafts only change what is accepted, never what
    is emitted.
    """

    name = "mtp"
    penalty_aware = True                           # `launch` passes a penalised request's statistics

    def __init__(self, head: MtpHead, trunk: Trunk, kv_dtype: torch.dtype, feed: str = "pre",
                 mesh_head: bool = True):
        self.graphs = None  # set before `feed`, whose setter resets captured graphs
        # a mesh whose ranks hold shards of the head runs the chain on every rank (parallel/mtp.py)
        self.mesh = getattr(trunk, "mtp_mesh", None) if mesh_head else None
        self.given_head = head                     # whole, on rank 0 of a mesh (bench: the chain before sharding)
        if self.mesh is not None:
            head = self.mesh.head
        self.head, self.trunk, self.feed = head, trunk, feed
        self.state = self.mesh.state if self.mesh is not None else head.new_state(trunk.max_seq, kv_dtype)
        self._hidden: list[torch.Tensor] = []      # trunk hidden rows not yet fed to the head
        self._tokens: list[torch.Tensor] = []      # the tokens following them, on the device
        self._pos0 = 0                             # position of the first pending row
        self._pre = None                           # ((k, pos), drafts) queued by `prepare`
        self.ahead = True                          # `prepare` queues the next chain (off: after the read)
        # a queued chain of more drafts than asked serves a shorter cycle with its first k (off: it is
        # dropped, and the pending rows are caught up in prefill mode before a new chain)
        self.prefix = True
        self._graphs_sharded = False               # the pick mode the captured greedy chains hold
        if trunk.graphs_enabled:
            from .graphs import DraftGraphs
            self.graphs = DraftGraphs(self._chain_for, head.fc.weight.device)

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
        """draft_chain with this drafter's head; `choose` None: the greedy pick, scored by every
        rank's vocabulary rows on a mesh (parallel/draft.py, argmax's token), else argmax, or the
        penalised argmax when `pen` and `sp` carry penalties (single device, unsharded picks)."""
        if self.mesh is not None:
            return self.mesh.chain(k, self.feed, toks.shape[0], self.trunk.embed(toks), hidden, pos, n, choose,
                                   self.trunk.embed, self.trunk.lm_logits)
        lm = self.trunk.lm_logits
        if choose is None:
            if self._sharded:
                lm, choose = self.trunk.shard_argmax, _picked
            elif penalty_key(pen, sp) is not None:
                choose = penalized_argmax(pen, sp)
            else:
                choose = argmax
                if fuses(self.head, hidden) and hasattr(self.trunk, "lm_scores"):
                    lm = self.trunk.lm_scores      # the argmax of the unwidened logits: the same pick
                    return draft_chain(self.head, self.trunk.embed, lm, self.state, toks, hidden, pos, k, self.feed,
                                       choose, n, getattr(self.trunk, "embed_weight", None),
                                       fused_pick=True)
        return draft_chain(self.head, self.trunk.embed, lm, self.state, toks, hidden, pos, k, self.feed, choose, n,
                           getattr(self.trunk, "embed_weight", None))

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
        self._pre = None

    @torch.inference_mode()
    def propose(self, last: int, pos: int, k: int, sp: SamplingParams,
                gen: DeviceRng | None, pen: Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`pen`: the request's penalty statistics (greedy requests with penalties pick penalised)."""
        if k <= 0:
            return NO_DRAFT, None
        self._check_mode()
        if not sp.greedy or self._sharded or self.mesh is not None:
            pen = None                             # sampled drafts, a mesh's and sharded picks stay unpenalised
        pre, self._pre = self._pre, None
        if (pre is not None and (pre[0][0] == k or (self.prefix and pre[0][0] > k))
                and pre[0][1:] == (self._pos0, penalty_key(pen, sp)) and sp.greedy and len(self._hidden) == 1):
            # queued by `prepare` over exactly these pending rows (this position): the same chain; one
            # queued for more drafts (a request's last, shorter cycle) gives its first k, those of a
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
        if self.mesh is not None:                  # every rank runs the chain: tell them first
            return self._mesh_propose(toks, hidden, pos0, k, sp, gen)
        sharded = sp.greedy and self._sharded      # the other ranks run their side of the chain alongside
        if self.graphs is not None and (sp.greedy or gen is not None):
            if sharded:
                fresh = not self.graphs.captured(toks.shape[0], k)
                self.trunk.draft_rounds(k, self.graphs.warmup if fresh else 0, 1)
            return self.graphs.draft(toks, hidden, pos0, k, None if sp.greedy else sp, gen,
                                     pen=pen, pen_sp=sp)
        if sharded:
            self.trunk.draft_rounds(k, 1, 0)
        return self._chain_for(toks, hidden, pos0, k, sp, gen, pen)

    def _prefill(self, toks: torch.Tensor, hidden: torch.Tensor, pos0: int) -> None:
        """The head over rows in prefill mode (on every rank of a mesh holding its shards): hidden
        [m, H] at positions pos0.., toks [m] the tokens after them. One device with the catch-up's
        fused kernels on (layers/attention.py fuses): the head gathers the embedding rows
        itself (`fc_input`), else they are looked up here."""
        if self.mesh is None:
            ew = getattr(self.trunk, "embed_weight", None)
            if isinstance(ew, torch.Tensor) and fuses(self.head, hidden):
                self.head(None, hidden, pos0, self.state, rows=False, ids=toks, embed_weight=ew)
            else:
                self.head(self.trunk.embed(toks), hidden, pos0, self.state, rows=False)
            return
        from ..parallel.mtp import PREFILL
        emb = self.trunk.embed(toks)
        self.trunk.draft_rounds(PREFILL, emb.shape[0], pos0, now=True)
        self.mesh.prefill(emb, hidden, emb.shape[0], pos0)

    def _mesh_propose(self, toks, hidden, pos0, k, sp, gen):
        chain = (toks.shape[0], not sp.greedy, self.feed)
        if self.graphs is not None and (sp.greedy or gen is not None):
            if sp.greedy:
                fresh = not self.graphs.captured(toks.shape[0], k)
            else:
                from .sampling import sampling_key
                fresh = (toks.shape[0], k, sampling_key(sp), gen.state.data_ptr()) not in self.graphs.graphs
            self.trunk.draft_rounds(k, self.graphs.warmup if fresh else 0, 1, chain=chain)
            return self.graphs.draft(toks, hidden, pos0, k, None if sp.greedy else sp, gen)
        self.trunk.draft_rounds(k, 1, 0, chain=chain)
        return self._chain_for(toks, hidden, pos0, k, sp, gen)

    @torch.inference_mode()
    def prepare(self, hidden: torch.Tensor, targets: torch.Tensor, n: torch.Tensor, pos: int, k: int,
                pen: Penalties | None = None, sp: SamplingParams | None = None) -> None:
        """Queue the next greedy chain (k drafts) right after a verify of k drafts at `pos`, before its
        result is read: over all k+1 rows (hidden, targets) from row n (the accepted count, still on
        the device). The next `propose` returns it when its pending rows are exactly this verify's
        and it asks for k drafts; otherwise it is dropped. Where the chain replays CUDA graphs, so
        the device drafts while the host reads the step and commits (no idle gap between them).
        `pen`, `sp`: a penalised greedy request's statistics (already counting this step's emitted
        tokens, queued before) and parameters: the chain picks penalised, as `propose` would."""
        self._pre = None
        if not self.ahead or self.graphs is None or k <= 0 or pos + 2 * k > self.trunk.max_seq:   # its steps reach pos + n + k - 1
            return
        self._check_mode()
        if self.mesh is not None or self._sharded:
            fresh = not self.graphs.captured(k + 1, k, "after")
            chain = (k + 1, False, self.feed) if self.mesh is not None else ()
            self.trunk.draft_rounds(k, self.graphs.warmup if fresh else 0, 1, now=True, chain=chain)
        if self.mesh is not None or self._sharded:
            pen = None
        pkey = penalty_key(pen, sp)
        drafts = self.graphs.draft_after(self._chain_after, targets, hidden, pos, n.view(1), k,
                                         pen=pen if pkey is not None else None, pen_sp=sp)
        self._pre = ((k, pos, pkey), drafts)

    def _check_mode(self) -> None:
        """Captured greedy chains keep the picks they were captured with: a changed mode drops them."""
        if self.graphs is not None and self.mesh is None and self._sharded != self._graphs_sharded:
            self.graphs.clear()
            self._graphs_sharded = self._sharded

    def penalises(self, sp: SamplingParams) -> bool:
        """Whether this drafter picks a request's drafts penalised (greedy, single device, unsharded)."""
        return self.penalty_aware and sp.greedy and sp.penalized and self.mesh is None and not self._sharded

    @property
    def _sharded(self) -> bool:
        """The greedy chain's picks are scored by every rank of a mesh (parallel/draft.py)."""
        return bool(getattr(self.trunk, "draft_sharded", False))

    def commit(self, out: list[int], hidden: torch.Tensor, out_dev: torch.Tensor) -> None:
        # rows of the trunk at the step's positions, followed by the emitted tokens
        if hidden.shape[0]:
            self._hidden.append(hidden)
        self._tokens.append(out_dev)


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram
    (n from n_max down to n_min) and propose the tokens that followed it. No model.

    An index per n maps each n-gram to the start of its latest occurrence that has a follower; it
    is updated as tokens arrive (O(n_max) per token), so a proposal costs O(n_max) dict lookups
    whatever the context length, instead of a scan of the whole context."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4):
        for nm, v in (("n_min", n_min), ("n_max", n_max)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"ngram {nm} must be an integer, got {v!r}")
        if not (1 <= n_min <= n_max):
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def begin(self, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.tokens = []
        self._index = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self._extend(prompt.tolist())

    def _extend(self, toks: list[int]) -> None:
        ctx = self.tokens
        for t in toks:
            ctx.append(t)
            end = len(ctx) - 1                      # the n-grams ending just before `t` now have a follower
            for n, idx in self._index.items():
                if end >= n:
                    idx[tuple(ctx[end - n:end])] = end - n

    def propose(self, last: int, pos: int, k: int, sp: SamplingParams,
                gen: DeviceRng | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k <= 0:
            return NO_DRAFT, None
        ctx = self.tokens
        L = len(ctx)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            i = self._index[n].get(tuple(ctx[L - n:]))
            if i is not None:
                return torch.tensor(ctx[i + n:i + n + k], dtype=torch.long), None
        return NO_DRAFT, None

    def commit(self, out: list[int], hidden: torch.Tensor | None, out_dev: torch.Tensor | None = None) -> None:
        self._extend(out)
