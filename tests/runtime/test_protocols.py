"""The seams are the protocols: the step, the engine and the drafters use only members of `Trunk`
and `Drafter`, with no probing for anything else. Each trunk and drafter is wrapped in a recorder
of the attributes read from it, and a request on every path (greedy, penalised, sampled, the
chain queued by `prepare` in emulated graphs, AR) may read nothing outside its protocol."""
from __future__ import annotations

import pytest
import torch

import specfit
from recorder import Recorder, members
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.runtime.drafters import Drafter, MtpDrafter, NgramDrafter
from specfire.runtime.engine import Engine
from specfire.runtime.trunk import LocalTrunk, Trunk


REQUESTS = [
    (SamplingParams(max_tokens=12), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=12, frequency_penalty=0.5, repetition_penalty=1.1), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=12, temperature=0.8, seed=3), SpecPolicy("mtp", 2)),
    (SamplingParams(max_tokens=12), SpecPolicy("ngram", 3)),
    (SamplingParams(max_tokens=12, presence_penalty=1.0), SpecPolicy("auto", 3)),
    (SamplingParams(max_tokens=6), SpecPolicy("off")),
]


def test_protocol_members_are_declared():
    """The members the drafters need of a trunk are declared; both drafters have every member of
    `Drafter`, both trunks every member of `Trunk`."""
    assert {"embed_weight", "draft_sharded", "lm_scores", "draft_pick", "draft_rounds"} <= members(Trunk)
    assert {"prepare", "penalises", "propose", "begin", "commit", "name"} <= members(Drafter)
    for cls in (MtpDrafter, NgramDrafter):
        missing = {m for m in members(Drafter) - {"name"} if not hasattr(cls, m)}
        assert not missing, (cls, missing)
    from specfire.parallel.trunk import MeshTrunk

    per_instance = {"cfg", "max_seq", "device", "draft_vocab", "state", "kv_pool"}      # set by __init__
    for cls in (LocalTrunk, MeshTrunk):
        assert {m for m in members(Trunk) if not hasattr(cls, m)} - per_instance == set(), cls


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated_graphs"])
def test_step_and_drafters_read_only_protocol_members(fitted, graphs):
    from specfire.runtime.graphs import DraftGraphs

    with LLM(fitted, device="cpu", progress=False) as llm:
        eng = llm.engine
        trunk = Recorder(eng.trunk)
        mtp = MtpDrafter(eng.drafters["mtp"].head, trunk, torch.float32)
        if graphs:                       # the captured chain's flow, `prepare` included
            mtp.graphs = DraftGraphs(mtp._chain_for, mtp.head.fc.weight.device, emulate=True)
        drafters = {"mtp": Recorder(mtp), "ngram": Recorder(NgramDrafter(*llm.ngram))}
        probe = Engine(trunk, llm.tokenizer, llm.eos_ids, drafters, topology="single")
        for p, (sp, policy) in zip(specfit.prompts(len(REQUESTS), seed=5), REQUESTS):
            ref = list(eng.stream(p, sp, SpecPolicy("off")))[-1].result.token_ids
            got = list(probe.stream(p, sp, policy))[-1].result
            if sp.greedy:
                assert got.token_ids == ref, (sp, policy)
        assert trunk.seen - members(Trunk) == set()
        for d in drafters.values():
            assert d.seen - members(Drafter) == set(), d._inner.name
        assert {"prepare", "penalises", "propose"} <= drafters["mtp"].seen
        if graphs:
            assert "draft_sharded" in trunk.seen
