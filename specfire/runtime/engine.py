"""The engine of one slot: a request's route, grammar and controller, its stream over the generation
loop (steps.py), and `Shared`, what the engines of one model share."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Generator, Iterator

import torch

from ..errors import SpecfireError
from ..params import SamplingParams, SpecPolicy
from ..tokenizer import Tokenizer
from .constraint import Constraint
from .drafters import BY_NAME, KINDS, Drafter, MtpDrafter, drafting_routes
from .output import TokenLogprobs
from .prefix import Fork, PrefixCache
from .prompts import check_prompt_ids
from .reads import RoundReads
from .route import Acceptance, Controller, CostTable, RoundView, RouteController, RoutePlan, select_route
from .sampling import token_logprobs
from .spec import Chains, OnCycle, StepBuffers
from .steps import GenerationResult, StreamChunk, request_steps
from .trunk import Rows, Trunk, Verify

__all__ = ["Engine", "GenerationResult", "Shared", "StreamChunk"]   # the result types live in steps.py

if TYPE_CHECKING:
    from ..grammar import GrammarCompiler


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
        return request_steps(self, ids, sp, policy, on_cycle, drafter, controller, plan, fork, ends)

    def prompt_logprobs(self, ids: list[int], prompt: torch.Tensor, top: int) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability under the model's raw logits at the position before
        it (the first has none), and the `top` most likely there. A scoring pass of its own, before
        the request's prefill, so the generated tokens are those of a request without it."""
        logits = self.trunk.score(prompt)[:-1]                                  # [T-1, V]
        rows = token_logprobs(logits, prompt[1:], SamplingParams(logprobs=top)).tolist()
        return [None] + [TokenLogprobs.from_row(t, r) for t, r in zip(ids[1:], rows)]
