"""One request's generation loop (Engine.steps), and the chunks and result it yields: prefill, then
the shared speculative step until the output is done; engine.py keeps the routing and setup."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator

import torch

from ..params import SamplingParams, SpecPolicy
from .drafters import Drafter
from .output import OutputBuilder, TokenLogprobs
from .prefix import Fork, restore
from .route import Controller, Decision, RoutePlan
from .sampling import penalize, pick, token_logprobs
from .spec import Chains, Launched, OnCycle, SpecStats, complete, finish, prepare
from .trunk import Rows, Verify

if TYPE_CHECKING:
    from .engine import Engine


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


def request_steps(eng: Engine, ids: list[int], sp: SamplingParams, policy: SpecPolicy,
                  on_cycle: OnCycle | None = None, drafter: Drafter | None = None,
                  controller: Controller | None = None, plan: RoutePlan | None = None, fork: Fork | None = None,
                  ends: tuple[int, ...] = ()) -> Generator[StreamChunk | Verify | Chains | None, Rows | None, None]:
    """`eng.steps(...)` (runtime/engine.py Engine.steps says what it yields and is sent)."""
    eng.check_prompt(ids)
    eng.check_sampling(sp)
    drafters = dict(eng.drafters)
    if drafter is not None:
        drafters = {drafter.name: drafter}
        route, reason = drafter.name, f"drafter {drafter.name!r} given by the caller (k={policy.k})"
    else:
        if plan is None:
            plan = eng.route(policy, sp)
        plan.check(policy, sp)
        route, reason = plan.route, plan.reason
    ctl = controller or eng.controller(route, policy, sp)
    fed = [drafters[r] for r in ctl.candidates if r in drafters]   # drafters that see every token
    trunk, bufs, dev = eng.trunk, eng.bufs, eng.trunk.device
    gen = None if sp.greedy else bufs.rng.seed(sp.seed)   # device-side stream: graphs replay fresh draws
    max_new = min(sp.max_tokens, trunk.max_seq - len(ids))
    out = OutputBuilder(sp, eng.eos_ids, eng.tokenizer, max_new)
    stats = SpecStats(on_cycle=on_cycle)
    by_route: dict[str, int] = {}
    log: list[dict[str, Any]] = []

    def start(d: Decision, last: int, last_dev: torch.Tensor, pos: int, before: Callable[[], bool] | None = None):
        """Stage, verify and complete a step; `before` runs between its verify and the rest
        (False: the step is not wanted, None comes back)."""
        # drafts are not cut to the tokens the output has left: a last cycle of k drafts
        # costs a GPU what a shorter one does, its surplus is never emitted, and every cycle of a route
        # keeps its row count (a batch's row patterns, whose CUDA graphs are captured once, stay few)
        k = max(0, min(d.k, trunk.max_seq - pos - 1))
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
    con = eng.constraint(sp)               # the request's grammar (runtime/constraint.py), or None
    prompt_lps = eng.prompt_logprobs(ids, prompt, sp.prompt_logprobs) if sp.prompt_logprobs is not None else None
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
            if eng.prefix is not None:
                rows, cached = yield from eng.prefix.prefill_steps(ids, prompt, trunk, ends)
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
            cur = yield from start(ctl.decide(), last, last_dev, pos)
        got = None
        if ahead is None and cur.k == 0 and out.remaining >= 2 and eng.queue_ahead:
            d = ctl.decide()
            if d.k == 0 or d.route == "ar":      # its input is cur's token, already on the device
                if con is None:
                    ahead = yield from start(d, -1, cur.targets[:1], cur.pos + 1)
                else:   # its mask needs cur's token in the matcher: cur is read while its verify runs
                    def read_cur(step: Launched = cur) -> bool:
                        nonlocal got
                        got = read(step)
                        return not con.done
                    ahead = yield from start(d, -1, cur.targets[:1], cur.pos + 1, read_cur)
        n, toks, rows_lp = got if got is not None else read(cur)
        now = time.perf_counter()
        emitted = min(len(toks), out.remaining)
        stats.record(cur.k, n, toks, cur.route, emitted)
        # a cycle that shared its forward costs the round, whatever its own route: only cycles
        # run alone measure the costs auto compares (its acceptance counts either way)
        ctl.observe(cur.decision, cur.k, n, now - t_prev - suspended if eng.shared.round.width <= 1 else None)
        t_prev, suspended = now, 0.0
        if not log or (log[-1]["route"], log[-1]["k"]) != (cur.route, cur.k):
            log.append({"at": len(out.token_ids), "route": cur.route, "k": cur.k})
        by_route[cur.route] = by_route.get(cur.route, 0) + emitted
        pos, last, last_dev = pos + n + 1, toks[-1], cur.targets[n:n + 1]
        cur, ahead = ahead, None
        # queue the next step before the text work when these tokens cannot end the output
        if (cur is None and out.remaining > len(toks) and not any(t in out.eos for t in toks)
                and not (con is not None and con.done)):
            cur = yield from start(ctl.decide(), last, last_dev, pos)
    t2 = time.perf_counter()
    n_gen = len(out.token_ids)
    prefill_s, decode_s = t1 - t0, t2 - t1
    k = policy.k if route != "ar" else 0
    penalties = eng.penalty_note(sp, route) if sp.penalized else None
    if route == "auto":           # the choice auto settled on (AR while still measuring); `routes` has all
        (route, k), reason = ctl.current, ctl.reason or reason
    for r, a in ctl.acc.items():
        if a.cycles:
            eng.accept_prior[r] = a
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
