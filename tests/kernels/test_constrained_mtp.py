"""Constrained greedy MTP through the GPU's paths, interpreted on the CPU: the fused head step
(fc_input, the fused pick), the Triton greedy accept and the chain in emulated graphs, so the
chain queued after each verify (`prepare`) catches up over the verify's targets, rejected rows
included. On a tied random model (bench/common.py write_checkpoint(tied=True): every logit ties,
every draft is token 0, which the JSON grammar forbids) with the synthetic byte-level BPE
tokenizer of bench/grammar_mask.py: every cycle rejects its first draft, and the rows after it
must still pick ids in the vocabulary (an out-of-range id there is an illegal memory access in
fc_input's gather on the GPU)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specfire.kernels import head as head_fused
from specfire.kernels.small import kernel as small_kernel

VOCAB = 3001          # odd, past one 1024-column chunk of the accept's argmax


@pytest.fixture(scope="module")
def tied_bpe(tmp_path_factory) -> str:
    from bench.common import model_config, write_checkpoint
    from bench.grammar_mask import build_tokenizer

    path = str(tmp_path_factory.mktemp("tied_bpe"))
    write_checkpoint(path, model_config("tiny", vocab_size=VOCAB), torch.float32, "cpu", tied=True)
    build_tokenizer(path, VOCAB)
    return path


@pytest.mark.parametrize("logprobs", [None, 2])
def test_constrained_greedy_mtp_on_the_gpu_paths_equals_ar(tied_bpe, logprobs, monkeypatch):
    from bench.grammar_mask import ENGINE_PROMPT, SCHEMA
    from specfire import LLM, SamplingParams
    from specfire.grammar import GrammarSpec
    from specfire.layers.attention import FusedGatedAttention
    from specfire.model import loader
    from specfire.model.cuda import FusedMtpHead
    from specfire.runtime import spec as spec_mod
    from specfire.runtime.graphs import DraftGraphs

    monkeypatch.setattr(loader, "build_head",      # the GPU's head on the CPU trunk (interpreted kernels)
                        lambda cfg, target: FusedMtpHead(cfg, replace(target, attention=FusedGatedAttention)))
    monkeypatch.setattr(spec_mod, "greedy_accept", small_kernel.greedy_accept_triton)   # the GPU's accept
    seen, real_fc = [], head_fused.fc_input

    def checked_fc(ids, table, *a):
        bad = [i for i in ids.tolist() if not 0 <= i < table.shape[0]]
        assert not bad, f"ids outside the vocabulary ({table.shape[0]}) reached fc_input: {bad}"
        seen.append(ids.shape[0])
        return real_fc(ids, table, *a)
    monkeypatch.setattr(head_fused, "fc_input", checked_fc)
    sp = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=logprobs,
                        structured_outputs=GrammarSpec("json_schema", SCHEMA, "bench"))
    with LLM(tied_bpe, device="cpu", progress=False) as llm:
        ar = llm.generate(ENGINE_PROMPT, sp, spec="off")
        assert ar.token_ids[0] == 123 and 0 not in ar.token_ids        # '{', then what the grammar allows
        d = llm.engine.drafters["mtp"]
        d.head.fused = True                 # the fused rows step (fc_input, the pick), interpreted
        d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True)
        queued, real_after = [], d._chain_after
        d._chain_after = lambda *a, **k: queued.append(1) or real_after(*a, **k)
        try:
            r = llm.generate(ENGINE_PROMPT, sp, spec={"mode": "mtp", "k": 3})
        finally:
            d.graphs = None
            del d._chain_after
    assert r.stats["route"] == "mtp" and r.stats["cycles"] > 0 and r.stats["accepted"] == 0
    assert queued, "no chain was queued after a verify (the path of the GPU's crash)"
    assert 4 in seen, "no catch-up over a verify's rows went through fc_input"
    assert r.token_ids == ar.token_ids
    if logprobs:                                                        # the rows' targets are gathered too
        assert [(x.token, x.logprob, x.top) for x in r.logprobs] == [(x.token, x.logprob, x.top) for x in ar.logprobs]
