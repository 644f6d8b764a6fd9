"""The generation loop: prefill, then the shared speculative step until the output is done."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

import torch

from ..errors import SpecfireError
from ..params import SamplingParams, SpecPolicy
from ..tokenizer import Tokenizer
from .constraint import Constraint
from .drafters import BY_NAME, KINDS, Drafter, MtpDrafter, drafting_routes
from .output import OutputBuilder, TokenLogprobs
from .prefix import Fork, PrefixCache, restore
from .prompts import check_prompt_ids
from .reads import RoundReads
from .route import Acceptance, Controller, CostTable, Decision, RoundView, RouteController, RoutePlan, select_route
from .sampling import penalize, pick, token_logprobs
from .spec import Chains, Launched, OnCycle, SpecStats, StepBuffers, complete, finish, prepare
from .trunk import Rows, Trunk, Verify

if TYPE_CHECKING:
    from ..grammar import GrammarCompiler


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                       # "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None                 # per token of token_ids (sp.logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # per prompt token, None for the first


@dataclass
class StreamChunk:
    """One streamed piece: new text and the token ids behind it (and their logprobs when asked);
    `result` is set on the last chunk."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None    # on the first chunk (sp.prompt_logprobs)


@dataclass
class Shared:
    """What the engines of one model's slots share (runtime/slots.py): the cycle times `auto`
    measures (one device, one model: a slot's costs are any slot's), the acceptance earlier
    requests saw, and the prefix cache (a snapshot restores into any slot's state)."""

    costs: CostTable = field(default_factory=CostTable)
    accept_prior: dict[str, Acceptance] = field(default_factory=dict)
    prefix: PrefixCache | None = None       # multi-turn prefix reuse (single device; off by default)
    round: RoundView = field(default_factory=RoundView)   # the scheduler's last shared round (auto prices drafts by it)
    reads: RoundReads | None = None         # the steps' host reads, one batch a round (made by the first engine)


class Engine:
    """Token ids in, token ids (and text) out, over one trunk and optional drafters: one request at
    a time (a slot). Engines over one model share `shared`."""

    def __init__(self, trunk: Trunk, tokenizer: Tokenizer | None, eos_ids: set[int],
                 drafters: dict[str, Drafter], topology: str = "single", shared: Shared | None = None):
        self.trunk = trunk
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.topology = topology                # a label in route reasons; every topology serves every drafter
        self.drafters = drafters                # route name -> drafter (drafters/registry.py)
        self.shared = shared if shared is not None else Shared()
        if self.shared.reads is None:
            self.shared.reads = RoundReads(trunk.device)
        self.bufs = StepBuffers(trunk.device, graphs=trunk.graphs_enabled, reads=self.shared.reads)   # reused by every request
        self.fork: Callable[[], Engine] | None = None   # another slot's engine (set by runtime/build.py)
        # queue an AR step before reading the one before it (a GPU: the device runs it while the host
        # reads; a CPU runs each launch at once, so it gains nothing there)
        self.queue_ahead = self.bufs.pinned

    @property
    def costs(self) -> CostTable:
        """Measured cycle times on this model, for `auto`."""
        return self.shared.costs

    @property
    def accept_prior(self) -> dict[str, Acceptance]:
        """Acceptance seen by earlier requests."""
        return self.shared.accept_prior

    @property
    def prefix(self) -> PrefixCache | None:
        return self.shared.prefix

    @prefix.setter
    def prefix(self, cache: PrefixCache | None) -> None:
        self.shared.prefix = cache

    @property
    def mtp_loaded(self) -> bool:
        return MtpDrafter.name in self.drafters

    @property
    def max_seq(self) -> int:
        """Prompt plus generated tokens must fit in this many positions."""
        return self.trunk.max_seq

    def route(self, policy: SpecPolicy, sp: SamplingParams) -> RoutePlan:
        """The route a request takes and why; raises SpecfireError for a mode it cannot serve."""
        route, reason = select_route(policy, self.drafters, sp, self.topology)
        n = self.trunk.draft_vocab
        for kind in KINDS:
            if n is not None and kind.draft_vocab and kind.name in self.drafters and route in (kind.name, "auto"):
                reason += (f"; {kind.short} drafts from token ids 0..{n - 1} of {self.trunk.cfg.vocab_size} "
                           f"(draft_vocab={n})")
        if sp.penalized:
            reason += f"; {self.penalty_note(sp, route)}"
        if sp.min_tokens:
            reason += f"; min_tokens={sp.min_tokens}: the stop tokens are masked on every row before it"
            if not sp.greedy and not sp.penalized and self.bufs.graphs is not None:
                reason += " (the sampled accept runs eagerly until then)"
        g = sp.structured_outputs
        if g is not None:
            self.grammars.check(g)             # a grammar llguidance refuses: GrammarError naming its field
            rows = "the first token and every step" if route == "ar" else "the first token and every verify row"
            if g.after is not None:
                rows = rows.replace("the first token", f"the first token after {g.after}")
            elif g.think:
                rows = rows.replace("the first token", "the first token after an optional think block")
            reason += f"; {g.kind} grammar ({g.param}) masks {rows}"
            if route != "ar":
                reason += "; a drafting step is read (its drafts too) before the next is queued"
            if route in ("ar", "auto") and self.queue_ahead:
                reason += ("; an AR step's forward is queued before the step before it is read, its mask "
                           "built while that forward runs")
        return RoutePlan(route, reason, policy, sp)

    @cached_property
    def grammars(self) -> "GrammarCompiler":
        """llguidance's view of this model's vocabulary (built on first use, shared by requests)."""
        from ..grammar import GrammarCompiler

        if self.tokenizer is None:
            raise SpecfireError("structured outputs need the model's tokenizer (tokenizer.json)")
        vocab = self.trunk.cfg.vocab_size
        return GrammarCompiler(self.tokenizer, {t for t in self.eos_ids if t < vocab}, vocab)

    def constraint(self, sp: SamplingParams) -> Constraint | None:
        """The request's grammar, compiled into a fresh matcher (None: unconstrained)."""
        g = sp.structured_outputs
        if g is None:
            return None
        after = None
        if g.after is not None:
            after = self.grammars.tokenizer.tok.token_to_id(g.after)
            if after is None:
                raise SpecfireError(f"'{g.param}': the grammar starts after {g.after!r}, which is not one token of this "
                                    f"model's vocabulary")
        return Constraint(self.grammars.matcher(g), g, self.trunk.cfg.vocab_size, self.trunk.device, after)

    def penalty_note(self, sp: SamplingParams, route: str = "auto") -> str:
        """How a penalised request on `route` is served (the route reason and the `penalties` stat
        say it); the drafts are spoken of only where a route drafts."""
        if route == "ar":
            return f"penalties {sp.penalty_text()} on every step"
        note = f"penalties {sp.penalty_text()} on every verify row"
        for r, d in self.drafters.items():
            if r in BY_NAME and route in (r, "auto"):
                short = BY_NAME[r].short
                note += f"; {short} drafts are picked penalised too" if d.penalises(sp) else f"; {short} drafts are not penalised"
        if not sp.greedy and self.bufs.graphs is not None:
            note += "; the sampled accept runs eagerly, not from its CUDA graph"
        return note

    def controller(self, route: str, policy: SpecPolicy, sp: SamplingParams) -> RouteController:
        """`auto`: measured choices among AR and the loaded drafters; otherwise the route as asked.
        A seeded sampled request gets a fixed route (the registry's seeded drafter when loaded, else
        AR): which route draws the random numbers changes the samples, and a seed must reproduce
        its output."""
        if route == "auto" and not sp.greedy and sp.seed is not None:
            route = next((k.name for k in KINDS if k.seeded and k.name in self.drafters), "ar")
        if route == "auto":
            return RouteController(policy.k, drafting_routes(self.drafters), self.costs, prior=self.accept_prior,
                                   round=self.shared.round)
        fixed = (route, 0 if route == "ar" else policy.k)
        return RouteController(policy.k, () if route == "ar" else (route,), self.costs, fixed=fixed)

    def check_prompt(self, ids: list[int]) -> None:
        check_prompt_ids(ids, self.trunk.cfg.vocab_size, self.trunk.max_seq)

    def check_sampling(self, sp: SamplingParams) -> None:
        """Refuse what SamplingParams cannot check alone: stop token ids outside the vocabulary."""
        vocab = self.trunk.cfg.vocab_size
        for i, t in enumerate(sp.stop_token_ids):
            if t >= vocab:
                raise ValueError(f"stop_token_ids[{i}] is {t}, outside the vocabulary [0, {vocab})")

    def stream(self, ids: list[int], sp: SamplingParams, policy: SpecPolicy, on_cycle: OnCycle | None = None,
               drafter: Drafter | None = None, controller: Controller | None = None,
               plan: RoutePlan | None = None, ends: tuple[int, ...] = ()) -> Iterator[StreamChunk]:
        """Generate from `ids` (`steps` without its pauses). LLM runs requests through its scheduler;
        a direct call uses this engine's slot and must not overlap a scheduled request on it."""
        steps = self.steps(ids, sp, policy, on_cycle, drafter, controller, plan, ends=ends)
        try:
            got = None
            while True:
                try:
                    ev = steps.send(got)
                except StopIteration:
                    return
                got = None
                if isinstance(ev, Verify):
                    self.shared.round.alone()       # this engine's verify runs alone
                    got = ev.run()
                elif isinstance(ev, Chains):
                    ev.run()
                elif isinstance(ev, StreamChunk):
                    yield ev
        finally:
            steps.close()

    def steps(self, ids: list[int], sp: SamplingParams, policy: SpecPolicy, on_cycle: OnCycle | None = None,
              drafter: Drafter | None = None, controller: Controller | None = None,
              plan: RoutePlan | None = None, fork: Fork | None = None, ends: tuple[int, ...] = ()
              ) -> Generator[StreamChunk | Verify | Chains | None, Rows | None, None]:
        """Generate from `ids`, yielding a chunk after every step, None between the prefill's
        forwards (a scheduler runs other requests' steps at every yield) and, where a step needs
        its verify forward, a `Verify`, to be sent back its rows (the scheduler runs every running
        request's verify in one packed forward: runtime/trunk.py verify_many), and where a step's
        drafter left its next chain pending, a `Chains` (the scheduler queues the round's chains
        together, spec.queue_chains; sent back None). `on_cycle(k, n, emitted)` is called after every step; `drafter`,
        when given, serves the request instead of the routed one (tests script drafts with it);
        `controller` (the `Controller` protocol), when given, replaces the route's;
        `plan`: the route already decided for this policy and these params (`route`), else decided here.
        `fork`: the prompt's prefill shared with other requests of the same prompt (prefix.Fork).
        `ends`: a chat prompt's turn ends (tokenizer.ChatIds), where its prefill ends forwards too,
        with the prefix cache on or off (the same forwards, the same bits; runtime/prefix.py).

        The device stays busy: the next step is queued before the host turns this step's tokens
        into text, and an AR step is queued before the one before it is read (its input token
        is already on the device). Queued work a finished output does not need is dropped."""
        self.check_prompt(ids)
        self.check_sampling(sp)
        drafters = dict(self.drafters)
        if drafter is not None:
            drafters = {drafter.name: drafter}
            route, reason = drafter.name, f"drafter {drafter.name!r} given by the caller (k={policy.k})"
        else:
            if plan is None:
                plan = self.route(policy, sp)
            plan.check(policy, sp)
            route, reason = plan.route, plan.reason
        ctl = controller or self.controller(route, policy, sp)
        fed = [drafters[r] for r in ctl.candidates if r in drafters]   # drafters that see every token
        trunk, bufs, dev = self.trunk, self.bufs, self.trunk.device
        gen = None if sp.greedy else bufs.rng.seed(sp.seed)   # device-side stream: graphs replay fresh draws
        max_new = min(sp.max_tokens, trunk.max_seq - len(ids))
        out = OutputBuilder(sp, self.eos_ids, self.tokenizer, max_new)
        stats = SpecStats(on_cycle=on_cycle)
        by_route: dict[str, int] = {}
        log: list[dict[str, Any]] = []

        def start(d: Decision, last: int, last_dev: torch.Tensor, pos: int, room: int,
                  before: Callable[[], bool] | None = None):
            """Stage, verify and complete a step; `before` runs between its verify and the rest
            (False: the step is not wanted, None comes back)."""
            k = max(0, min(d.k, room - 1, trunk.max_seq - pos - 1))
            # past min_tokens (the host's count is a lower bound) only penalties need the statistics
            p = pen if sp.penalized or len(out.token_ids) < sp.min_tokens else None
            staged = prepare(trunk, drafters.get(d.route), d.route, last, last_dev, pos, k, sp, gen, bufs, p, con)
            rows = yield staged.verify
            if before is not None and not before():
                return None
            step = complete(staged, rows, defer=True)
            step.decision = d
            if step.pending is not None:         # its drafter's next chain: queued with the round's others
                yield Chains(step.pending)
            return step

        def read(step: Launched) -> tuple[int, list[int], list[list[float]] | None]:
            """The step's one host read and commit; its tokens reach the grammar's matcher."""
            n, toks = finish(step, trunk, fed)
            lp = step.logprobs()
            if con is not None:                  # the matcher follows the output before the next step's masks
                toks = toks[:con.advance(toks)]
            return n, toks, lp

        t0 = time.perf_counter()
        prompt = torch.tensor(ids, device=dev)
        vocab = trunk.cfg.vocab_size
        pen = (bufs.penalties(vocab, prompt, sorted(t for t in out.eos if t < vocab)) if sp.tracked
               else None)                                                               # reset per request
        con = self.constraint(sp)               # the request's grammar (runtime/constraint.py), or None
        prompt_lps = self.prompt_logprobs(ids, prompt, sp.prompt_logprobs) if sp.prompt_logprobs is not None else None
        cached = 0
        if trunk.state is None:                 # a mesh's state lives on its ranks: no copy to share,
            fork = None                         # so each request of the prompt prefills it itself
        while fork is not None and fork.leading and fork.snap is None and not fork.abandoned:
            yield None                          # another choice of this request prefills the prompt
        if fork is not None and fork.snap is not None:
            trunk.begin()
            restore(trunk.state, fork.snap)
            rows, cached = Rows(fork.logits, fork.snap.hidden), len(ids)
        else:
            lead = fork is not None and not fork.abandoned
            if lead:
                fork.leading = True
            try:
                if self.prefix is not None:
                    rows, cached = yield from self.prefix.prefill_steps(ids, prompt, trunk, ends)
                else:
                    trunk.begin()
                    rows = yield from trunk.prefill_steps(prompt, ends=ends)
            except BaseException:               # (a cancel closes the generator here too)
                if lead:
                    fork.abandoned = True
                raise
            if lead:
                fork.keep(trunk.state, ids, rows)
        logits = penalize(rows.logits[-1:], pen, sp)
        if con is not None:
            logits = con.mask(logits, [])
        first = pick(logits, sp, gen)
        if pen is not None:
            pen.add(first)
        last = int(first)
        lps: list[TokenLogprobs] | None = [] if sp.logprobs is not None else None
        rows_lp = token_logprobs(logits, first, sp).tolist() if lps is not None else None
        t1 = t_prev = time.perf_counter()
        pos, last_dev, toks = len(ids), first, [last]
        if con is not None:
            con.advance(toks)
        cur: Launched | None = None
        ahead: Launched | None = None
        suspended = 0.0
        begun = False
        while True:
            n_before = len(out.token_ids)
            text = ""
            for i, t in enumerate(toks):
                if out.done:
                    break
                text += out.add(t)
                if lps is not None:
                    lps.append(TokenLogprobs.from_row(t, rows_lp[i]))
            if con is not None and con.done:    # the grammar is complete: nothing but EOS could follow
                text += out.end("stop")
            if not out.done and (text or len(out.token_ids) > n_before):
                ts = time.perf_counter()
                yield StreamChunk(text, out.token_ids[n_before:], logprobs=None if lps is None else lps[n_before:],
                                  prompt_logprobs=prompt_lps if n_before == 0 else None)
                suspended += time.perf_counter() - ts
            if out.done:
                break
            if not begun:
                # the drafters catch up on the prompt only once the first token is out (the MTP
                # head's catch-up is a prefill of its own: speculation never delays the first
                # token, and a request that ends at it starts no drafter)
                for d in fed:
                    d.begin(prompt, rows.hidden)
                for d in fed:
                    d.commit([last], rows.hidden[:0], first)
                begun = True
                t_prev, suspended = time.perf_counter(), 0.0
            if cur is None:
                cur = yield from start(ctl.decide(), last, last_dev, pos, out.remaining)
            got = None
            if ahead is None and cur.k == 0 and out.remaining >= 2 and self.queue_ahead:
                d = ctl.decide()
                if d.k == 0 or d.route == "ar":      # its input is cur's token, already on the device
                    if con is None:
                        ahead = yield from start(d, -1, cur.targets[:1], cur.pos + 1, out.remaining - 1)
                    else:   # its mask needs cur's token in the matcher: cur is read while its verify runs
                        def read_cur(step: Launched = cur) -> bool:
                            nonlocal got
                            got = read(step)
                            return not con.done
                        ahead = yield from start(d, -1, cur.targets[:1], cur.pos + 1, out.remaining - 1, read_cur)
            n, toks, rows_lp = got if got is not None else read(cur)
            now = time.perf_counter()
            stats.record(cur.k, n, toks, cur.route)
            # a cycle that shared its forward costs the round, whatever its own route: only cycles
            # run alone measure the costs auto compares (its acceptance counts either way)
            ctl.observe(cur.decision, cur.k, n, now - t_prev - suspended if self.shared.round.width <= 1 else None)
            t_prev, suspended = now, 0.0
            if not log or (log[-1]["route"], log[-1]["k"]) != (cur.route, cur.k):
                log.append({"at": len(out.token_ids), "route": cur.route, "k": cur.k})
            by_route[cur.route] = by_route.get(cur.route, 0) + len(toks)
            pos, last, last_dev = pos + n + 1, toks[-1], cur.targets[n:n + 1]
            cur, ahead = ahead, None
            # queue the next step before the text work when these tokens cannot end the output
            if (cur is None and out.remaining > len(toks) and not any(t in out.eos for t in toks)
                    and not (con is not None and con.done)):
                cur = yield from start(ctl.decide(), last, last_dev, pos, out.remaining - len(toks))
        t2 = time.perf_counter()
        n_gen = len(out.token_ids)
        prefill_s, decode_s = t1 - t0, t2 - t1
        k = policy.k if route != "ar" else 0
        penalties = self.penalty_note(sp, route) if sp.penalized else None
        if route == "auto":           # the choice auto settled on (AR while still measuring); `routes` has all
            (route, k), reason = ctl.current, ctl.reason or reason
        for r, a in ctl.acc.items():
            if a.cycles:
                self.accept_prior[r] = a
        st = {
            "prompt_tokens": len(ids), "cached_tokens": cached, "generated_tokens": n_gen, "route": route,
            "route_reason": reason, "k": k, "routes": by_route, "route_log": log,
            "per_route": stats.per_route(),
            "cycles": stats.cycles, "drafted": stats.drafted, "accepted": stats.accepted,
            "mean_accept_len": stats.mean_accept_len, "accept_per_pos": stats.accept_per_pos,
            "accepted_per_pos": list(stats.accepted_per_pos),
            "penalties": penalties,
            "structured_outputs": None if con is None else {"kind": con.spec.kind, "param": con.spec.param,
                                                            "host_s": con.host_s},
            "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_tok_s": len(ids) / prefill_s if prefill_s > 0 else 0.0,
            "decode_tok_s": (n_gen - 1) / decode_s if decode_s > 0 and n_gen > 1 else 0.0,
        }
        res = GenerationResult(out.text, list(out.token_ids), out.finish_reason or "length", list(ids), st,
                               lps, prompt_lps)
        yield StreamChunk(text, out.token_ids[n_before:], res, None if lps is None else lps[n_before:])

    def prompt_logprobs(self, ids: list[int], prompt: torch.Tensor, top: int) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability under the model's raw logits at the position before
        it (the first has none), and the `top` most likely there. A scoring pass of its own, before
        the request's prefill, so the generated tokens are those of a request without it."""
        logits = self.trunk.score(prompt)[:-1]                                  # [T-1, V]
        rows = token_logprobs(logits, prompt[1:], SamplingParams(logprobs=top)).tolist()
        return [None] + [TokenLogprobs.from_row(t, r) for t, r in zip(ids[1:], rows)]
