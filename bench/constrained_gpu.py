"""Constrained greedy MTP == constrained AR on the GPU, where every draft is forbidden: a tied
random checkpoint (write_checkpoint(tied=True): every logit ties, greedy picks token 0, which the
JSON grammar never allows) with the synthetic byte-level BPE tokenizer of bench/grammar_mask.py
at Qwen3.5's 248,320 entries. Every cycle rejects its first draft, so the rows after it (and the
draft chain queued over them) are exercised every step; with and without logprobs, MTP k = 1 and
3, then the bundled model alike. Prints one JSON line; exits 1 on a mismatch.

    python -m bench.constrained_gpu [--shape 0.8B] [--vocab 248320] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from bench.common import model_config, write_checkpoint
from bench.grammar_mask import ENGINE_PROMPT, SCHEMA, build_tokenizer
from specfire import LLM, SamplingParams
from specfire.grammar import GrammarSpec


def compare(llm: LLM, max_tokens: int) -> list[dict]:
    spec = GrammarSpec("json_schema", SCHEMA, "bench")
    rows = []
    for logprobs in (None, 2):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs, structured_outputs=spec)
        ar = llm.generate(ENGINE_PROMPT, sp, spec="off")
        for k in (1, 3):
            r = llm.generate(ENGINE_PROMPT, sp, spec={"mode": "mtp", "k": k})
            same = r.token_ids == ar.token_ids and (
                logprobs is None or [(x.token, x.logprob) for x in r.logprobs] == [(x.token, x.logprob)
                                                                                  for x in ar.logprobs])
            rows.append({"logprobs": logprobs, "k": k, "equal": same, "tokens": len(r.token_ids),
                         "accepted": r.stats["accepted"], "cycles": r.stats["cycles"], "route": r.stats["route"],
                         "ar_head": ar.token_ids[:6]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8B")
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"bench": "constrained_gpu", "device": dev, "shape": a.shape, "vocab": a.vocab}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if dev == "cuda" else None) as d:
        write_checkpoint(d, model_config(a.shape, vocab_size=a.vocab), torch.bfloat16, dev, tied=True)
        build_tokenizer(d, a.vocab)
        with LLM(d, device=dev, spec="auto", threads=1, progress=False) as llm:
            out["tied"] = compare(llm, a.max_tokens)
    with LLM(device=dev, spec="auto", threads=1, progress=False) as llm:
        out["bundled"] = compare(llm, a.max_tokens)
    print(json.dumps(out))
    bad = [r for rows in (out["tied"], out["bundled"]) for r in rows if not r["equal"] or r["route"] != "mtp"]
    if bad:
        print(f"constrained_gpu: constrained MTP differs from constrained AR: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
