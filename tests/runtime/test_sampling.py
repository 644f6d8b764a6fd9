"""Sampling: the truncated distribution (temperature, top-k, top-p, min-p) against a spelled-out
reference, empirical frequencies, seeded reproducibility, and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from ckpts import tiny
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.runtime.rng import DeviceRng
from specfire.runtime.sampling import pick, probs, sample


def reference_probs(logits: list[float], t: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """The same rule spelled out on Python floats: softmax(l / t) restricted to the top-k logits
    (ties at the k-th kept), then the smallest prefix by probability reaching top_p, then tokens with
    at least min_p times the largest probability; renormalised."""
    v = len(logits)
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(logits, reverse=True)[top_k - 1]
        keep = {i for i in keep if logits[i] >= kth}
    z = {i: math.exp(logits[i] / t) for i in keep}
    s = sum(z.values())
    p = {i: z[i] / s for i in keep}
    if top_p < 1.0:
        order = sorted(p, key=lambda i: -p[i])
        acc, kept = 0.0, set()
        for i in order:
            if acc >= top_p:
                break
            kept.add(i)
            acc += p[i]
        p = {i: p[i] for i in kept}
    if min_p > 0.0:
        m = max(p.values())
        p = {i: q for i, q in p.items() if q >= min_p * m}
    s = sum(p.values())
    return [p.get(i, 0.0) / s for i in range(v)]


LOGITS = [2.0, 1.0, 3.0, -1.0, 0.5, 1.0, -3.0, 2.5]


def support(p: torch.Tensor) -> set[int]:
    return set(torch.nonzero(p > 0).flatten().tolist())


def test_hand_made_supports():
    x = torch.tensor([LOGITS])
    sp = lambda **kw: SamplingParams(temperature=1.0, **kw)  # noqa: E731
    assert support(probs(x, sp())[0]) == set(range(8))
    assert support(probs(x, sp(top_k=1))[0]) == {2}
    assert support(probs(x, sp(top_k=3))[0]) == {2, 7, 0}
    assert support(probs(x, sp(top_k=4))[0]) == {2, 7, 0, 1, 5}      # the tie at the 4th logit is kept
    p = torch.softmax(x[0], -1)
    top2 = float(p[2] + p[7])
    assert support(probs(x, sp(top_p=top2 - 1e-4))[0]) == {2, 7}     # mass reached within two tokens
    assert support(probs(x, sp(top_p=top2 + 1e-4))[0]) == {2, 7, 0}
    assert support(probs(x, sp(top_p=1e-6))[0]) == {2}
    ratio = float(p[0] / p[2])                                         # e^-1
    assert support(probs(x, sp(min_p=ratio - 1e-4))[0]) == {2, 7, 0}
    assert support(probs(x, sp(min_p=ratio + 1e-4))[0]) == {2, 7}
    assert support(probs(x, sp(min_p=1.0))[0]) == {2}


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (2.0, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
    (1.3, 5, 0.9, 0.05), (0.5, 6, 0.95, 0.3), (1.0, 100, 0.5, 0.0),
])
def test_probs_match_reference(t, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(int(t * 100) + top_k)
    rows = [LOGITS] + (torch.randn(3, 37, generator=g) * 3).tolist()
    sp = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    for row in rows:
        ours = probs(torch.tensor([row]), sp)[0]
        ref = torch.tensor(reference_probs(row, t, top_k, top_p, min_p))
        assert support(ours) == support(ref)
        assert torch.allclose(ours, ref.float(), atol=1e-6)
        assert abs(float(ours.sum()) - 1.0) < 1e-5


def test_empirical_frequencies():
    """20,000 draws: tokens outside the support never appear, the rest within 5 sigma."""
    sp = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)
    p = probs(torch.tensor([LOGITS]), sp)
    n = 20_000
    draws = sample(p.expand(n, -1).contiguous(), DeviceRng().seed(1234))
    freq = torch.bincount(draws, minlength=len(LOGITS)).double() / n
    for i, q in enumerate(p[0].double().tolist()):
        if q == 0.0:
            assert freq[i] == 0.0
        else:
            assert abs(freq[i] - q) < 5 * math.sqrt(q * (1 - q) / n) + 1e-9, (i, float(freq[i]), q)


def test_greedy_ignores_truncation():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5, seed=1)
    assert torch.equal(pick(x, sp, None), x.argmax(-1))


# ---- through the LLM ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(ckpt_cache):
    with LLM(tiny(ckpt_cache, "base"), device="cpu", spec="off", progress=False) as m:
        yield m


PROMPT = [5, 17, 99, 3, 42, 8]


def test_seeded_reproducibility(llm, ckpt_cache):
    sp = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = llm.generate(PROMPT, sp)
    llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=99))   # unrelated request between
    b = llm.generate(PROMPT, sp)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    c = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True))
    assert c.token_ids != a.token_ids
    with LLM(tiny(ckpt_cache, "base"), device="cpu", spec="off", progress=False) as other:   # a fresh load
        assert other.generate(PROMPT, sp).token_ids == a.token_ids
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    assert greedy.token_ids == llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=1.0, top_k=1,
                                                                   seed=3, ignore_eos=True)).token_ids


def test_first_token_distribution_through_llm(llm):
    """The first sampled token follows probs() of the prompt's last logits row."""
    sp = SamplingParams(max_tokens=1, temperature=1.5, top_k=20, top_p=0.8, min_p=0.02)
    p = probs(llm.score(PROMPT)[-1:], sp)[0].double()
    n = 400
    counts = torch.zeros_like(p)
    for seed in range(n):
        tok = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=1.5, top_k=20, top_p=0.8,
                                                  min_p=0.02, seed=seed)).token_ids[0]
        counts[tok] += 1
    assert support(counts) <= support(p)
    freq = counts / n
    assert float((freq - p).abs().max()) < 5 * math.sqrt(0.25 / n)


# ---- validation -------------------------------------------------------------------------------

BAD_PARAMS = [
    ("max_tokens", [0, -3, 1.5, True, "8", None]),
    ("temperature", [-0.1, float("nan"), float("inf"), "1", None]),
    ("top_p", [0.0, -0.5, 1.01, float("nan"), "0.9"]),
    ("top_k", [-1, 2.0, "5", None]),
    ("min_p", [-0.01, 1.5, float("nan"), "0.1"]),
    ("seed", [-1, 1.5, "7", True]),
    ("stop", [5, [""], [1, 2], ["ok", None], ""]),
    ("ignore_eos", ["yes", 1, None]),
    # beyond these the float32 penalised logits overflow (inf, then a NaN distribution: token 0)
    ("repetition_penalty", [1e-40, 1e-300, 5e-7, 2e6, 1e39]),
    ("min_tokens", [-1, 1.5, "2", True, None, 65]),       # 65: more than max_tokens (64)
    ("stop_token_ids", [5, [-1], [1.0], [True], "3", None, [1, "2"]]),
    ("include_stop_str_in_output", ["yes", 1, None]),
    ("skip_special_tokens", ["no", 0, None]),
]


@pytest.mark.parametrize("field,values", BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_sampling_params_validation(field, values):
    for v in values:
        with pytest.raises(ValueError, match=rf"^{field} ") as ei:
            SamplingParams(**{field: v})
        assert repr(v) in str(ei.value) or field == "stop" and "stop" in str(ei.value)


def test_sampling_params_accepts_good_values():
    sp = SamplingParams(max_tokens=1, temperature=0.5, top_p=1.0, top_k=0, min_p=1.0, seed=0, stop="x",
                        ignore_eos=True)
    assert sp.stop == ("x",) and not sp.greedy
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc") and SamplingParams().greedy
    sp = SamplingParams(max_tokens=5, min_tokens=5, stop_token_ids=[0, 7], include_stop_str_in_output=True,
                        skip_special_tokens=False)
    assert sp.stop_token_ids == (0, 7) and sp.tracked and not sp.penalized
    assert SamplingParams(repetition_penalty=1e-6).penalized and SamplingParams(repetition_penalty=1e6).tracked
    assert not SamplingParams().tracked
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(3\), got 4$"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match=r"^repetition_penalty must be in \[1e-06, 1e\+06\]"):
        SamplingParams(repetition_penalty=1e-40)


# ---- parameters at the edge of float32 ---------------------------------------------------------------

@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-39, 1e-12])
def test_tiny_top_p_keeps_the_top_token(top_p):
    """top_p below float32's smallest value compared as 0, so every token was dropped and the
    distribution was NaN (sampled: token 0, "!!!!"). The smallest set reaching a tiny top_p is the
    most likely token alone."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor([LOGITS]), torch.randn(4, 8, generator=g) * 3])
    sp = SamplingParams(temperature=1.0, top_p=top_p)
    p = probs(x, sp)
    assert torch.equal(p, torch.nn.functional.one_hot(x.argmax(-1), 8).float())
    for row in x.tolist():
        assert support(torch.tensor(reference_probs(row, 1.0, 0, top_p, 0.0))) == {max(range(8), key=row.__getitem__)}
    assert torch.equal(pick(x, sp, DeviceRng().seed(3)), x.argmax(-1))


@pytest.mark.parametrize("rp", [1e-6, 1e6])
def test_extreme_repetition_penalties_stay_finite(rp):
    """At the ends of the allowed range the penalised logits are finite, so the sampled
    distribution is the one the penalty means (not NaN): a tiny penalty makes the largest positive
    logit among the seen ids win."""
    from specfire.runtime.sampling import Penalties, penalize

    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 40, generator=g) * 30
    seen = [1, 2, 3, 4, 5]
    pen = Penalties(40, "cpu").begin(torch.tensor(seen))
    sp = SamplingParams(temperature=1.0, repetition_penalty=rp)
    y = penalize(x, pen, sp)
    p = probs(y, sp)
    assert torch.isfinite(y).all() and torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))
    for r in range(3):
        pos_seen = [i for i in seen if x[r, i] > 0]
        if rp < 1 and pos_seen:
            assert int(p[r].argmax()) == max(pos_seen, key=lambda i: float(x[r, i]))
            assert float(p[r].max()) > 0.999
        for i in range(40):
            want = (x[r, i] / rp if x[r, i] > 0 else x[r, i] * rp) if i in seen else x[r, i]
            assert torch.isclose(y[r, i], want, rtol=1e-6), (r, i)


def test_tiny_top_p_through_llm_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    for top_p in (1e-300, 1e-40):
        sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=top_p, seed=4, ignore_eos=True)
        assert llm.generate(PROMPT, sp).token_ids == greedy


@pytest.mark.parametrize("kw,pattern", [
    ({"mode": "fast"}, r"spec\.mode must be one of off, auto, mtp, ngram, got 'fast'"),
    ({"k": 0}, r"spec\.k must be >= 1, got 0"), ({"k": 11}, r"spec\.k must be <= 10, got 11"),
    ({"k": 2.5}, r"spec\.k must be an integer, got 2\.5"),
])
def test_spec_policy_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        SpecPolicy(**kw)
    with pytest.raises(ValueError, match=r"unknown field"):
        SpecPolicy.coerce({"mode": "off", "depth": 3})
