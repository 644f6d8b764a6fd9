"""Perplexity change from 4-bit quantization, on the CPU.

Quantizes a checkpoint with `specfire quantize` for several group sizes (with and without the
Hadamard rotation) and scores one token sequence with every variant. Without --model it uses a
tiny random checkpoint from tests/tinymodels.py and a sequence sampled from that model itself (so
the unquantized perplexity is the model's own, not that of random tokens). With --model and
--text, the text is tokenized with the checkpoint's tokenizer. Prints a table and one JSON line.

    python bench/quant_ppl.py [--model DIR --text FILE] [--tokens 256]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from specfire import LLM, SamplingParams  # noqa: E402
from specfire.quantize import quantize_checkpoint  # noqa: E402


def ppl(llm: LLM, ids: list[int]) -> float:
    logits = llm.score(ids)
    lp = torch.log_softmax(logits[:-1].float(), -1)
    nll = -lp.gather(-1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--groups", default="32,64,128")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    if args.model is None:
        from tinymodels import make_checkpoint
        src = make_checkpoint(os.path.join(root, "src"), "base", seed=5, hidden_size=128, intermediate_size=256,
                              vocab_size=512)
    else:
        src = args.model
    with LLM(src, device="cpu", spec="off", progress=False) as llm:
        if args.text:
            ids = llm.tokenizer.encode(open(args.text, encoding="utf-8").read())[: args.tokens]
        else:
            ids = llm.generate([1, 2, 3], SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0)).token_ids
            ids = [1, 2, 3] + ids
        base = ppl(llm, ids)
    rows = [{"variant": "unquantized", "ppl": base}]
    print(f"{'variant':<24} {'ppl':>9} {'change':>8}")
    print(f"{'unquantized':<24} {base:9.3f}")
    for g in (int(x) for x in args.groups.split(",")):
        for had in (False, True):
            dst = os.path.join(root, f"q{g}{'h' if had else ''}")
            quantize_checkpoint(src, dst, group=g, hadamard=had, device="cpu")
            with LLM(dst, device="cpu", spec="off", progress=False) as llm:
                p = ppl(llm, ids)
            name = f"q4 g{g}{' hadamard' if had else ''}"
            print(f"{name:<24} {p:9.3f} {p / base - 1:+8.2%}")
            rows.append({"variant": name, "ppl": p, "change": p / base - 1})
    print(json.dumps({"model": args.model or "tiny-random(h128,i256,v512)", "tokens": len(ids), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
