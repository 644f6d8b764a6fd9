"""Repetition, presence and frequency penalties (vLLM's semantics), and speculation staying exact
with them on.

* `penalize` against a plain per-token reference, verify rows included (row i counts the drafts
  before it);
* greedy MTP and n-gram speculation equal AR token for token with each penalty, on the tiny random
  models, the fitted model and the bundled model; penalising every verify row with the counts of
  row 0 (the tempting shortcut) breaks that equality, so the checks have teeth;
* sampled speculation draws from the penalised AR distribution (the PIT check of
  test_spec_sampled.py, the reference distribution built by the plain reference);
* counts do not carry over from one request to the next; the sampled accept runs eagerly (not
  from its graph) with penalties, and says so;
* validation of the fields; the HTTP server and its defaults (the daemon is in test_daemon.py, the
  mesh in test_tp.py, the CLI flags in test_cli.py).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import specfit
from ckpts import tiny
from specfire import LLM, SamplingParams
from specfire.runtime import spec as spec_mod
from specfire.runtime.sampling import Penalties, penalize, penalize_draft
from test_spec_sampled import BINS, chi2_critical
from test_spec_sampled import pit_chi2 as spec_sampled_pit_chi2

SETTINGS = {
    "rep1.3": dict(repetition_penalty=1.3),
    "rep0.8": dict(repetition_penalty=0.8),
    "freq0.7": dict(frequency_penalty=0.7),
    "pres1.1": dict(presence_penalty=1.1),
    "mixed": dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.3),
}


def penalize_ref(row: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams) -> torch.Tensor:
    """One row of logits, token by token (float64): the definition written plainly."""
    x = row.double().clone()
    c = Counter(out)
    for v in range(x.shape[0]):
        if (v in prompt or c[v] > 0) and sp.repetition_penalty != 1.0:
            x[v] = x[v] / sp.repetition_penalty if x[v] > 0 else x[v] * sp.repetition_penalty
        x[v] -= sp.frequency_penalty * c[v] + sp.presence_penalty * (c[v] > 0)
    return x


# ---- the function ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_penalize_matches_reference(name):
    sp = SamplingParams(**SETTINGS[name])
    g = torch.Generator().manual_seed(3)
    v, k = 37, 4
    for trial in range(4):
        logits = torch.randn(k + 1, v, generator=g) * 3
        logits[:, :3] = 0.0                                     # exact zeros take the "negative" branch
        prompt = torch.randint(0, v, (6,), generator=g).tolist()
        out = torch.randint(0, v, (9,), generator=g).tolist()
        draft = torch.randint(0, v, (k,), generator=g)
        draft[1] = draft[0]                                     # a repeated draft counts twice in later rows
        pen = Penalties(v, "cpu").begin(torch.tensor(prompt))
        pen.add(torch.tensor(out))
        got = penalize(logits, pen, sp, draft)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        for i in range(k + 1):
            ref = penalize_ref(logits[i], prompt, out + draft[:i].tolist(), sp)
            torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-6)
        one = penalize(logits[:1], pen, sp)                     # an AR step's row: the same bits as row 0
        assert torch.equal(one[0], got[0])


def test_penalize_neutral_and_counts():
    logits = torch.randn(3, 10)
    pen = Penalties(10, "cpu").begin(torch.tensor([1, 2]))
    assert penalize(logits, pen, SamplingParams(), torch.tensor([1, 2])) is logits
    assert penalize(logits, None, SamplingParams(repetition_penalty=2.0)) is logits
    pen.add(torch.tensor([4, 4, 7, 9]), torch.tensor(2))       # a step that accepted 2 of 3 drafts: 3 emitted
    assert pen.counts.tolist() == [0, 0, 0, 0, 2, 0, 0, 1, 0, 0]
    pen.begin(torch.tensor([5]))                                # a new request starts from nothing
    assert pen.counts.sum() == 0 and pen.prompt.nonzero().view(-1).tolist() == [5]
    with pytest.raises(ValueError, match="3 rows need 2 drafts"):
        penalize(logits, pen, SamplingParams(frequency_penalty=1.0), torch.tensor([1]))


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0.0, got 0.0"),
    (dict(repetition_penalty=-1), "repetition_penalty must be > 0.0, got -1"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(repetition_penalty="1.2"), "repetition_penalty must be a finite number, got '1.2'"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number"),
    (dict(presence_penalty=2.5), "presence_penalty must be <= 2.0, got 2.5"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be >= -2.0, got -2.01"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be a finite number"),
])
def test_validation(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(".", r"\.")):
        SamplingParams(**kw)


def test_defaults_are_neutral_and_bounds_accepted():
    sp = SamplingParams()
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not sp.penalized and sp.penalty_text() == ""
    sp = SamplingParams(repetition_penalty=7.5, presence_penalty=-2.0, frequency_penalty=2)
    assert sp.penalized and sp.penalty_text() == "repetition_penalty=7.5, presence_penalty=-2, frequency_penalty=2"


# ---- greedy speculation == AR --------------------------------------------------------------------

def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def check_equal(llm: LLM, prompts, n: int, kw: dict, ks=(1, 3, 5), ngram_ks=(4,),
                plain: dict | None = None) -> tuple[int, int]:
    """MTP at each k and n-gram equal AR with the penalty; returns (drafts accepted, prompts whose
    penalised output differs from the unpenalised one). `plain`: the unpenalised AR outputs by
    prompt, shared by the calls of one test (computed once per prompt, not once per setting)."""
    acc = changed = 0
    plain = {} if plain is None else plain
    for p in prompts:
        ref = llm.generate(p, greedy(n, **kw), spec="off")
        assert ref.stats["route"] == "ar" and "penalties" in ref.stats["route_reason"]
        key = (p if isinstance(p, str) else tuple(p), n)
        if key not in plain:
            plain[key] = llm.generate(p, greedy(n), spec="off").token_ids
        changed += ref.token_ids != plain[key]
        for k in ks:
            r = llm.generate(p, greedy(n, **kw), spec={"mode": "mtp", "k": k})
            assert r.stats["route"] == "mtp" and r.token_ids == ref.token_ids, (p, k, kw)
            acc += r.stats["accepted"]
        rep = (list(p) * 4)[:40] if not isinstance(p, str) else p + p
        ref2 = llm.generate(rep, greedy(n, **kw), spec="off")
        for k in ngram_ks:
            r = llm.generate(rep, greedy(n, **kw), spec={"mode": "ngram", "k": k})
            assert r.stats["route"] == "ngram" and r.token_ids == ref2.token_ids, (rep, k, kw)
            acc += r.stats["accepted"]
    return acc, changed


@pytest.mark.parametrize("name", ["base", "mix", "gqa4"])
def test_tiny_models_greedy_spec_equals_ar(ckpt_cache, name):
    """Random tiny models accept almost no MTP draft (0 of the ~1,850 drafted at k = 1, 3, 5 on base
    and mix, 5 on gqa4), so each k re-checks the row-0 path: one k here; the k variety with
    accepted drafts is test_fitted_greedy_spec_equals_ar's (k = 1, 2, 4, 6)."""
    with LLM(tiny(ckpt_cache, name), device="cpu", progress=False) as llm:
        v = llm.cfg.vocab_size
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, v - 1, (L,), generator=g).tolist() for L in (3, 17)]
        changed, plain = 0, {}
        for kw in SETTINGS.values():
            changed += check_equal(llm, prompts, 24, kw, ks=(3,), plain=plain)[1]
        assert changed > 0


def test_fitted_greedy_spec_equals_ar(fitted):
    """The fitted model accepts drafts, so accepted drafts really feed later rows' counts."""
    with LLM(fitted, device="cpu", progress=False) as llm:
        prompts, plain = specfit.prompts(3, seed=7), {}
        for kw in SETTINGS.values():
            acc, _ = check_equal(llm, prompts, 32, kw, ks=(1, 2, 4, 6), ngram_ks=(1, 3, 6), plain=plain)
            assert acc > 0, kw


BUNDLED_PROMPTS = ["def read_lines(path):", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def bundled_plain() -> dict:
    """The bundled model's unpenalised greedy outputs, computed once for the module's checks."""
    return {}


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.5)],
                         ids=["rep1.3", "freq_pres"])
def test_bundled_greedy_spec_equals_ar(bundled, bundled_plain, kw):
    acc, changed = check_equal(bundled, BUNDLED_PROMPTS, 48, kw, ks=(2, 4), plain=bundled_plain)
    assert acc > 0 and changed > 0


def row0_counts_only(orig):
    """The shortcut that is wrong: every verify row penalised with the counts before row 0."""
    def wrong(logits, pen, sp, draft=None):
        return torch.cat([orig(logits[i:i + 1], pen, sp) for i in range(logits.shape[0])])
    return wrong


def test_row0_counts_break_equality(bundled, monkeypatch):
    monkeypatch.setattr(spec_mod, "penalize", row0_counts_only(spec_mod.penalize))
    sp = greedy(64, repetition_penalty=1.3)
    differ = 0
    for p in BUNDLED_PROMPTS:
        ref = bundled.generate(p, sp, spec="off")
        differ += bundled.generate(p, sp, spec={"mode": "mtp", "k": 4}).token_ids != ref.token_ids
    assert differ > 0


def test_counts_do_not_leak_between_requests(fitted):
    p1, p2 = specfit.prompts(2, seed=4)
    pen = greedy(32, frequency_penalty=1.5, repetition_penalty=1.4)
    with LLM(fitted, device="cpu", progress=False) as fresh:
        want_pen = fresh.generate(p2, pen, spec="off").token_ids
    with LLM(fitted, device="cpu", progress=False) as fresh:
        want_plain = fresh.generate(p2, greedy(32), spec="off").token_ids
    assert want_pen != want_plain
    with LLM(fitted, device="cpu", progress=False) as llm:
        for mode in ("off", "mtp", "ngram"):
            llm.generate(p1, pen, spec={"mode": mode, "k": 3})
            assert llm.generate(p2, pen, spec={"mode": mode, "k": 3}).token_ids == want_pen, mode
            llm.generate(p1, pen, spec={"mode": mode, "k": 3})
            assert llm.generate(p2, greedy(32), spec={"mode": mode, "k": 3}).token_ids == want_plain, mode


# ---- sampled speculation draws from the penalised AR distribution -------------------------------

def pit_chi2(llm: LLM, mode: str, sp_kw: dict) -> tuple[float, dict]:
    """test_spec_sampled.pit_chi2 with the AR distribution of each position penalised by the plain
    reference over the prompt and the tokens generated before it."""
    def penalised(raw, prompt, out, sp):
        return torch.stack([penalize_ref(raw[i], prompt, out[:i], sp) for i in range(len(out))]).float()
    return spec_sampled_pit_chi2(llm, mode, sp_kw, target=penalised, seed=2000)


SAMPLED = {"rep_freq": dict(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.02),
           "freq1": dict(temperature=1.0, frequency_penalty=1.0),
           "pres_trunc": dict(temperature=0.9, top_k=6, top_p=0.95, presence_penalty=1.0, repetition_penalty=0.9)}


@pytest.mark.parametrize("mode", ["off", "mtp", "ngram"])
@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_speculation_matches_penalised_ar(tiny_vocab, mode, name):
    with LLM(tiny_vocab, device="cpu", progress=False) as llm:
        c, acc = pit_chi2(llm, mode, SAMPLED[name])
    if mode != "off":
        assert acc["cycles"] > 0 and acc["accepted"] > 0, acc
    assert acc["outside"] == 0, "a token outside the AR support was emitted"
    assert c < chi2_critical(BINS - 1), (mode, name, c)


@pytest.mark.parametrize("mode", ["mtp", "ngram"])
def test_sampled_check_has_teeth(tiny_vocab, monkeypatch, mode):
    """The same check fails when the verify rows are not penalised (chi-square 650-1500 against a
    critical 28 when measured). The subtler shortcut of penalising every row with row 0's counts
    is one count off per draft and passes this check at this sample size; the greedy check above
    (test_row0_counts_break_equality) catches it."""
    monkeypatch.setattr(spec_mod, "penalize", lambda logits, pen, sp, draft=None: logits)
    with LLM(tiny_vocab, device="cpu", progress=False) as llm:
        c, acc = pit_chi2(llm, mode, dict(temperature=1.0, frequency_penalty=1.0))
    assert acc["outside"] > 0 or c > chi2_critical(BINS - 1), (mode, c, acc)


def test_sampled_accept_with_penalties_skips_the_graph(tiny_vocab):
    """On an engine that replays the sampled accept from graphs (emulated here), a penalised request
    runs the eager accept instead, says so, and gives the tokens the plain engine gives."""
    from specfire.runtime.spec import StepBuffers

    sp = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=0.3)
    with LLM(tiny_vocab, device="cpu", progress=False) as llm:
        want = llm.generate([1, 2, 3], sp, spec={"mode": "mtp", "k": 3})
        assert "not from its CUDA graph" not in want.stats["penalties"]
        llm.engine.bufs = StepBuffers(torch.device("cpu"), emulate=True)
        got = llm.generate([1, 2, 3], sp, spec={"mode": "mtp", "k": 3})
        assert got.token_ids == want.token_ids
        assert not any(key[0] == "accept" for key in llm.engine.bufs.graphs.graphs)
        assert "the sampled accept runs eagerly" in got.stats["penalties"]
        assert "the sampled accept runs eagerly" in llm.preview_route(sp, {"mode": "mtp", "k": 3})[1]
        plain = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
        llm.generate([1, 2, 3], plain, spec={"mode": "mtp", "k": 3})
        assert any(key[0] == "accept" for key in llm.engine.bufs.graphs.graphs)   # the graph path still runs


# ---- the HTTP server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tinytok_llm(tinytok_ckpt):
    with LLM(tinytok_ckpt, device="cpu", progress=False) as llm:
        yield llm


def test_server_accepts_and_validates_penalties(tinytok_llm):
    from fastapi.testclient import TestClient

    from specfire.serve.http import build_app

    llm = tinytok_llm
    body = {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    pen = {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 1}
    want = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, ignore_eos=True, **pen), spec="off")
    plain = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, ignore_eos=True), spec="off")
    assert want.text != plain.text
    with TestClient(build_app(llm, "t")) as tc:
        r = tc.post("/v1/completions", json={**body, **pen, "speculation": {"mode": "mtp", "k": 3}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert "penalties" in r.json()["timings"]["route_reason"]
        r = tc.post("/v1/completions", json={**body, "presence_penalty": 0, "frequency_penalty": 0.0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.text
        for field, value, word in (("repetition_penalty", 0, "must be > 0.0"),
                                   ("presence_penalty", 2.5, "must be <= 2.0"),
                                   ("frequency_penalty", -3, "must be >= -2.0"),
                                   ("frequency_penalty", "1", "must be a number"),
                                   ("repetition_penalty", None, None)):
            r = tc.post("/v1/completions", json={**body, field: value})
            if word is None:                                    # null is absent
                assert r.status_code == 200
                continue
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field and word in err["message"], r.text
            assert field in err["message"]
        r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "repetition_penalty": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
    # the server's defaults (`specfire serve --repetition-penalty ...`) fill fields a request leaves out
    with TestClient(build_app(llm, "t", sampling_defaults=pen)) as tc:
        r = tc.post("/v1/completions", json=body)
        assert r.json()["choices"][0]["text"] == want.text
        r = tc.post("/v1/completions", json={**body, "repetition_penalty": 1, "presence_penalty": 0,
                                             "frequency_penalty": 0})
        assert r.json()["choices"][0]["text"] == plain.text
    with pytest.raises(ValueError, match="presence_penalty must be <= 2.0"):
        build_app(llm, "t", sampling_defaults={"presence_penalty": 9})


# ---- penalty-aware MTP drafting (greedy) -----------------------------------------------------------

def test_penalize_draft_matches_verify_rows():
    """Draft step j penalised with the counts plus drafts 0..j-1 gives the verify row j's logits, on
    the whole vocabulary and cut to a draft vocabulary (drafts inside it)."""
    g = torch.Generator().manual_seed(5)
    v, n_draft = 37, 20
    pen = Penalties(v, "cpu").begin(torch.tensor([1, 4, 4, 30]))
    pen.add(torch.tensor([2, 4, 9, 9, 19]))
    drafts = torch.tensor([9, 3, 9, 17])
    logits = torch.randn(5, v, generator=g) * 3
    for kw in SETTINGS.values():
        sp = SamplingParams(**kw)
        rows = penalize(logits, pen, sp, drafts)
        for j in range(5):
            before = [drafts[i:i + 1] for i in range(j)]
            assert torch.equal(penalize_draft(logits[j:j + 1], pen, sp, before), rows[j:j + 1]), (kw, j)
            assert torch.equal(penalize_draft(logits[j:j + 1, :n_draft], pen, sp, before), rows[j:j + 1, :n_draft])
    assert penalize_draft(logits[:1], pen, SamplingParams(), []) is not None


def accept_runs(llm, prompts, n: int, kw: dict, k: int, aware: bool, monkeypatch, refs: dict) -> tuple[int, int]:
    """(drafts accepted, cycles) of greedy MTP k with the penalties, drafts penalty-aware or not;
    every output equals AR's (`refs`: AR's outputs by prompt, computed on first use; no drafter)."""
    from specfire.runtime.drafters import MtpDrafter
    monkeypatch.setattr(MtpDrafter, "penalty_aware", aware)
    acc = cyc = 0
    for p in prompts:
        if p not in refs:
            refs[p] = llm.generate(p, greedy(n, **kw), spec="off").token_ids
        r = llm.generate(p, greedy(n, **kw), spec={"mode": "mtp", "k": k})
        assert r.token_ids == refs[p], (p, k, kw, aware)
        assert ("MTP drafts are picked penalised too" in r.stats["route_reason"]) == aware
        acc, cyc = acc + r.stats["accepted"], cyc + r.stats["cycles"]
    return acc, cyc


def test_penalty_aware_drafts_bundled_defaults(bundled, monkeypatch):
    """The bundled model with its default penalties (repetition 1.05, frequency 0.7): aware drafts
    accept more than drafts that ignore the penalties (equal counts would fail), exact either way."""
    kw = dict(repetition_penalty=1.05, frequency_penalty=0.7)
    refs: dict = {}
    a_acc, a_cyc = accept_runs(bundled, BUNDLED_PROMPTS, 64, kw, 3, True, monkeypatch, refs)
    u_acc, u_cyc = accept_runs(bundled, BUNDLED_PROMPTS, 64, kw, 3, False, monkeypatch, refs)
    assert a_acc / a_cyc > u_acc / u_cyc, (a_acc, a_cyc, u_acc, u_cyc)


def first_drafts(llm, prompt: str, k: int, sp: SamplingParams, pen: Penalties | None, graphs: bool = False):
    """The MTP drafter's first k drafts after the prompt's prefill and first token (as the engine
    runs them), eager or with the chain in emulated graphs."""
    from specfire.runtime.graphs import DraftGraphs
    d, trunk = llm.engine.drafters["mtp"], llm.engine.trunk
    ids = torch.tensor(llm.tokenizer.encode(prompt))
    trunk.begin()
    rows = trunk.prefill(ids)
    d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
    try:
        d.begin(ids, rows.hidden)
        first = rows.logits[-1:].argmax(-1)
        d.commit(first.tolist(), rows.hidden[:0], first)
        return d.propose(int(first), ids.shape[0], k, sp, None, pen)[0].tolist()
    finally:
        d.graphs = None


def test_penalty_aware_drafts_avoid_penalised_argmax(bundled):
    """Constructed: the head's unpenalised first draft is given a count of 100 under a frequency
    penalty of 1, so a penalty-aware chain must draft another id there, the same eagerly and from
    the (emulated) captured chain; without the statistics it keeps the penalised-away id."""
    p, v = "def read_lines(path):", bundled.cfg.vocab_size
    sp = SamplingParams(frequency_penalty=1.0)
    plain = first_drafts(bundled, p, 3, sp, None)
    pen = Penalties(v, "cpu").begin(torch.tensor(bundled.tokenizer.encode(p)))
    pen.counts[plain[0]] = 100.0
    aware = first_drafts(bundled, p, 3, sp, pen)
    assert aware[0] != plain[0], (plain, aware)
    assert first_drafts(bundled, p, 3, sp, pen, graphs=True) == aware
    assert first_drafts(bundled, p, 3, SamplingParams(), pen) == plain            # no penalties: unchanged
    assert first_drafts(bundled, p, 3, SamplingParams(temperature=0.0, frequency_penalty=1.0), pen) == aware


def test_penalty_aware_drafts_in_emulated_graphs(fitted):
    """The chain in emulated graphs (the captured greedy path, `prepare`'s chain after a verify
    included) with penalties: output equals AR and the drafts equal the eager chain's."""
    from specfire.runtime.graphs import DraftGraphs
    kw = dict(presence_penalty=2.0, repetition_penalty=1.2)
    with LLM(fitted, device="cpu", progress=False) as llm:
        d = llm.engine.drafters["mtp"]
        prompts = specfit.prompts(2, seed=3)
        logs = []
        for graphs in (False, True):
            d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
            _, log = specfit.spy_drafts(llm)
            try:
                for p in prompts:
                    ref = llm.generate(p, greedy(24, **kw), spec="off")
                    r = llm.generate(p, greedy(24, **kw), spec={"mode": "mtp", "k": 3})
                    assert r.token_ids == ref.token_ids, graphs
            finally:
                d.graphs = None
                del d.propose
            logs.append(log)
        assert logs[0] == logs[1] and len(logs[0]) > 0
