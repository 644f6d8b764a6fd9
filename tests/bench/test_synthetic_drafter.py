"""The benchmark-only drafter with SYNTHETIC acceptance (bench/common.py ProfileDrafter): on a checkpoint whose
final norms are -1 the trunk always picks token 0, the drafter's acceptance per position follows
the given profile, and the output is AR's."""
from __future__ import annotations

import pytest

from specfire import LLM, SamplingParams, SpecPolicy
from bench.common import ProfileDrafter, write_checkpoint
from specfire.config import ModelConfig


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> str:
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=False,
                      layer_types=("linear_attention", "full_attention"))
    return write_checkpoint(str(tmp_path_factory.mktemp("tied") / "ckpt"), cfg, dev="cpu", tied=True)


def test_profile_drafter_follows_the_profile_and_equals_ar(tied):
    profile = (0.9, 0.5, 0.2)
    sp = SamplingParams(max_tokens=400, ignore_eos=True)
    with LLM(tied, device="cpu", progress=False) as llm:
        ref = llm.generate([5, 6, 7], sp, spec="off")
        assert set(ref.token_ids) == {0}                         # every logit ties: greedy picks 0
        d = ProfileDrafter(llm.engine.drafters["mtp"], profile, seed=3)
        res = list(llm.engine.stream([5, 6, 7], sp, SpecPolicy("mtp", 3), drafter=d))[-1].result
    assert res.token_ids == ref.token_ids
    got = res.stats["accept_per_pos"]
    assert res.stats["cycles"] > 100
    assert all(abs(g - p) < 0.12 for g, p in zip(got, profile)), got


def test_profile_must_not_increase():
    with pytest.raises(ValueError, match="non-increasing"):
        ProfileDrafter(None, (0.5, 0.9))
