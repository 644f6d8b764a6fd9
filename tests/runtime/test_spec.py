"""Greedy speculative decoding is exactly AR decoding (float32, CPU), whatever gets accepted.

Three kinds of drafter drive the shared step: the model's MTP head (random on the random configs,
fitted on the fitted model), n-gram lookup, and a scripted drafter that proposes AR's own
continuation with a chosen number of right tokens per cycle, which makes zero-accept, partial and
all-accept cycles, EOS and stop strings inside accepted drafts happen on purpose.
"""
from __future__ import annotations


import pytest
import torch

import specfit
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.runtime.drafters import HostDrafter
from ckpts import tiny
from tinymodels import CONFIGS


def ckpt(cache, name: str) -> str:
    return tiny(cache, name)



def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=kw.pop("ignore_eos", True), **kw)


def random_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 2, 7, 19, 33][:n] + [5] * max(0, n - 5)
    return [torch.randint(0, vocab - 1, (L,), generator=g).tolist() for L in lens]


class Scripted(HostDrafter):
    """A drafter that proposes the known AR continuation `ref` (token i at position plen + i),
    right for the first `right` drafts of every cycle and wrong after that."""

    name = "scripted"

    def __init__(self, plen: int, ref: list[int], right: int, vocab: int):
        self.plen, self.ref, self.right, self.vocab = plen, ref, right, vocab

    def begin(self, prompt, hidden) -> None:
        assert prompt.shape[0] == self.plen

    def propose(self, last, pos, k, sp, gen, pen=None):
        out = []
        for j in range(k):
            i = pos + 1 + j - self.plen
            t = self.ref[i] if i < len(self.ref) else 0
            out.append(t if j < self.right else (t + 1) % self.vocab)
        return torch.tensor(out, dtype=torch.long), None

    def commit(self, out, hidden, out_dev=None) -> None:
        pass


class Steps:
    """An `on_cycle` hook: every step's (drafted, accepted) and emitted tokens, in order."""

    def __init__(self):
        self.steps: list[tuple[int, int, list[int]]] = []

    def __call__(self, k: int, n: int, out: list[int]) -> None:
        self.steps.append((k, n, list(out)))

    def clear(self) -> None:
        self.steps.clear()

    @property
    def cycles(self) -> list[tuple[int, int]]:
        """The speculative cycles (steps that drafted something) as (drafted, accepted)."""
        return [(k, n) for k, n, _ in self.steps if k]

    @property
    def emitted(self) -> list[list[int]]:
        return [out for _, _, out in self.steps]


def scripted(llm: LLM, p: list[int], sp: SamplingParams, k: int, drafter: Scripted, on_cycle=None):
    """The stream chunks of a request served by `drafter` (given to the engine, not routed)."""
    return list(llm.engine.stream(list(p), sp, SpecPolicy("auto", k), on_cycle=on_cycle, drafter=drafter))


# ---- equality on random models --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_mtp_and_ngram_equal_ar(ckpt_cache, name):
    path = ckpt(ckpt_cache, name)
    with LLM(path, device="cpu", spec="auto", progress=False) as llm:
        assert llm.mtp_loaded
        v = llm.cfg.vocab_size
        for j, p in enumerate(random_prompts(v, 3, seed=sorted(CONFIGS).index(name))):
            ref = llm.generate(p, greedy(20), spec="off")
            assert ref.stats["route"] == "ar" and len(ref.token_ids) == 20
            for k in (range(1, 7) if j == 0 else (2, 5)):
                r = llm.generate(p, greedy(20), spec={"mode": "mtp", "k": k})
                assert r.stats["route"] == "mtp"
                assert r.token_ids == ref.token_ids, (name, p, k)
            rep = (p * 4)[:40]              # a repetitive prompt gives n-gram something to propose
            ref2 = llm.generate(rep, greedy(20), spec="off")
            for k in ((1, 4, 6) if j == 0 else (3,)):
                r = llm.generate(rep, greedy(20), spec={"mode": "ngram", "k": k})
                assert r.token_ids == ref2.token_ids, (name, rep, k)


@pytest.mark.parametrize("name", ["base", "mix", "gqa4"])
def test_scripted_accept_patterns(ckpt_cache, name):
    """Zero, partial and all-accepted cycles, for every count of right drafts per cycle."""
    path = ckpt(ckpt_cache, name)
    with LLM(path, device="cpu", spec="off", progress=False) as llm:
        v = llm.cfg.vocab_size
        p = random_prompts(v, 3, seed=5)[2]
        ref = llm.generate(p, greedy(24)).token_ids
        for k in (1, 3, 6):
            for right in range(0, k + 1):
                watch = Steps()
                r = scripted(llm, p, greedy(24), k, Scripted(len(p), ref, right, v), watch)[-1].result
                cycles = watch.cycles
                assert r.stats["route"] == "scripted" and r.token_ids == ref, (k, right)
                # (the last cycle drafts k whatever is left: past the reference none is right)
                assert cycles and all(n == min(right, d) for d, n in cycles[:-1]), (k, right, cycles)
                assert cycles[-1][1] <= min(right, cycles[-1][0]), (k, right, cycles)
                assert r.stats["accepted"] == sum(n for _, n in cycles)
                assert r.stats["cycles"] == len(cycles)


# ---- the fitted model: drafts really get accepted ----------------------------------------------

def test_fitted_mtp_accepts_and_equals_ar(fitted):
    with LLM(fitted, device="cpu", progress=False) as llm:
        assert llm.spec.mode == "auto" and llm.mtp_loaded
        for k in range(1, 7):
            watch = Steps()
            acc = 0
            for p in specfit.prompts(4, seed=7):
                ref = llm.generate(p, greedy(32), spec="off")
                r = llm.generate(p, greedy(32), spec={"mode": "mtp", "k": k}, on_cycle=watch)
                assert r.token_ids == ref.token_ids, (k, p)
                assert r.stats["route"] == "mtp"
                acc += r.stats["accepted"]
            assert acc > 0, k
            cycles = watch.cycles
            full = sum(n == d == k for d, n in cycles)
            if k <= 2:  # the head is fitted for step 1 only, so long all-right chains are rare (a few
                # % at k=3); all-accepted cycles at larger k come from n-gram and the scripted drafter
                assert full > 0, f"no all-accepted cycle at k={k}: {cycles}"
            if k >= 2:
                assert any(n < d for d, n in cycles), f"no rejection at k={k}"


def test_fitted_ngram_accepts_and_equals_ar(fitted):
    with LLM(fitted, device="cpu", spec="off", progress=False) as llm:
        for k in (1, 3, 6):
            watch = Steps()
            for p in specfit.prompts(4, length=16, seed=9):
                ref = llm.generate(p, greedy(40))
                r = llm.generate(p, greedy(40), spec={"mode": "ngram", "k": k}, on_cycle=watch)
                assert r.token_ids == ref.token_ids
                assert r.stats["route"] == "ngram" and r.stats["mean_accept_len"] > 1.5
            assert any(n == d == k for d, n in watch.cycles)


def test_requests_do_not_leak_state(fitted):
    """One LLM, speculation switched between requests (and a sampled request in between): every
    greedy output equals that of a freshly loaded model decoding AR."""
    plan = [("off", 3, 20), ("mtp", 4, 30), ("ngram", 3, 25), ("mtp", 1, 9), ("auto", 6, 31),
            ("off", 3, 12), ("ngram", 6, 40), ("mtp", 6, 17), ("mtp", 2, 33)]
    prompts = specfit.prompts(len(plan), seed=11)
    prompts[3] = prompts[3][:1]
    refs = []
    for p, (_, _, n) in zip(prompts, plan):
        with LLM(fitted, device="cpu", spec="off", progress=False) as fresh:
            refs.append(fresh.generate(p, greedy(n)).token_ids)
    with LLM(fitted, device="cpu", spec={"mode": "mtp", "k": 3}, progress=False) as llm:
        for i, (p, (mode, k, n)) in enumerate(zip(prompts, plan)):
            r = llm.generate(p, greedy(n), spec={"mode": mode, "k": k})
            assert r.token_ids == refs[i], (i, mode, k)
            llm.generate(prompts[-1 - i], SamplingParams(max_tokens=7, temperature=0.9, seed=i),
                         spec={"mode": ["mtp", "ngram", "off"][i % 3], "k": 5})
        # the load-time default applies when the request names no policy
        r = llm.generate(prompts[0], greedy(20))
        assert r.stats["route"] == "mtp" and r.stats["k"] == 3 and r.token_ids == refs[0]


# ---- where the output ends ------------------------------------------------------------------

def test_eos_inside_accepted_drafts(ckpt_cache, tmp_path):
    base = ckpt(ckpt_cache, "base")
    with LLM(base, device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
        p = random_prompts(v, 3, seed=3)[1]
        ref = llm.generate(p, greedy(30), spec="off").token_ids
    firsts = [i for i in range(1, 30) if ref[i] not in ref[:i] and ref[i] != v - 1]
    inside = [i for i in firsts if (i - 1) % 7 != 6][:4]      # with k = 6 all right, cycles cover 1+7c..7+7c
    assert inside
    for i in inside:
        path = specfit.variant(base, str(tmp_path / f"eos{i}"), eos=ref[i])
        with LLM(path, device="cpu", progress=False) as llm:
            a = llm.generate(p, SamplingParams(max_tokens=30), spec="off")
            assert a.token_ids == ref[:i + 1] and a.finish_reason == "stop"
            watch = Steps()
            s = scripted(llm, p, SamplingParams(max_tokens=30), 6, Scripted(len(p), ref, 6, v), watch)[-1].result
            assert s.token_ids == a.token_ids and s.finish_reason == "stop"
            last = watch.emitted[-1]
            assert ref[i] in last[:-1], "the EOS should sit inside the accepted drafts, not be the bonus"
            m = llm.generate(p, SamplingParams(max_tokens=30), spec={"mode": "mtp", "k": 6})
            assert m.token_ids == a.token_ids and m.finish_reason == "stop"


def test_eos_inside_mtp_drafts_fitted(fitted, tmp_path):
    with LLM(fitted, device="cpu", progress=False) as llm:
        p = specfit.prompts(1, seed=13)[0]
        ref = llm.generate(p, greedy(40), spec="off").token_ids
    hit = 0
    for i in [i for i in range(1, 12) if ref[i] not in ref[:i]]:
        path = specfit.variant(fitted, str(tmp_path / f"eos{i}"), eos=ref[i])
        with LLM(path, device="cpu", progress=False) as llm:
            a = llm.generate(p, SamplingParams(max_tokens=40), spec="off")
            watch = Steps()
            m = llm.generate(p, SamplingParams(max_tokens=40), spec={"mode": "mtp", "k": 4}, on_cycle=watch)
            assert a.token_ids == ref[:i + 1] and a.finish_reason == "stop"
            assert m.token_ids == a.token_ids and m.finish_reason == "stop"
            hit += ref[i] in watch.emitted[-1][:-1]
    assert hit > 0, "no EOS fell inside accepted MTP drafts"


def test_stop_string_inside_accepted_drafts(ckpt_cache, tmp_path):
    base = ckpt(ckpt_cache, "base")
    path = specfit.variant(base, str(tmp_path / "tok"), tokenizer=True)
    with LLM(path, device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
        p = random_prompts(v, 3, seed=4)[2]
        ref = llm.generate(p, greedy(30), spec="off")
        text = ref.text
        assert len(text) == 30                          # one character per token
        done = 0
        for i in range(3, 28):
            stop = text[i:i + 2]
            if text.find(stop) != i or i % 7 == 6:   # token i+1 completes it: not a cycle's bonus
                continue
            sp = SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True)
            a = llm.generate(p, sp, spec="off")
            assert a.text == text[:i] and a.finish_reason == "stop"
            watch = Steps()
            chunks = scripted(llm, p, sp, 6, Scripted(len(p), ref.token_ids, 6, v), watch)
            s = chunks[-1].result
            assert (s.text, s.token_ids, s.finish_reason) == (a.text, a.token_ids, a.finish_reason)
            assert "".join(c.text for c in chunks) == a.text
            assert len(watch.emitted[-1]) == 7 and a.token_ids[-1] in watch.emitted[-1][:-1]
            m = llm.generate(p, sp, spec={"mode": "mtp", "k": 5})
            assert (m.text, m.token_ids, m.finish_reason) == (a.text, a.token_ids, a.finish_reason)
            done += 1
            if done == 3:                                   # three stop positions are enough
                break
        assert done >= 2


def test_max_tokens_mid_cycle_keeps_k(ckpt_cache):
    """With every draft right, a cycle emits k+1 tokens; the last cycle still drafts k whatever is
    left (every verify of the request keeps k+1 rows) and the output stops at max_tokens exactly
    (the first token comes from the prefill)."""
    base = ckpt(ckpt_cache, "base")
    with LLM(base, device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
        p = random_prompts(v, 3, seed=6)[1]
        ref = llm.generate(p, greedy(16), spec="off").token_ids
        for k in (3, 6, 10):
            for m in sorted({1, 2, k - 1, k, k + 1, k + 2, 2 * k + 1, 16} & set(range(1, 17))):
                watch = Steps()
                r = scripted(llm, p, greedy(m), k, Scripted(len(p), ref, k, v), watch)[-1].result
                rows = [d + 1 for d, _, _ in watch.steps]       # each step verifies its drafts + 1 row
                assert r.token_ids == ref[:m] and r.finish_reason == "length"
                assert rows == [k + 1] * -(-(m - 1) // (k + 1)), (k, m, rows)
                r = llm.generate(p, greedy(m), spec={"mode": "mtp", "k": k})
                assert r.token_ids == ref[:m]


def test_first_token_goes_out_before_the_drafter_begins(ckpt_cache):
    """The first token (the prefill's) is streamed before the drafter catches up on the prompt, and
    a request that ends at its first token never begins the drafter; the output is the same."""
    base = ckpt(ckpt_cache, "base")
    with LLM(base, device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
        p = random_prompts(v, 3, seed=8)[0]
        ref = llm.generate(p, greedy(6), spec="off").token_ids

        class Recording(Scripted):
            def __init__(self, *a):
                super().__init__(*a)
                self.begun_after: list[int] = []      # tokens streamed when begin was called

            def begin(self, prompt, hidden) -> None:
                super().begin(prompt, hidden)
                self.begun_after.append(len(streamed))

        streamed: list[int] = []
        d = Recording(len(p), ref, 2, v)
        for chunk in llm.engine.stream(list(p), greedy(6), SpecPolicy("auto", 2), drafter=d):
            streamed += chunk.token_ids
        assert streamed == ref and d.begun_after == [1]
        streamed = []
        d = Recording(len(p), ref, 2, v)
        chunks = list(llm.engine.stream(list(p), greedy(1), SpecPolicy("auto", 2), drafter=d))
        assert [t for c in chunks for t in c.token_ids] == ref[:1] and d.begun_after == []
        assert chunks[-1].result.token_ids == ref[:1] and len(chunks) == 1     # one final chunk, as before


def test_context_limit_clamps_k(ckpt_cache):
    base = ckpt(ckpt_cache, "base")
    with LLM(base, device="cpu", max_seq_len=24, progress=False) as llm:
        p = random_prompts(llm.cfg.vocab_size, 4, seed=8)[3][:17]
        ref = llm.generate(p, greedy(50), spec="off")
        assert len(ref.token_ids) == 24 - 17 and ref.finish_reason == "length"
        for mode in ("mtp", "ngram"):
            r = llm.generate(p, greedy(50), spec={"mode": mode, "k": 6})
            assert r.token_ids == ref.token_ids and r.finish_reason == "length"


# ---- stats ------------------------------------------------------------------------------------

def test_stats_fields(fitted):
    with LLM(fitted, device="cpu", progress=False) as llm:
        p = specfit.prompts(1, seed=21)[0]
        r = llm.generate(p, greedy(40), spec={"mode": "mtp", "k": 3})
        st = r.stats
        assert st["route"] == "mtp" and "MTP" in st["route_reason"] and st["k"] == 3
        assert st["prompt_tokens"] == len(p) and st["generated_tokens"] == len(r.token_ids) == 40
        assert st["cycles"] > 0 and 0 < st["accepted"] <= st["drafted"] <= 3 * st["cycles"]
        assert st["mean_accept_len"] == pytest.approx(1 + st["accepted"] / st["cycles"])
        # every cycle emits accepted + 1 tokens, the prefill the first; the last cycle drafts k
        # whatever is left, and what it accepts past max_tokens is not emitted
        assert 0 <= st["cycles"] + st["accepted"] - (st["generated_tokens"] - 1) <= 3
        app = st["accept_per_pos"]
        assert len(app) == 3 and all(0 <= a <= 1 for a in app)
        assert st["prefill_s"] > 0 and st["decode_s"] > 0
        assert st["prefill_tok_s"] == pytest.approx(len(p) / st["prefill_s"])
        assert st["decode_tok_s"] == pytest.approx(39 / st["decode_s"])
        a = llm.generate(p, greedy(40), spec="off").stats
        assert a["route"] == "ar" and a["cycles"] == a["drafted"] == a["accepted"] == 0 and a["accept_per_pos"] == []


# ---- n-gram lookup ----------------------------------------------------------------------------

def scan_reference(ctx: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The plain quadratic scan: latest earlier occurrence of the longest suffix n-gram, and the k
    tokens after it, copied one at a time onto the sequence (a follower that reaches its end goes
    on into the copies: the repeat continued)."""
    L = len(ctx)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pat = ctx[L - n:]
        for i in range(L - n - 1, -1, -1):
            if ctx[i:i + n] == pat:
                seq = list(ctx)
                for j in range(i + n, i + n + k):
                    seq.append(seq[j])
                return seq[L:]
    return []


def test_ngram_match_drafts_k_continuing_the_repeat():
    """Every match drafts k tokens (a request's verifies keep one row count): a follower cut by
    the end of the context goes on as the repeat it matched."""
    from specfire.runtime.drafters import NgramDrafter

    d = NgramDrafter(1, 3)
    d.begin(torch.tensor([9, 1, 2, 3, 1, 2]), None)
    d.commit([3], None)                                  # ... 1 2 3 1 2 3: "1 2 3" recurs, its follower is "1 2 3"
    assert d.propose(3, 7, 5, SamplingParams(), None)[0].tolist() == [1, 2, 3, 1, 2]
    d.commit([1], None)                                  # suffix "2 3 1" last seen at 2, followed by "2 3 1"
    assert d.propose(1, 8, 4, SamplingParams(), None)[0].tolist() == [2, 3, 1, 2]


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 4), (2, 3), (3, 6)])
def test_ngram_index_matches_scan(n_min, n_max):
    from specfire.runtime.drafters import NgramDrafter

    g = torch.Generator().manual_seed(n_min * 10 + n_max)
    sp = SamplingParams()
    for trial in range(20):
        vocab = 3 + trial % 5
        prompt = torch.randint(0, vocab, (1 + trial * 3,), generator=g)
        d = NgramDrafter(n_min, n_max)
        d.begin(prompt, None)
        ctx = prompt.tolist()
        last = int(torch.randint(0, vocab, (), generator=g))
        d.commit([last], None)                            # every token reaches the drafter through commit
        for _ in range(15):
            k = int(torch.randint(0, 7, (), generator=g))
            draft, q = d.propose(last, len(ctx), k, sp, None)
            assert q is None and draft.dtype == torch.long
            draft = draft.tolist()
            assert draft == (scan_reference(ctx + [last], k, n_min, n_max) if k > 0 else [])
            n = int(torch.randint(0, len(draft) + 1, (), generator=g))
            out = draft[:n] + [int(torch.randint(0, vocab, (), generator=g))]
            d.commit(out, None)
            ctx += [last] + out[:-1]
            last = out[-1]
        assert d.tokens == ctx + [last]


def test_ngram_sizes_validated():
    from specfire.runtime.drafters import NgramDrafter

    with pytest.raises(ValueError, match="n_min"):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError, match="n_max"):
        NgramDrafter(4, 2)
    with pytest.raises(ValueError, match="n_max"):
        NgramDrafter(1, 2.5)


def test_ngram_long_context_is_fast():
    """Proposals cost the same at 60k tokens of context as at 100 (no scan of the context)."""
    import time

    from specfire.runtime.drafters import NgramDrafter

    g = torch.Generator().manual_seed(0)
    d = NgramDrafter(1, 4)
    d.begin(torch.randint(0, 50_000, (60_000,), generator=g), None)
    t = time.perf_counter()
    for i in range(500):
        draft, _ = d.propose(i, 60_000 + i, 4, SamplingParams(), None)
        d.commit([7], None)
    assert (time.perf_counter() - t) / 500 < 2e-3


def test_mtp_feed_variants_are_exact_and_differ(fitted):
    """Both self-feeds (after / before mtp.norm) keep greedy output exact; they draft differently;
    the default is the better measured one ('pre', see MtpDrafter)."""
    from specfire.runtime.drafters import MtpDrafter

    with LLM(fitted, device="cpu", progress=False) as llm:
        drafter = llm.engine.drafters["mtp"]
        assert drafter.feed == "pre"
        drafts: dict[str, list] = {}
        orig = drafter.propose

        def propose(*a):
            out = orig(*a)
            drafts[drafter.feed].append(out[0].tolist())
            return out
        drafter.propose = propose
        for feed in ("post", "pre"):
            drafter.feed = feed
            drafts[feed] = []
            for p in specfit.prompts(6, seed=17):
                ref = llm.generate(p, greedy(32), spec="off")
                r = llm.generate(p, greedy(32), spec={"mode": "mtp", "k": 4})
                assert r.token_ids == ref.token_ids, feed
        assert drafts["pre"] != drafts["post"]
        with pytest.raises(ValueError, match="feed"):
            MtpDrafter(drafter.head, llm.engine.trunk, torch.float32, feed="mid")


def test_ngram_sizes_reach_the_drafter_and_are_validated(ckpt_cache):
    path = ckpt(ckpt_cache, "base")
    with LLM(path, device="cpu", ngram=(2, 3)) as llm:
        d = llm.engine.drafters["ngram"]
        assert (d.n_min, d.n_max) == (2, 3)
        ids = list(range(5, 25)) * 3
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        assert llm.generate(ids, sp, spec="ngram").token_ids == llm.generate(ids, sp, spec="off").token_ids
    for bad in [(0, 2), (3, 2), (1,), "1:4", (1.0, 2)]:
        with pytest.raises(ValueError, match="ngram"):
            LLM(path, device="cpu", ngram=bad)
