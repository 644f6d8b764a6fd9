"""The measured route (`auto`): RouteController decisions from injected cycle times and
acceptances (no timing here), and greedy output equal to AR whatever route and k each cycle takes,
including forced changes mid-request."""
from __future__ import annotations

import pytest

import specfit
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.runtime.route import CostTable, Decision, RoundView, RouteController, RouteTuning

MS = 1e-3


def controller(k=3, candidates=("mtp",), **tune) -> RouteController:
    return RouteController(k, candidates, CostTable(), tuning=RouteTuning(**tune))


def feed(ctl: RouteController, cost: dict, accept, cycles: int) -> list[Decision]:
    """Run `cycles` cycles: each decision's cost comes from `cost[(route, k)]` (seconds) and a
    drafting cycle accepts `accept(route, k)` drafts. Returns the decisions."""
    seen = []
    for _ in range(cycles):
        d = ctl.decide()
        assert ctl.decide() == d                                 # the same answer until observed
        n = 0 if d.route == "ar" else accept(d.route, d.k)
        ctl.observe(d, d.k, n, cost[(d.route, d.k)])
        seen.append(d)
    return seen


def linear(ar: float, per_draft: float, k: int = 3, route: str = "mtp") -> dict:
    c = {("ar", 0): ar}
    c.update({(route, j): ar + per_draft * j for j in range(1, k + 1)})
    return c


def test_cost_table_drops_the_first_sample_and_takes_the_lower_quartile():
    t = CostTable(window=4)
    t.add("ar", 0, 5.0)                        # the capture
    assert t.get("ar", 0) is None
    for s in (1.0, 3.0, 2.0, 9.0):
        t.add("ar", 0, s)
    assert t.get("ar", 0) == 1.0
    t.add("ar", 0, 4.0)                        # the window drops 1.0
    assert t.get("ar", 0) == 2.0
    assert t.measured_ks("ar") == []


def test_cpu_like_costs_pick_ar():
    """A verify row costs about an AR step (the CPU): MTP at 60% acceptance does not pay."""
    ctl = controller()
    pat = iter([2, 0, 1, 3, 1, 0] * 20)
    ds = feed(ctl, linear(10 * MS, 9 * MS), lambda r, k: min(k, next(pat)), 20)
    assert ds[-1] == Decision("ar", 0)
    assert ctl.reason.startswith("auto: ar") and "mtp k=" in ctl.reason


def test_gpu_like_costs_pick_mtp_full_k():
    """A k=3 cycle at 1.065x an AR step (the 27B shape) with 90% acceptance: MTP k=3."""
    ctl = controller()
    ds = feed(ctl, linear(18 * MS, 0.4 * MS), lambda r, k: k if k < 3 else 3, 12)
    assert [d.route for d in ds[:2]] == ["ar", "ar"]          # the AR step is measured first
    assert ds[2] == Decision("mtp", 3, check=True)            # then the drafting route
    assert ds[-1] == Decision("mtp", 3) and ctl.reason.startswith("auto: mtp k=3")


def test_a_shared_round_prices_drafting_by_what_it_adds():
    """Alone, MTP k=3 at 2x an AR step with 90% acceptance pays (2.7 tokens per 2 steps). In a round
    eight requests share, a request's AR share is an eighth of the round, while its drafting still
    adds a whole AR step: AR wins, and the reason says the round was shared; unless the members'
    chains run as one packed chain, whose cost they split."""
    view = RoundView()
    ctl = RouteController(3, ("mtp",), CostTable(), round=view)
    costs = linear(10 * MS, 10 * MS / 3)
    it = iter([1] * 9 + [0] + [1] * 9 + [0] + [1] * 100)
    ds = feed(ctl, costs, lambda r, k: k if next(it) else 0, 16)
    assert ds[-1] == Decision("mtp", 3)                        # alone: drafting pays
    ar, mtp, packed = ("ar", 0, False), ("mtp", 3, False), ("mtp", 3, True)
    view.width, view.seconds, view.members = 8, 24 * MS, (ar,) * 8
    assert ctl.share() == pytest.approx(3 * MS)
    d = ctl.decide()
    assert d == Decision("ar", 0), ctl.reason
    assert ctl.reason.startswith("auto: ar; 8 requests share a 24.000 ms round (3.000 ms each at AR")
    assert "mtp k=" in ctl.reason and "+" in ctl.reason
    # the round's members that drafted paid for it: their additions come off every member's share
    view.members = (mtp,) + (ar,) * 7
    assert ctl.share() == pytest.approx((24 - 10) * MS / 8)
    view.members = (mtp,) * 3 + (ar,) * 5                    # (never below a quarter of the even split)
    assert ctl.share() == pytest.approx(0.25 * 24 * MS / 8)
    assert ctl.decide() == Decision("ar", 0), ctl.reason
    # members whose chains ran as one packed chain (each weight read once for all of them) added
    # one chain's cost between them, and a member drafting with them pays its split of it: MTP
    view.members = (packed,) * 8
    assert ctl.share() == pytest.approx((24 - 10) * MS / 8)
    assert ctl.drafting_price("mtp", 3) == pytest.approx(10 * MS / 8)
    assert ctl.decide() == Decision("mtp", 3), ctl.reason
    assert "one packed chain with 7 other(s)" in ctl.reason
    view.seconds, view.members = 40 * MS, (packed,) * 3 + (mtp,) + (ar,) * 4   # three packed, one alone: two additions
    assert ctl.share() == pytest.approx((40 - 20) * MS / 8)
    assert ctl.drafting_price("mtp", 3) == pytest.approx(10 * MS / 3)
    view.alone()                                              # alone again: MTP
    assert ctl.decide() == Decision("mtp", 3)


def test_collapse_shortens_k_then_stops_drafting():
    ctl = controller(alpha=0.3)
    costs = linear(10 * MS, 1.5 * MS)
    feed(ctl, costs, lambda r, k: k, 12)
    assert ctl.decide() == Decision("mtp", 3)
    # the first draft keeps being right, later ones stop: k shrinks to 1
    ds = feed(ctl, costs, lambda r, k: min(k, 1), 20)
    assert ds.index(Decision("mtp", 1)) < 10 and all(d.k == 1 or d.check for d in ds[10:])
    # nothing is accepted any more: back to AR
    ds = feed(ctl, costs, lambda r, k: 0, 20)
    assert ds[-1] == Decision("ar", 0)


def test_k_from_interpolated_costs():
    """Only k=3 and AR are measured; cost in between is linear; acceptance falls fast after the
    first position, so k=1 wins."""
    ctl = controller()
    pattern = iter([1, 0, 1, 1, 0, 1, 2, 1] * 10)
    feed(ctl, linear(10 * MS, 4 * MS), lambda r, k: min(k, next(pattern)), 6)
    assert ctl.costs.measured_ks("mtp") == [3]
    assert abs(ctl.cost("mtp", 1) - 14 * MS) < 1e-9
    d = ctl.decide()
    assert d == Decision("mtp", 1), ctl.reason


def test_checks_other_routes_and_backs_off():
    ctl = controller(candidates=("mtp", "ngram"), reprobe=4)
    costs = linear(10 * MS, 10 * MS)
    costs.update({("ngram", j): 10 * MS + 0.5 * MS * j for j in range(4)})
    ds = feed(ctl, costs, lambda r, k: 0, 60)
    checks = [i for i, d in enumerate(ds) if d.check and i >= 10]
    assert ds[-1] == Decision("ar", 0) or ds[-1].check
    assert len(checks) >= 3
    gaps = [b - a for a, b in zip(checks, checks[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]         # exponential back-off


def test_ngram_hit_rate_counts():
    """n-gram that rarely finds a match gets credit only for the cycles it proposes."""
    ctl = controller(candidates=("ngram",))
    costs = linear(10 * MS, 0.2 * MS, route="ngram")
    costs[("ngram", 0)] = 10.1 * MS
    ks = iter([0, 0, 0, 3] * 20)

    seen = []
    for _ in range(30):
        d = ctl.decide()
        k = next(ks) if d.route == "ngram" else 0
        ctl.observe(d, k, k, costs[(d.route, k)])
        seen.append(d)
    a = ctl.acc["ngram"]
    assert 0.0 < a.hit < 0.6 and a.per_pos[0] == 1.0
    assert ctl.rate("ngram", 3) > ctl.rate("ar", 0)           # when it hits, everything is accepted


def test_fixed_routes_are_kept_and_still_measured():
    ctl = RouteController(3, ("mtp",), CostTable(), fixed=("mtp", 2))
    for _ in range(5):
        d = ctl.decide()
        assert d == Decision("mtp", 2)
        ctl.observe(d, 2, 0, 1.0)
    assert ctl.costs.get("mtp", 2) == 1.0 and ctl.acc["mtp"].per_pos[0] == 0.0


# ---- end to end: whatever the route, greedy output is AR's -------------------------------------

class Forced:
    """A controller that takes the routes of a fixed schedule, cycle after cycle."""

    candidates = ("mtp", "ngram")
    reason = "forced"

    def __init__(self, schedule):
        self.schedule, self.i = schedule, 0
        self.current = schedule[0]
        self.acc = {}                    # no acceptance to carry over

    def decide(self) -> Decision:
        return Decision(*self.schedule[self.i % len(self.schedule)])

    def observe(self, d, k, n, seconds) -> None:
        self.i += 1


SCHEDULES = [
    [("ar", 0), ("mtp", 3), ("ngram", 2), ("mtp", 1), ("ar", 0), ("ar", 0), ("mtp", 2), ("ngram", 3)],
    [("mtp", 4)] * 3 + [("ar", 0)] * 15 + [("mtp", 3)] * 2,      # rows pile up past the draft graphs' limit
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["mixed", "long_ar_gap"])
def test_forced_route_changes_equal_ar(fitted, schedule):
    with LLM(fitted, device="cpu", progress=False) as llm:
        for p in specfit.prompts(3, seed=5):
            ref = llm.generate(p, SamplingParams(max_tokens=48, ignore_eos=True), spec="off")
            chunks = list(llm.engine.stream(list(p), SamplingParams(max_tokens=48, ignore_eos=True),
                                            SpecPolicy("auto", 4), controller=Forced(schedule)))
            res = chunks[-1].result
            assert res.token_ids == ref.token_ids
            assert [t for c in chunks for t in c.token_ids] == ref.token_ids
            assert set(res.stats["routes"]) >= {"ar", "mtp"}
            assert res.stats["accepted"] > 0


def test_auto_equals_ar_and_says_why(fitted):
    with LLM(fitted, device="cpu", progress=False) as llm:
        for p in specfit.prompts(3, seed=8):
            ref = llm.generate(p, SamplingParams(max_tokens=64, ignore_eos=True), spec="off")
            r = llm.generate(p, SamplingParams(max_tokens=64, ignore_eos=True), spec={"mode": "auto", "k": 3})
            assert r.token_ids == ref.token_ids
            assert r.stats["route_reason"].startswith("auto") and r.stats["route"] in ("ar", "mtp", "ngram")
            assert sum(r.stats["routes"].values()) == len(r.token_ids) - 1
        assert llm.engine.costs.get("ar", 0) is not None and llm.engine.accept_prior


def test_sampled_forced_changes_run(fitted):
    """Sampled requests under route changes: valid tokens, as many as asked, seeded reproducible."""
    with LLM(fitted, device="cpu", progress=False) as llm:
        sp = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=4, ignore_eos=True)
        p = specfit.prompts(1, seed=2)[0]
        runs = [list(llm.engine.stream(list(p), sp, SpecPolicy("auto", 3), controller=Forced(SCHEDULES[0])))[-1].result
                for _ in range(2)]
        assert len(runs[0].token_ids) == 40 and runs[0].token_ids == runs[1].token_ids
        assert all(0 <= t < llm.cfg.vocab_size for t in runs[0].token_ids)
