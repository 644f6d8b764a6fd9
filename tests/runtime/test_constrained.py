"""Structured outputs and logprobs in the one step (CPU, float32): constrained speculation equals
constrained AR token for token and logprob for logprob, whatever gets accepted; sampled
constrained output never leaves the grammar; logprobs are those of the distribution each token was
drawn from. On the tiny Qwen-style checkpoint (tests/qwenstyle.py: a real byte-level tokenizer)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from qwenstyle import qwen_ckpt
from specfire import LLM, SamplingParams
from specfire.grammar import GrammarSpec
from specfire.runtime.drafters import HostDrafter
from specfire.runtime.sampling import probs

# every part bounded (string length, integer range, enum), with bounded whitespace between JSON
# tokens: even a random model completes it within max_tokens
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["red", "green"]},
                                           "tag": {"type": "string", "maxLength": 4}},
          "required": ["n", "ok", "kind", "tag"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
SPECS = {"json_schema": GrammarSpec("json_schema", SCHEMA, "guided_json"), "regex": GrammarSpec("regex", REGEX),
         "choice": GrammarSpec("choice", CHOICES)}
PROMPTS = [[5, 6, 7, 8], [40, 41, 90, 12, 200, 201, 3]]


@pytest.fixture(scope="module")
def llm(ckpt_cache):
    with LLM(qwen_ckpt(ckpt_cache, "xml"), device="cpu", spec="auto", max_seq_len=1024, progress=False) as m:
        yield m


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    v = json.loads(text)
    return (set(v) == set(SCHEMA["properties"]) and type(v["n"]) is int and 0 <= v["n"] <= 99
            and type(v["ok"]) is bool and v["kind"] in ("red", "green") and isinstance(v["tag"], str)
            and len(v["tag"]) <= 4)


def in_grammar(llm, spec: GrammarSpec, ids: list[int]) -> bool:
    """A fresh matcher takes every emitted token and ends complete."""
    m = llm.engine.grammars.matcher(spec)
    return m.advance(ids) == len(ids) and m.is_done()


def lp_rows(res) -> list[tuple]:
    return [(x.token, x.logprob, x.top) for x in res.logprobs]


class Scripted(HostDrafter):
    """Proposes the known continuation `ref` after the prompt: the first `right` drafts of each cycle
    right, the rest shifted by one id (mostly ids the grammar forbids there)."""

    name = "scripted"

    def __init__(self, plen: int, ref: list[int], right: int, vocab: int):
        self.plen, self.ref, self.right, self.vocab = plen, ref, right, vocab

    def begin(self, prompt, hidden) -> None:
        pass

    def propose(self, last, pos, k, sp, gen, pen=None):
        out = []
        for j in range(k):
            i = pos + 1 + j - self.plen
            t = self.ref[i] if i < len(self.ref) else 0
            out.append(t if j < self.right else (t + 1) % self.vocab)
        return torch.tensor(out, dtype=torch.long), None

    def commit(self, out, hidden, out_dev=None) -> None:
        pass


def scripted(llm, prompt, sp, k, drafter):
    from specfire import SpecPolicy

    res = None
    for chunk in llm.engine.stream(list(prompt), sp, SpecPolicy("auto", k), drafter=drafter):
        res = chunk.result
    return res


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_constrained_speculation_equals_constrained_ar(llm, kind):
    spec = SPECS[kind]
    sp = SamplingParams(max_tokens=400, structured_outputs=spec, logprobs=3)
    for p in PROMPTS:
        ref = llm.generate(p, sp, spec="off")
        assert ref.stats["route"] == "ar" and ref.finish_reason == "stop", ref.text
        assert valid(kind, ref.text) and in_grammar(llm, spec, ref.token_ids), ref.text
        assert len(ref.logprobs) == len(ref.token_ids)
        for mode, k in (("mtp", 1), ("mtp", 3), ("mtp", 6), ("ngram", 3)):
            r = llm.generate(p, sp, spec={"mode": mode, "k": k})
            assert r.stats["route"] == mode and "grammar" in r.stats["route_reason"]
            assert (r.token_ids, r.finish_reason) == (ref.token_ids, ref.finish_reason), (kind, mode, k)
            assert lp_rows(r) == lp_rows(ref), (kind, mode, k)          # float32 on the CPU: bit for bit
        v = llm.cfg.vocab_size
        for k, right in ((3, 0), (3, 2), (4, 4), (2, 1)):               # rejected, partial and all-accepted cycles
            r = scripted(llm, p, sp, k, Scripted(len(p), ref.token_ids, right, v))
            assert r.token_ids == ref.token_ids and lp_rows(r) == lp_rows(ref), (kind, k, right)
            if right:
                assert r.stats["accepted"] > 0


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_sampled_constrained_output_stays_in_the_grammar(llm, kind):
    spec = SPECS[kind]
    for seed in range(4):
        for route in ("off", {"mode": "mtp", "k": 3}, {"mode": "ngram", "k": 2}):
            sp = SamplingParams(max_tokens=400, temperature=1.0, top_p=0.95, seed=seed, structured_outputs=spec)
            r = llm.generate(PROMPTS[seed % 2], sp, spec=route)
            assert r.finish_reason == "stop" and valid(kind, r.text), (route, r.text)
            assert in_grammar(llm, spec, r.token_ids)
    # drafts the grammar forbids (the scripted ones past the first) are rejected, never emitted
    sp = SamplingParams(max_tokens=400, temperature=0.8, seed=3, structured_outputs=spec)
    ref = llm.generate(PROMPTS[0], sp, spec="off")
    r = scripted(llm, PROMPTS[0], sp, 3, Scripted(len(PROMPTS[0]), ref.token_ids, 1, llm.cfg.vocab_size))
    assert r.finish_reason == "stop" and valid(kind, r.text) and in_grammar(llm, spec, r.token_ids)


def test_the_output_ends_where_the_grammar_is_complete(llm):
    eos = llm.eos_ids
    r = llm.generate(PROMPTS[0], SamplingParams(max_tokens=50, structured_outputs=SPECS["choice"]), spec="off")
    assert r.finish_reason == "stop" and r.text in CHOICES and not eos & set(r.token_ids)
    assert llm.tokenizer.decode(r.token_ids) == r.text


def test_logprobs_equal_ar_and_follow_the_sampled_distribution(llm):
    """Greedy: every route's logprobs are AR's. Sampled: a token's logprob is log p(token) of the
    distribution after temperature and truncation (recomputed here from the model's scores), -inf
    outside top-k."""
    p = PROMPTS[1]
    g = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5)
    ref = llm.generate(p, g, spec="off")
    for spec in ({"mode": "mtp", "k": 3}, {"mode": "ngram", "k": 2}):
        assert lp_rows(llm.generate(p, g, spec=spec)) == lp_rows(ref)
    top = [x.top for x in ref.logprobs]
    assert all(len(t) == 5 and t[0][1] >= t[-1][1] for t in top)
    assert all(x.top[0][0] == x.token for x in ref.logprobs)           # greedy: the chosen is the most likely
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_k=6, seed=1, logprobs=8)
    r = llm.generate(p, sp, spec={"mode": "mtp", "k": 3})
    logits = llm.score(p + r.token_ids[:-1])[len(p) - 1:]               # the rows that chose each token
    want = torch.log(probs(logits, sp))
    for i, x in enumerate(r.logprobs):
        assert math.isclose(x.logprob, want[i, x.token].item(), rel_tol=1e-4, abs_tol=1e-4)
        assert [v for _, v in x.top][6:] == [float("-inf")] * 2         # top_k 6: the rest have p = 0


def test_prompt_logprobs_do_not_change_the_output(llm):
    p = PROMPTS[1]
    plain = llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), spec="off")
    r = llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2), spec="off")
    assert r.token_ids == plain.token_ids and r.prompt_logprobs[0] is None
    want = torch.log_softmax(llm.score(p)[:-1], -1)
    assert [x.token for x in r.prompt_logprobs[1:]] == p[1:]
    assert all(math.isclose(x.logprob, want[i, p[i + 1]].item(), rel_tol=1e-5, abs_tol=1e-5)
               for i, x in enumerate(r.prompt_logprobs[1:]))


def test_grammar_after_the_think_block(llm):
    """A grammar that starts after `</think>`: rows before it unmasked, the rows after it masked as
    the grammar's start and what the drafts after it leave."""
    tok = llm.tokenizer
    end = tok.tok.token_to_id("</think>")
    spec = GrammarSpec("choice", ["yes", "no"], after="</think>")
    c = llm.engine.constraint(SamplingParams(structured_outputs=spec))
    assert c.waiting and c.after == end
    v = llm.cfg.vocab_size
    y = tok.encode("yes")[0]
    logits = torch.zeros(4, v)
    out = c.mask(logits, [7, end, y])
    assert torch.isfinite(out[:2]).all()                                # thinking: anything goes
    allowed2 = torch.isfinite(out[2]).nonzero().flatten().tolist()
    assert y in allowed2 and len(allowed2) < v and 7 not in allowed2
    assert c.advance([7, 9, end]) == 3 and not c.waiting
    assert (torch.isfinite(c.mask(torch.zeros(1, v), []))[0].nonzero().flatten().tolist()) == allowed2
    assert torch.equal(c.mask(torch.zeros(2, v), [y])[1], out[3])


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_constrained_ar_queued_ahead_equals_step_by_step(llm, kind, monkeypatch):
    """The GPU's one-step-ahead AR (forced on here): the next step's forward is queued before the
    last step is read and its mask is built after the matcher took that step's token; the output,
    logprobs and stop are those of reading each step before the next (the CPU's default)."""
    from specfire.runtime.engine import Engine

    sp = SamplingParams(max_tokens=400, structured_outputs=SPECS[kind], logprobs=2)
    engines = llm.slots.engines
    assert not any(e.queue_ahead for e in engines)                      # a CPU reads each step first
    refs = [llm.generate(p, sp, spec="off") for p in PROMPTS]
    ran = []
    real = Engine.steps

    def ahead(self, *a, **k):
        self.queue_ahead = True
        ran.append(self)
        try:
            yield from real(self, *a, **k)
        finally:
            self.queue_ahead = False

    monkeypatch.setattr(Engine, "steps", ahead)
    from specfire.runtime import spec as spec_mod
    launched, real_prepare = [], spec_mod.prepare
    monkeypatch.setattr("specfire.runtime.steps.prepare", lambda *a, **k: launched.append(a[5]) or real_prepare(*a, **k))
    for p, ref in zip(PROMPTS, refs):
        launched.clear()
        r = llm.generate(p, sp, spec="off")
        assert (r.token_ids, r.finish_reason) == (ref.token_ids, ref.finish_reason) and lp_rows(r) == lp_rows(ref)
        assert len(launched) > len(r.token_ids) - 1         # a step went ahead (and was dropped at the end)
    assert ran


def test_route_reason_and_refusals(llm):
    plan = llm.plan_route(SamplingParams(structured_outputs=SPECS["regex"]), {"mode": "mtp", "k": 3})
    assert "regex grammar" in plan.reason and "a drafting step is read" in plan.reason
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SPECS["regex"])
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"type": "json_object"})
    from specfire.grammar import GrammarError

    with pytest.raises(GrammarError) as e:
        llm.plan_route(SamplingParams(structured_outputs=GrammarSpec("regex", "a(", "guided_regex")))
    assert e.value.param == "guided_regex"
