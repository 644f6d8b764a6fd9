"""A reduced draft vocabulary (`LLM(path, draft_vocab=N)`): the MTP drafter scores token ids 0..N-1
only, the verify the whole vocabulary, so greedy output stays AR's and sampled output keeps AR's
distribution.

The fitted model (tests/specfit.py) speaks an alphabet of 12 token ids between 14 and 119 that its
MTP head predicts well: with N = 14 no alphabet id is inside the draft vocabulary, so a chain that
scored any row past N would draft (and get accepted) alphabet ids; with N = 120 all are inside and
the drafts are accepted as with the whole vocabulary.
"""
from __future__ import annotations


import pytest
import torch

import specfit
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.kernels import gemv as linear_mod
from specfire.runtime import spec as spec_mod
from specfire.runtime.graphs import DraftGraphs
from specfire.runtime.rng import DeviceRng
from specfire.runtime.sampling import probs
from test_spec_sampled import BINS, chi2, chi2_critical, pit_chi2

ALPHA_MIN, ALPHA_MAX = 14, 119          # the fitted model's alphabet (specfit._rule, vocab 131)


def run(llm, graphs: bool, k: int = 3, n: int = 24):
    """Greedy MTP k over the fitted prompts (drafts recorded), eager or with the chain in emulated graphs."""
    d = llm.engine.drafters["mtp"]
    d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
    _, calls = specfit.spy_drafts(llm)
    out, acc = [], 0
    try:
        for p in specfit.prompts(3, seed=7):
            r = llm.generate(p, SamplingParams(max_tokens=n, ignore_eos=True), spec={"mode": "mtp", "k": k})
            out.append(r.token_ids)
            acc += r.stats["accepted"]
    finally:
        d.graphs = None
        del d.propose
    return out, acc, [t for c in calls for t in c]


def test_checked_at_load(fitted):
    with LLM(fitted, device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
    for bad in (0, -3, v + 1, 1.5, True, "64"):
        with pytest.raises(ValueError, match=rf"draft_vocab must be an integer in 1\.\.{v} .*got {bad!r}"):
            LLM(fitted, device="cpu", progress=False, draft_vocab=bad)
    with LLM(fitted, device="cpu", progress=False, draft_vocab=v) as llm:       # the whole vocabulary: off
        assert llm.draft_vocab is None and llm.engine.trunk.draft_vocab is None


def test_greedy_mtp_equals_ar_and_drafts_stay_below_n(fitted):
    with LLM(fitted, device="cpu", progress=False) as full:
        ar = [full.generate(p, SamplingParams(max_tokens=24, ignore_eos=True), spec="off").token_ids
              for p in specfit.prompts(3, seed=7)]
        whole, acc_whole, _ = run(full, False)
    assert whole == ar and acc_whole > 0
    for n in (1, ALPHA_MIN, 69, ALPHA_MAX + 1):
        with LLM(fitted, device="cpu", progress=False, draft_vocab=n) as llm:
            assert "draft_vocab=%d" % n in llm.preview_route(SamplingParams(), "mtp")[1]
            for graphs in (False, True):
                out, acc, drafts = run(llm, graphs)
                assert out == ar, (n, graphs)
                assert drafts and max(drafts) < n, (n, graphs, sorted(set(drafts)))
                if n <= ALPHA_MIN:
                    assert acc == 0, (n, graphs)         # no alphabet id can be drafted
                if n > ALPHA_MAX:
                    assert acc == acc_whole, (n, graphs)  # every id the head predicts is inside


def test_the_chain_reads_only_the_first_n_rows_of_the_lm_head(fitted, monkeypatch):
    """Every product over the lm_head's storage during a draft chain has N columns (one CPU device:
    a column view of the cached W^T), and a greedy chain's logits are [1, N]."""
    n = 69
    with LLM(fitted, device="cpu", progress=False, draft_vocab=n) as llm:
        lm_t = linear_mod.transposed(llm.engine.trunk.model.lm_weight)
        widths, real = [], linear_mod.linear_one_cpu

        chain = [False]

        def spy(x, wt, rows):
            if chain[0] and wt.untyped_storage().data_ptr() == lm_t.untyped_storage().data_ptr():
                widths.append(wt.shape[1])
            return real(x, wt, rows)
        monkeypatch.setattr(linear_mod, "linear_one_cpu", spy)
        d = llm.engine.drafters["mtp"]
        propose = d.propose

        def in_chain(*a):
            chain[0] = True
            try:
                return propose(*a)
            finally:
                chain[0] = False
        d.propose = in_chain
        shapes, lm = [], llm.engine.trunk.lm_logits
        llm.engine.trunk.lm_logits = lambda h: shapes.append(tuple(lm(h).shape)) or lm(h)
        r = llm.generate(specfit.prompts(1, seed=7)[0], SamplingParams(max_tokens=12, ignore_eos=True),
                         spec={"mode": "mtp", "k": 3})
    assert r.stats["cycles"] > 0
    assert widths and set(widths) == {n}         # the trunk's own logits (prefill, verify) are not in a chain
    assert shapes and set(shapes) == {(1, n)}


# ---- sampled: the accept rule with a q of N < V columns, and end to end -----------------------

def narrow_accept_stats(rule, trials: int = 4000):
    g = torch.Generator().manual_seed(0)
    v, k, n = 7, 2, 4
    sp = SamplingParams(temperature=1.0)
    logits = torch.randn(k + 1, v, generator=g) * 1.5
    p = probs(logits, sp)
    q = torch.softmax(torch.randn(k, n, generator=g) * 1.5, -1)         # the draft's: ids 0..n-1 only
    first, second = torch.zeros(v), torch.zeros(v)
    gen = torch.Generator().manual_seed(1)
    rng = DeviceRng().seed(1)
    for _ in range(trials):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        n_acc, out = rule(logits, draft, q, sp, rng)
        assert len(out) == n_acc + 1 and out[:n_acc] == draft[:n_acc]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return chi2(first, p[0] * trials), chi2(second, p[1] * second.sum()), chi2_critical(v - 1)


def residual_inside_n_only(logits, draft, q, sp, rng):
    """A wrong rule: on rejection, resample from max(0, p - q) over the draft vocabulary only."""
    p = probs(logits, sp)
    gen = torch.Generator().manual_seed(5 + len(draft))
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=gen)) < float(p[i, d]) / float(q[i, d]):
            continue
        r = torch.zeros_like(p[i])
        r[:q.shape[1]] = (p[i, :q.shape[1]] - q[i]).clamp_min(0)
        return i, list(draft[:i]) + [int(torch.multinomial(r, 1, generator=gen))]
    return len(draft), list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def test_accept_rule_with_a_narrow_q_preserves_the_target():
    c1, c2, crit = narrow_accept_stats(spec_mod.accept)
    assert c1 < crit and c2 < crit, (c1, c2, crit)
    c1, c2, crit = narrow_accept_stats(residual_inside_n_only)   # the check has teeth
    assert max(c1, c2) > crit, (c1, c2, crit)


def test_sampled_mtp_with_draft_vocab_matches_ar_distribution(tiny_vocab, monkeypatch):
    widths, real = [], spec_mod.accept_device

    def spy(logits, draft, q, sp, rng):
        if q is not None:
            widths.append(q.shape[-1])
        return real(logits, draft, q, sp, rng)
    monkeypatch.setattr(spec_mod, "accept_device", spy)
    with LLM(tiny_vocab, device="cpu", progress=False, draft_vocab=5) as llm:
        c, acc = pit_chi2(llm, "mtp", dict(temperature=0.9, top_k=6))
    assert acc["cycles"] > 0 and acc["accepted"] > 0 and acc["outside"] == 0, acc
    assert widths and set(widths) == {5}
    assert c < chi2_critical(BINS - 1), c


# ---- the tensor-parallel mesh (gloo, 2 ranks) ------------------------------------------------------

@pytest.fixture(scope="module")
def canonical_ar(fitted) -> list[list[int]]:
    """One device's greedy AR outputs of the fitted prompts with tp_invariant (what a mesh
    reproduces), computed once for the mesh cases."""
    with LLM(fitted, device="cpu", progress=False, tp_invariant=True) as one:
        return [one.generate(p, SamplingParams(max_tokens=24, ignore_eos=True), spec="off").token_ids
                for p in specfit.prompts(3, seed=7)]


@pytest.mark.parametrize("n", [ALPHA_MIN, 69], ids=["inside_rank0", "both_ranks"])
def test_mesh_draft_vocab_equals_ar(fitted, canonical_ar, n):
    """Greedy MTP on tp2 with sharded picks asked for: N = 14 lies in rank 0's shard (66 rows) and
    needs no pick collective (the trunk does not shard the picks); N = 69 has rank 1 score its rows
    66..68 only (alphabet ids 81..119 lie in its shard past N: a rank scoring its whole shard would
    draft them)."""
    ar = canonical_ar
    with LLM(fitted, tp=2, device="cpu", progress=False, draft_vocab=n, tp_invariant=True) as mesh:
        trunk = mesh.engine.trunk
        assert not trunk.draft_sharded                  # the CPU default: rank 0's whole copy
        trunk.draft_sharded = True
        assert trunk.draft_sharded == (n > trunk._local.model.plan.vocab_shard)
        out, acc, drafts = run(mesh, False)
        assert out == ar and drafts and max(drafts) < n
        assert (acc == 0) if n <= ALPHA_MIN else (acc > 0)
        s = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
        r = mesh.generate(specfit.prompts(1, seed=7)[0], s, spec=SpecPolicy("mtp", 3))
        assert len(r.token_ids) == 10
