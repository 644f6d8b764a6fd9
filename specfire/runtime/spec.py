"""The one speculative step and its accept rules, shared by every drafter and every topology.

    draft  = drafter.propose(last, pos, k)          # k tokens (+ their distributions if sampling)
    rows   = trunk.verify([last] + draft, pos)      # k+1 logits and hidden rows, one forward
    n, out = accept(rows.logits, draft, q, ...)     # greedy prefix match or rejection sampling
    trunk.commit(n)                                 # recurrent state := state after row n
    drafter.commit(out, hidden[:n+1], out_dev)      # drafters catch up

Plain AR decoding is this step with no drafter (k = 0): one row, n = 0, out = [the target's pick].
The step is split in two so the engine can keep the device busy: `launch` queues the device work
and puts (n, tokens) in a row of the round's batched host read (runtime/reads.py: one copy and
one wait a scheduler round for every request's step; a greedy drafting step, its next draft chain
queued behind it, keeps its own copy); `Launched.finish` reads its result, then commits. Every accept runs on the device: greedy prefix
match, or rejection sampling over all positions at once drawing from a device-side random stream
(runtime/rng.py), replayed from a CUDA graph per (k, sampling params) where the trunk uses graphs.
The ids fed to verify live in static buffers (`StepBuffers`): no tensor is built from host data
per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..kernels.small import greedy_accept
from ..params import MAX_SPEC_K, SamplingParams
from .drafters import NO_DRAFT, Drafter
from .reads import RoundReads, Ticket
from .rng import DeviceRng
from .sampling import Penalties, penalize, probs, sample, sampling_key, token_logprobs
from .trunk import Rows, Trunk, Verify

if TYPE_CHECKING:
    from .constraint import Constraint


def accept_device(logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, sp: SamplingParams,
                  rng: DeviceRng | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling on the device, fixed shapes and no host read (graph-capturable).
    logits [k+1, V] of the verify rows; draft [k] int64; q [k, V] the drafter's distributions
    (None for a deterministic proposal such as n-gram), or [k, N] for N < V when the drafter drew
    from token ids 0..N-1 only (a reduced draft vocabulary: q is 0 past N). Draft i is kept with probability
    min(1, p_i(d) / q_i(d)); at the first rejection the token comes from max(0, p_i - q_i) (p_i
    without d when q is None), after k acceptances from p_k. Draws k uniforms and one row of V
    whatever happens, so the random stream advances alike every step. Returns (n accepted, 0-d
    int64; targets [k+1] whose first n + 1 entries are the emitted tokens)."""
    k = draft.shape[0]
    p = probs(logits, sp)                                              # [k+1, V]
    if k == 0:
        return torch.zeros((), dtype=torch.long, device=logits.device), sample(p[:1], rng)
    rows = torch.arange(k, device=logits.device)
    pd = p[rows, draft].double()
    qd = torch.ones_like(pd) if q is None else q[rows, draft].double()
    u = rng.uniform((k,)) if rng is not None else torch.rand(k, dtype=torch.float64, device=logits.device)
    ok = (qd > 0) & (u * qd < pd)
    n = ok.to(torch.long).cumprod(0).sum()
    if q is None:
        resid = p[:k].clone().scatter_(1, draft.view(k, 1), 0.0)        # (a scalar fill: graph-capturable)
    elif q.shape[-1] < p.shape[-1]:                                    # q = 0 past its width
        resid = p[:k].clone()
        resid[:, :q.shape[-1]] = (resid[:, :q.shape[-1]] - q).clamp_min(0.0)
    else:
        resid = (p[:k] - q).clamp_min(0.0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p[:k])
    dist = torch.cat([resid, p[k:k + 1]]).index_select(0, n.view(1))  # [1, V]: the row after n accepts
    tok = sample(dist, rng)                                            # [1]
    return n, torch.cat([draft, tok]).scatter(0, n.view(1), tok)


def accept(logits: torch.Tensor, draft: torch.Tensor | Sequence[int], q: torch.Tensor | None, sp: SamplingParams,
           rng: DeviceRng | None) -> tuple[int, list[int]]:
    """`accept_device`, read back: (n accepted, emitted tokens = n drafts + one from the target)."""
    d = torch.as_tensor(draft, dtype=torch.long).to(logits.device)
    n, targets = accept_device(logits, d, q, sp, rng)
    got = torch.cat([n.view(1), targets]).tolist()
    return got[0], got[1:got[0] + 2]


def accept_greedy(logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, list[int]]:
    """The greedy rule on the device, read back: n = the leading drafts equal to their row's
    argmax; emitted = targets[0..n]."""
    targets, n = greedy_accept(logits, draft)
    got = torch.cat([n.view(1), targets]).tolist()
    return got[0], got[1:got[0] + 2]


class StepBuffers:
    """Static buffers reused by every step of every request: the verify ids on the device, pinned
    staging for host-made drafts, the steps' batched host reads (`reads`, shared by a model's
    slots) and pinned slots for a step's logprobs, the random stream of a sampled request and its
    accept graphs."""

    SLOTS = 3      # the engine has at most two steps in flight

    def __init__(self, device: torch.device, kmax: int = MAX_SPEC_K, graphs: bool = False, emulate: bool = False,
                 reads: RoundReads | None = None):
        self.device = device
        self.reads = reads if reads is not None else RoundReads(device, kmax + 2)   # the steps' host reads
        self.rng = DeviceRng(device)            # the sampled request's random stream (seeded per request)
        self.graphs = None                      # sampled accept, one CUDA graph per (k, sampling params)
        if graphs or emulate:
            from .graphs import FnGraphs
            self.graphs = FnGraphs(device, emulate=emulate)
        self.pinned = device.type == "cuda"
        self.ids = torch.zeros(kmax + 1, dtype=torch.long, device=device)
        if self.pinned:
            self.stage = torch.zeros(2, kmax + 2, dtype=torch.long, pin_memory=True)
            self.slots = [torch.zeros(kmax + 2, dtype=torch.long, pin_memory=True) for _ in range(self.SLOTS)]
        self._slot = 0
        self.fslots: list[torch.Tensor] | None = None   # pinned slots for the logprobs (made on first use)
        self.pen: Penalties | None = None       # token statistics of a penalised request (made on first use)

    def penalties(self, vocab: int, prompt: torch.Tensor, ends: list[int] | tuple[int, ...] = ()) -> Penalties:
        """The token statistics, reset for a new request with this prompt (and these ending ids)."""
        if self.pen is None or self.pen.counts.shape[0] != vocab:
            self.pen = Penalties(vocab, self.device)
        return self.pen.begin(prompt, ends)

    def accept(self, logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, sp: SamplingParams,
               rng: DeviceRng | None, graph: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`accept_device`, replayed from a graph when this engine captures them (and `graph`)."""
        if self.graphs is None or rng is None or not graph:
            return accept_device(logits, draft, q, sp, rng)
        key = ("accept", draft.shape[0], None if q is None else q.shape[-1], sampling_key(sp), rng.state.data_ptr())
        ins = (logits, draft) if q is None else (logits, draft, q)
        return self.graphs.run(key, lambda lg, d, *qq: accept_device(lg, d, qq[0] if qq else None, sp, rng), ins,
                               keep=(rng.state,))

    def upload(self, dst: torch.Tensor, src: torch.Tensor | list[int], row: int) -> None:
        """dst (device) := src (host), through pinned row `row` of the staging buffer."""
        if not self.pinned:
            dst.copy_(torch.as_tensor(src, dtype=torch.long))
            return
        st = self.stage[row, :dst.shape[0]]
        st.copy_(torch.as_tensor(src, dtype=torch.long))
        dst.copy_(st, non_blocking=True)

    def send(self, n: torch.Tensor, targets: torch.Tensor, floats: torch.Tensor | None = None, alone: bool = False
             ) -> tuple[Ticket | torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]:
        """Queue the copy of (n, targets...) (and of `floats` [rows, cols] float32, the logprobs) to
        the host; returns (where each lands, the one event to wait on). Without floats the row joins
        the round's batched read (`reads`: a Ticket, no event of its own) unless `alone`: a step
        that queues more work behind its copy (the next draft chain), whose read must not wait for
        the work the round's other steps queue after theirs."""
        if floats is None and not alone:
            return self.reads.put(n, targets), None, None
        packed = torch.cat([n.view(1), targets])
        if not self.pinned:
            return packed, floats, None
        slot = self.slots[self._slot][:packed.shape[0]]
        if floats is not None:
            if self.fslots is None or self.fslots[0].shape[1] < floats.shape[1]:   # (a slot in flight keeps its memory)
                self.fslots = [torch.zeros(self.ids.shape[0], floats.shape[1], pin_memory=True) for _ in range(self.SLOTS)]
            fslot = self.fslots[self._slot][:floats.shape[0], :floats.shape[1]]
            fslot.copy_(floats, non_blocking=True)
            floats = fslot
        self._slot = (self._slot + 1) % self.SLOTS
        slot.copy_(packed, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return slot, floats, ev


@dataclass
class Launched:
    """A step whose device work is queued. `finish` performs its one host read and commits."""

    route: str
    k: int                               # drafts verified
    pos: int
    hidden: torch.Tensor                 # trunk hidden rows [k+1, H]
    targets: torch.Tensor                # [k+1] on the device: the tokens the step may emit
    result: "Ticket | torch.Tensor | None" = None   # (n, targets...): its row of the round's read, or its host copy
    event: torch.cuda.Event | None = None
    got: tuple[int, list[int]] | None = None   # set at launch when the accept already read
    decision: Any = None                 # what the route controller asked for (the engine's note)
    lp: torch.Tensor | None = None       # host copy of the rows' logprobs (`token_logprobs`), when asked
    pending: Any = None                  # the drafter whose next chain `complete(defer=True)` left pending

    def read(self) -> tuple[int, list[int]]:
        if self.got is None:
            if isinstance(self.result, Ticket):
                v = self.result.read()
            else:
                if self.event is not None:
                    self.event.synchronize()
                v = self.result.tolist()
            self.got = (v[0], v[1:v[0] + 2])
        return self.got

    def logprobs(self) -> list[list[float]] | None:
        """The emitted tokens' logprob rows (read with the step, after `read`), or None."""
        if self.lp is None:
            return None
        return self.lp[:self.read()[0] + 1].tolist()


@dataclass
class Prepared:
    """A step drafted and staged, waiting for its verify forward (`verify`), which a scheduler may
    run together with other requests' (runtime/trunk.py verify_many); `complete` takes its rows."""

    trunk: Trunk
    drafter: Drafter | None
    route: str
    pos: int
    ids: torch.Tensor                    # [k+1] verify ids in the step buffers
    draft: torch.Tensor
    q: torch.Tensor | None
    sp: SamplingParams
    gen: DeviceRng | None
    bufs: StepBuffers
    pen: Penalties | None
    con: Constraint | None

    @property
    def verify(self) -> Verify:
        return Verify(self.trunk, self.ids, self.pos, self.route)


def launch(trunk: Trunk, drafter: Drafter | None, route: str, last: int, last_dev: torch.Tensor, pos: int, k: int,
           sp: SamplingParams, gen: DeviceRng | None, bufs: StepBuffers, pen: Penalties | None = None,
           con: Constraint | None = None) -> Launched:
    """Queue one draft -> verify -> accept. `last` (host) and `last_dev` ([1], device) are the
    newest token, at `pos`. An AR step (no drafter or k = 0) also commits here: n = 0.

    `pen` (a request with penalties or min_tokens): the verify rows are penalised and masked
    (`sampling.penalize`, row i with the counts of the output so far plus drafts 0..i-1, and the
    ends masked while its position is before min_tokens) before either accept rule, and the
    emitted tokens are counted on the device afterwards. The drafter gets the statistics too
    (`propose`, `prepare`); one that `penalises(sp)` picks a greedy request's drafts penalised the
    same way, the others ignore them (drafts only change what is accepted, never what is emitted).
    The sampled accept then runs eagerly, not from its CUDA graph (the route reason says so).

    `con` (a request with structured outputs): after the penalties, row i keeps only the tokens the
    grammar allows after drafts 0..i-1 (runtime/constraint.py; the drafts are read to the host for
    it). With `sp.logprobs`, every row's `token_logprobs` goes to the host with (n, tokens)."""
    p = prepare(trunk, drafter, route, last, last_dev, pos, k, sp, gen, bufs, pen, con)
    return complete(p, p.verify.run())


def prepare(trunk: Trunk, drafter: Drafter | None, route: str, last: int, last_dev: torch.Tensor, pos: int, k: int,
            sp: SamplingParams, gen: DeviceRng | None, bufs: StepBuffers, pen: Penalties | None = None,
            con: Constraint | None = None) -> Prepared:
    """`launch` up to its verify: the draft and the verify ids staged."""
    if drafter is None or k <= 0:
        draft, q = NO_DRAFT, None
    else:
        draft, q = drafter.propose(last, pos, k, sp, gen, pen)
    kk = draft.shape[0]
    ids = bufs.ids[:kk + 1]
    ids[:1].copy_(last_dev)
    if kk:
        if draft.device == ids.device:
            ids[1:].copy_(draft)
        else:
            bufs.upload(ids[1:], draft, 0)
    return Prepared(trunk, drafter, route, pos, ids, draft, q, sp, gen, bufs, pen, con)


def complete(p: Prepared, rows: Rows, defer: bool = False) -> Launched:
    """`launch` from its verify's rows on: the AR commit, penalties, mask, accept, the host copy.
    `defer`: the drafter's next chain, queued here where it can be, may be left pending
    (`Launched.pending`) for the caller to queue, with other requests' (`queue_chains`)."""
    trunk, drafter, route, pos, ids, draft, q = p.trunk, p.drafter, p.route, p.pos, p.ids, p.draft, p.q
    sp, gen, bufs, pen, con = p.sp, p.gen, p.bufs, p.pen, p.con
    kk = draft.shape[0]
    if kk == 0:
        trunk.commit(0)
    logits = rows.logits
    with torch.inference_mode():
        if pen is not None:
            logits = penalize(logits, pen, sp, ids[1:])
        if con is not None:
            logits = con.mask(logits, draft)
    if sp.greedy:
        if pen is None and con is None and rows.greedy is not None:
            targets, n = rows.greedy              # the packed verify's accept of these raw rows
        else:
            targets, n = greedy_accept(logits, ids[1:])
        if pen is not None:
            pen.add(targets, n)
        with torch.inference_mode():
            lp = token_logprobs(logits, targets, sp) if sp.logprobs is not None else None
        res, lp, ev = bufs.send(n, targets, lp, alone=kk > 0)
        # e.g. the next MTP chain drafts while the host reads this step (or waits to join the round's)
        left = drafter if kk and drafter.prepare(rows.hidden, targets, n, pos, kk, pen=pen, sp=sp, defer=defer) else None
        return Launched(route, kk, pos, rows.hidden, targets, res, ev, lp=lp, pending=left)
    with torch.inference_mode():
        n, targets = bufs.accept(logits, ids[1:], q, sp, gen, graph=pen is None)
        if pen is not None:
            pen.add(targets, n)
        lp = token_logprobs(logits, targets, sp) if sp.logprobs is not None else None
    res, lp, ev = bufs.send(n, targets, lp)
    return Launched(route, kk, pos, rows.hidden, targets, res, ev, lp=lp)


@dataclass
class Chains:
    """A step's pending draft chain (`complete(defer=True)`): a scheduler queues a round's together
    (`queue_chains`), a lone step's runs at once; then the step goes on to its host read."""

    drafter: Any

    def run(self) -> None:
        self.drafter.queue_pending()


def queue_chains(items: list[Chains]) -> None:
    """Queue every pending chain: those of one head together (MtpDrafter.queue_many)."""
    by_name: dict[str, list] = {}
    for c in items:
        by_name.setdefault(c.drafter.name, []).append(c.drafter)
    for drafters in by_name.values():
        drafters[0].queue_many(drafters)


def finish(step: Launched, trunk: Trunk, drafters: Sequence[Drafter]) -> tuple[int, list[int]]:
    """Read the step's result (the one host read), commit the trunk and feed the drafters."""
    n, out = step.read()
    if step.k:
        trunk.commit(n)
    for d in drafters:
        d.commit(out, step.hidden[:n + 1], step.targets[:n + 1])
    return n, out


OnCycle = Callable[[int, int, list[int]], None]


@dataclass
class DraftCounts:
    """Drafts over cycles: how many were verified and accepted, in all and per draft position."""

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, k: int, n: int) -> None:
        self.cycles += 1
        self.drafted += k
        self.accepted += n
        while len(self.drafted_per_pos) < k:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(k):
            self.drafted_per_pos[i] += 1
            if i < n:
                self.accepted_per_pos[i] += 1

    @property
    def mean_accept_len(self) -> float:
        return 1.0 + self.accepted / self.cycles if self.cycles else 0.0

    @property
    def accept_per_pos(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]


@dataclass
class SpecStats(DraftCounts):
    """Counts over a request's speculative cycles (all drafting routes together) and, per route,
    the steps it ran, the tokens they emitted and its own drafts (`per_route`). `on_cycle(k, n,
    emitted)`, when set, is called after every step (k = 0 for an AR step), so callers can watch
    cycles without patching."""

    on_cycle: OnCycle | None = None
    by_route: dict[str, tuple[list[int], DraftCounts]] = field(default_factory=dict)   # [steps, tokens], drafts

    def record(self, k: int, n: int, out: list[int], route: str = "ar", emitted: int | None = None) -> None:
        """One step's counts; `emitted`: how many of `out` the output keeps (a last cycle's surplus
        past max_tokens is accepted but never emitted, so it is no route's tokens)."""
        if self.on_cycle is not None:
            self.on_cycle(k, n, out)
        steps, drafts = self.by_route.setdefault(route, ([0, 0], DraftCounts()))
        steps[0] += 1
        steps[1] += len(out) if emitted is None else emitted
        if k == 0:
            return
        self.add(k, n)
        drafts.add(k, n)

    def per_route(self) -> dict[str, dict]:
        """{route: {steps, tokens, cycles, drafted, accepted, mean_accept_len, accept_per_pos}} in
        the order the routes first ran; `cycles` counts the steps that verified drafts."""
        return {r: {"steps": steps, "tokens": tokens, "cycles": d.cycles, "drafted": d.drafted,
                    "accepted": d.accepted, "mean_accept_len": d.mean_accept_len, "accept_per_pos": d.accept_per_pos}
                for r, ([steps, tokens], d) in self.by_route.items()}
