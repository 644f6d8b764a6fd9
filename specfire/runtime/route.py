"""Which decoding route serves each cycle of a request, and why.

Explicit modes (`off`, `mtp`, `ngram` with the given k) are served exactly as asked. `auto` is
measured: a `RouteController` that the engine consults between cycles picks AR, MTP or n-gram and
k by expected tokens per second, from cycle times measured on this engine (`CostTable`, kept
across requests) and the running acceptance per draft position of this request. While requests
share rounds (`RoundView`), a drafting route is priced by what it adds to the round against the
request's share of it, so drafting pays less as the batch grows. Greedy output
does not depend on the choice (every route emits exactly the AR tokens), so it may change at any
cycle; sampled output keeps AR's distribution on every route.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Protocol

from ..errors import SpecfireError
from ..params import SamplingParams, SpecPolicy
from .drafters.registry import BY_NAME, KINDS


@dataclass(frozen=True)
class RoutePlan:
    """A request's route and its reason, decided once (`Engine.route`) for these policy and
    sampling parameters, and handed with the request to the engine, which does not decide again."""

    route: str
    reason: str
    policy: SpecPolicy
    params: SamplingParams

    def check(self, policy: SpecPolicy, sp: SamplingParams) -> None:
        if policy != self.policy or sp != self.params:
            raise ValueError("plan: a route plan serves the spec policy and sampling params it was decided for; "
                             "these differ")


def select_route(policy: SpecPolicy, built: Collection[str], sp: SamplingParams,
                 topology: str = "single") -> tuple[str, str]:
    """Return (route, reason) with route "ar", "auto" or a drafter's name (drafters/registry.py);
    "auto" means the RouteController decides cycle by cycle. `built`: the drafters this model has.
    An explicit mode whose drafter was not built raises SpecfireError (never a silent fallback);
    `topology` only labels the reason."""
    if policy.mode == "off":
        return "ar", "speculation off by policy"
    kind = BY_NAME.get(policy.mode)
    if kind is not None:
        if kind.name not in built:
            raise SpecfireError(f"spec mode {kind.name!r} requested but {kind.absent}")
        return kind.name, f"{kind.what} requested (k={policy.k}, {topology})"
    if sp.max_tokens == 1:
        return "ar", "auto: a single token leaves nothing to speculate"
    drafters = " and ".join(k.short for k in KINDS if k.name in built)
    drafters += "".join(f" (no {k.what} loaded)" for k in KINDS if k.name not in built)
    return "auto", f"auto: AR or {drafters} measured per cycle (k<={policy.k}, {topology})"


class CostTable:
    """Seconds per cycle by (route, k) on one engine (this machine, this model), shared by its
    requests. The lower quartile of the last `window` samples (a CUDA graph capture or a busy host
    only ever slows a cycle), and the first sample of each key is dropped (it pays the captures)."""

    def __init__(self, window: int = 9):
        self.window = window
        self.samples: dict[tuple[str, int], list[float]] = {}
        self.firsts: set[tuple[str, int]] = set()

    def add(self, route: str, k: int, seconds: float) -> None:
        key = (route, k)
        if key not in self.firsts:
            self.firsts.add(key)
            return
        s = self.samples.setdefault(key, [])
        s.append(seconds)
        del s[:-self.window]

    def get(self, route: str, k: int) -> float | None:
        s = self.samples.get((route, k))
        if not s:
            return None
        return sorted(s)[(len(s) - 1) // 4]

    def measured_ks(self, route: str) -> list[int]:
        return sorted(k for (r, k), s in self.samples.items() if r == route and s and k > 0)


@dataclass
class RoundView:
    """What the scheduler's rounds tell auto: `width`, the verifies in the last forward (1: alone);
    and of the last round in which every running request verified in that one forward, its wall
    seconds and each verify's (route, k, packed): `packed`, its draft chain ran in one packed
    chain with others' (drafters/chain.py packed_chain_after: the head's and the lm_head's
    weights read once for all of them)."""

    width: int = 1
    seconds: float | None = None
    members: tuple[tuple[str, int, bool], ...] = ()

    def packed(self, route: str, k: int) -> int:
        """How many members drafted `route` at k through one packed chain."""
        return sum(1 for r, kk, p in self.members if p and r == route and kk == k)

    def alone(self) -> None:
        self.width, self.seconds, self.members = 1, None, ()

    @property
    def shared(self) -> bool:
        return self.width > 1 and len(self.members) > 1 and bool(self.seconds)


@dataclass(frozen=True)
class RouteTuning:
    probe: int = 4           # cycles of each drafting route at the policy's k before choosing
    reprobe: int = 16        # cycles between checks of a route not chosen (doubles while the choice holds)
    alpha: float = 0.25      # weight of the newest cycle in the running acceptance per position
    margin: float = 0.03     # a new choice must promise this much more speed to replace the current one


@dataclass
class Acceptance:
    """Running acceptance of one drafting route: per draft position, the chance a draft is
    accepted given that the drafts before it were (an EWMA), and how often it proposes at all."""

    per_pos: list[float | None]
    hit: float | None = None
    cycles: int = 0

    def update(self, k: int, n: int, alpha: float) -> None:
        self.cycles += 1
        proposed = 1.0 if k > 0 else 0.0
        self.hit = proposed if self.hit is None else (1 - alpha) * self.hit + alpha * proposed
        for i in range(min(n + 1, k)):             # position i is tested when the i before it passed
            x = 1.0 if n > i else 0.0
            a = self.per_pos[i]
            self.per_pos[i] = x if a is None else (1 - alpha) * a + alpha * x

    def rates(self, k: int) -> list[float]:
        out, prev = [], 0.5
        for i in range(k):
            a = self.per_pos[i]
            prev = a if a is not None else prev
            out.append(prev)
        return out

    def expected_tokens(self, k: int) -> float:
        """Tokens a cycle of k drafts emits on average: 1 + sum over j of P(first j accepted)."""
        e, reach = 1.0, 1.0
        for a in self.rates(k):
            reach *= a
            e += reach
        return e


@dataclass(frozen=True)
class Decision:
    route: str
    k: int
    check: bool = False      # a measurement of a route that is not the current choice


class Controller(Protocol):
    """What the engine uses of a route controller (`RouteController`, or a test's scripted one)."""

    candidates: tuple[str, ...]          # the drafting routes it may choose (their drafters see every token)
    current: tuple[str, int]             # its settled (route, k), reported in the stats
    reason: str
    acc: dict[str, "Acceptance"]         # acceptance per route, carried to the engine's next requests

    def decide(self) -> "Decision": ...
    def observe(self, d: "Decision", k: int, n: int, seconds: float | None) -> None: ...


@dataclass
class RouteController:
    """Chooses (route, k) before every cycle and learns from every cycle (`observe`). With `fixed`
    it always answers that (the explicit modes) and only records costs and acceptance."""

    kmax: int
    candidates: tuple[str, ...]                  # drafting routes available (drafters/registry.py order)
    costs: CostTable
    fixed: tuple[str, int] | None = None
    tuning: RouteTuning = field(default_factory=RouteTuning)
    prior: dict[str, Acceptance] | None = None   # acceptance carried over from earlier requests
    round: RoundView | None = None               # the rounds this request shares (None: it runs alone)

    def __post_init__(self) -> None:
        self.acc = {r: Acceptance([None] * self.kmax) for r in self.candidates}
        for r, a in (self.prior or {}).items():
            if r in self.acc and a.cycles >= self.tuning.probe:
                self.acc[r] = Acceptance(list(a.per_pos[:self.kmax]) + [None] * max(0, self.kmax - len(a.per_pos)),
                                         a.hit, self.tuning.probe)
        self.current = self.fixed or ("ar", 0)
        self.reason = "" if self.fixed is None else f"{self.fixed[0]} k={self.fixed[1]} as requested"
        self.since = 0                       # exploiting cycles since the last check of another route
        self.interval = self.tuning.reprobe

    # ---- the model -------------------------------------------------------------------------------
    def cost(self, route: str, k: int) -> float | None:
        """Seconds per cycle of `route` at k: measured, else linear in k between measured points
        (k = 0 is the AR step)."""
        ar = self.costs.get("ar", 0)
        if route == "ar" or k == 0:
            c0 = self.costs.get(route, 0) if route != "ar" else None
            return c0 if c0 is not None else ar
        c = self.costs.get(route, k)
        if c is not None or ar is None:
            return c
        pts = [(0, ar)] + [(kk, self.costs.get(route, kk)) for kk in self.costs.measured_ks(route)]
        lo = max((p for p in pts if p[0] < k), key=lambda p: p[0])
        hi = [p for p in pts if p[0] > k]
        if hi:
            h = min(hi, key=lambda p: p[0])
        elif len(pts) >= 2 and lo[0] > 0:
            h, lo = lo, max((p for p in pts if p[0] < lo[0]), key=lambda p: p[0])
        else:
            return None
        return lo[1] + (h[1] - lo[1]) * (k - lo[0]) / (h[0] - lo[0])

    def rate(self, route: str, k: int) -> float | None:
        """Expected tokens per second of `route` at k (None while unmeasured)."""
        if route == "ar" or k == 0:
            c = self.cost("ar", 0)
            return None if c is None else 1.0 / c
        a = self.acc[route]
        c, c0 = self.cost(route, k), self.cost(route, 0)
        if c is None or c0 is None:
            return None
        h = 1.0 if a.hit is None else a.hit
        return (h * a.expected_tokens(k) + (1 - h)) / (h * c + (1 - h) * c0)

    def added(self, route: str, k: int) -> float | None:
        """Seconds a cycle of `route` at k adds to a round over an AR cycle: its alone cost less the
        AR step's (its drafting, and its extra verify rows priced as alone)."""
        ar, c = self.cost("ar", 0), self.cost(route, k)
        return None if ar is None or c is None else max(0.0, c - ar)

    def share(self) -> float:
        """A request's seconds of the last shared round were every member at AR: the round's time
        less what its members' drafting added, over its width (at least a quarter of the even
        split). Members whose chains ran as one packed chain added one chain's cost between them
        (its weights are read once; extra rows cost little at these sizes)."""
        rv = self.round
        extra = sum(self.added(r, k) or 0.0 for r, k, p in rv.members if r != "ar" and k > 0 and not p)
        extra += sum(self.added(r, k) or 0.0 for r, k in {(r, k) for r, k, p in rv.members if p and k > 0})
        return max(rv.seconds - extra, 0.25 * rv.seconds) / len(rv.members)

    def drafting_price(self, route: str, k: int) -> float | None:
        """What drafting `route` at k adds to this request's share of a shared round: its alone
        addition, split with the members that drafted the same through one packed chain."""
        d = self.added(route, k)
        return None if d is None else d / max(1, self.round.packed(route, k))

    def shared_rate(self, route: str, k: int, share: float) -> float | None:
        """Expected tokens per second of the request's share of a round with `route` at k: AR's one
        token per share; a drafting route's expected tokens per share plus what it adds."""
        if route == "ar" or k == 0:
            return 1.0 / share
        a = self.acc[route]
        d, d0 = self.drafting_price(route, k), self.added(route, 0)
        if d is None or d0 is None:
            return None
        h = 1.0 if a.hit is None else a.hit
        return (h * a.expected_tokens(k) + (1 - h)) / (share + h * d + (1 - h) * d0)

    # ---- decisions -------------------------------------------------------------------------------
    def decide(self) -> Decision:
        """The next cycle's route and k; the same answer until the next `observe`."""
        if self.fixed is not None:
            return Decision(*self.fixed)
        if self.cost("ar", 0) is None:
            self.reason = "auto: measuring the AR step"
            return Decision("ar", 0, True)
        for r in self.candidates:
            if self.acc[r].cycles < self.tuning.probe or self.cost(r, self.kmax) is None:
                self.reason = f"auto: measuring {r} at k={self.kmax}"
                return Decision(r, self.kmax, True)
        options = [("ar", 0)] + [(r, k) for r in self.candidates for k in range(1, self.kmax + 1)]
        share = self.share() if self.round is not None and self.round.shared else None
        if share is None:
            rated = {o: self.rate(*o) or 0.0 for o in options}
        else:
            rated = {o: self.shared_rate(*o, share) or 0.0 for o in options}
        best = max(options, key=lambda o: rated[o])
        cur = self.current
        if best != cur and rated.get(cur, 0.0) >= rated[best] * (1 - self.tuning.margin):
            best = cur                                           # not worth a switch
        if best != cur:
            self.interval = self.tuning.reprobe
        self.current = best
        self.reason = self._explain(best, rated, share)
        if self.since >= self.interval:                          # check what is not being measured
            stale = [r for r in self.candidates if best != (r, self.kmax)]
            if stale:
                r = min(stale, key=lambda r: self.acc[r].cycles)
                self.reason += f"; checking {r} at k={self.kmax}"
                return Decision(r, self.kmax, True)
        return Decision(*best)

    def _explain(self, best: tuple[str, int], rated: dict[tuple[str, int], float], share: float | None) -> str:
        ar = rated[("ar", 0)]
        parts = []
        for r in self.candidates:
            k = max(range(1, self.kmax + 1), key=lambda k: rated[(r, k)])
            a = self.acc[r]
            acc = "/".join(f"{x:.2f}" for x in a.rates(k))
            if share is None:
                per = f"per {self.cost(r, k) / self.cost('ar', 0):.2f}x-AR cycle"
            else:
                m = self.round.packed(r, k)
                per = f"for +{1e3 * (self.drafting_price(r, k) or 0.0):.3f} ms" + (
                    f" (one packed chain with {m - 1} other(s))" if m > 1 else "")
            parts.append(f"{r} k={k} {rated[(r, k)] / ar:.2f}x AR (accept {acc}, {a.expected_tokens(k):.2f} tok {per})")
        what = "ar" if best[0] == "ar" else f"{best[0]} k={best[1]}"
        if share is None:
            return f"auto: {what}; AR step {1e3 * self.cost('ar', 0):.3f} ms; " + "; ".join(parts)
        rv = self.round
        return (f"auto: {what}; {len(rv.members)} requests share a {1e3 * rv.seconds:.3f} ms round ({1e3 * share:.3f} ms "
                f"each at AR: drafting pays less as the batch grows); " + "; ".join(parts))

    def observe(self, d: Decision, k: int, n: int, seconds: float | None) -> None:
        """A cycle decided as `d` verified k drafts (k <= d.k), accepted n, took `seconds` (None: its
        time says nothing of its own cost, e.g. it shared a forward with other requests)."""
        if seconds is not None:
            self.costs.add(d.route, k, seconds)
        if d.route in self.acc:
            self.acc[d.route].update(k, n, self.tuning.alpha)
        if self.fixed is not None:
            return
        if not d.check:
            self.since += 1
        elif self.since >= self.interval:          # a check of a route not chosen: back off
            self.since = 0
            self.interval = min(self.interval * 2, 256)
