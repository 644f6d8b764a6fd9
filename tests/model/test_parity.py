"""Parity with transformers (Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration) on tiny random
checkpoints saved by transformers itself, over every config in tinymodels.CONFIGS and both layouts."""
from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpts import tiny
from tinymodels import CONFIGS, load_hf
from specfire import LLM, SamplingParams

CASES = [(name, mm) for name in CONFIGS for mm in (False, True)]
IDS = [f"{n}-{'mm' if mm else 'text'}" for n, mm in CASES]


@pytest.fixture(scope="module")
def pair(ckpt_cache):
    """(specfire LLM, transformers model, vocab) per case, built once per module."""
    made: dict = {}

    def get(name: str, mm: bool):
        if (name, mm) not in made:
            path = tiny(ckpt_cache, name, multimodal=mm)
            llm = LLM(path, device="cpu", dtype="float32", spec="off", progress=False)
            made[(name, mm)] = (llm, load_hf(path, mm), llm.cfg.vocab_size)
        return made[(name, mm)]

    yield get
    for llm, _, _ in made.values():
        llm.close()


def seed_of(name: str, mm: bool, k: int) -> int:
    """A fixed seed per case (str hashes vary between runs)."""
    return zlib.crc32(f"{name}/{mm}/{k}".encode())


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name,mm", CASES, ids=IDS)
def test_score_matches_transformers(pair, name, mm):
    llm, hf, vocab = pair(name, mm)
    g = torch.Generator().manual_seed(seed_of(name, mm, 0))
    for T in (1, 7, 70):                      # 70 crosses a GDN chunk boundary
        ids = torch.randint(0, vocab, (T,), generator=g)
        ours = llm.score(ids.tolist())
        assert ours.dtype == torch.float32 and ours.shape == (T, vocab)
        assert rel_err(ours, hf_logits(hf, ids)) < 1e-4


def test_score_long_prompt_spans_prefill_pieces(pair):
    """A prompt longer than one prefill piece (1024 rows) still matches."""
    llm, hf, vocab = pair("base", False)
    ids = torch.randint(0, vocab, (1100,), generator=torch.Generator().manual_seed(11))
    assert rel_err(llm.score(ids.tolist()), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("name,mm", CASES, ids=IDS)
def test_greedy_matches_transformers_generate(pair, name, mm):
    llm, hf, vocab = pair(name, mm)
    g = torch.Generator().manual_seed(seed_of(name, mm, 1))
    prompt = torch.randint(0, vocab, (9,), generator=g)
    n = 20
    res = llm.generate(prompt.tolist(), SamplingParams(max_tokens=n, ignore_eos=True))
    with torch.no_grad():
        out = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert res.token_ids == out[0, len(prompt):].tolist()
    assert res.finish_reason == "length" and res.stats["route"] == "ar"


@pytest.mark.parametrize("name,mm", CASES, ids=IDS)
def test_cached_decode_equals_full_recompute(pair, name, mm):
    """Every token of the cached step-by-step decode is the argmax of a full forward over
    prompt + generated tokens (the prompt crosses a GDN chunk boundary)."""
    llm, _, vocab = pair(name, mm)
    g = torch.Generator().manual_seed(seed_of(name, mm, 2))
    prompt = torch.randint(0, vocab, (67,), generator=g).tolist()
    res = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    full = llm.score(prompt + res.token_ids)
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == res.token_ids


def test_sharded_checkpoint_loads_identically(ckpt_cache, tmp_path):
    """The same tensors split over three shards with an index load to identical weights."""
    for mm in (False, True):
        src = tiny(ckpt_cache, "base", multimodal=mm)
        dst = tmp_path / f"sharded_{mm}"
        dst.mkdir()
        for f in os.listdir(src):
            if f != "model.safetensors":
                (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
        tensors = load_file(os.path.join(src, "model.safetensors"))
        names = sorted(tensors)
        weight_map = {}
        for s in range(3):
            fname = f"model-{s + 1:05d}-of-00003.safetensors"
            part = {n: tensors[n] for n in names[s::3]}
            save_file(part, str(dst / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        ids = torch.randint(0, 131, (30,), generator=torch.Generator().manual_seed(5)).tolist()
        with LLM(src, device="cpu", progress=False) as a, LLM(str(dst), device="cpu", progress=False) as b:
            assert b.mtp_loaded and a.mtp_loaded
            assert torch.equal(a.score(ids), b.score(ids))
            for (na, pa), (nb, pb) in zip(a.engine.trunk.model.named_parameters(),
                                          b.engine.trunk.model.named_parameters()):
                assert na == nb and torch.equal(pa, pb)
            sp = SamplingParams(max_tokens=8, ignore_eos=True)
            assert a.generate(ids, sp, spec="off").token_ids == b.generate(ids, sp, spec="off").token_ids
