"""Greedy speculative == AR on the GPU, end to end, on the bundled trained model, at several
context lengths; also decode tok/s per route. Prompts are held-out standard-library modules
(specfire/train/corpus.py HELD_OUT) cut to the given token counts.

    python -m bench.exact_gpu --ctx 64,2000,8000 --tokens 128
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig

import torch

from specfire import LLM, SamplingParams, SpecPolicy


def held_out_text() -> str:
    from specfire.train.corpus import HELD_OUT
    lib = sysconfig.get_paths()["stdlib"]
    parts = []
    for mod in HELD_OUT:
        for cand in (os.path.join(lib, mod + ".py"), os.path.join(lib, mod, "__init__.py")):
            if os.path.exists(cand):
                with open(cand, encoding="utf-8", errors="replace") as f:
                    parts.append(f.read())
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="64,2000,8000")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv", default="bf16,q8")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for kv in args.kv.split(","):
        with LLM(device=dev, kv_dtype=kv, max_seq_len=16384) as llm:
            ids = llm.tokenizer.encode(held_out_text())
            sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
            for ctx in [int(c) for c in args.ctx.split(",")]:
                prompt = ids[len(ids) // 3: len(ids) // 3 + ctx]
                for mode, k in (("off", 3), ("mtp", 1), ("mtp", 3), ("ngram", 3)):  # warm-up: capture graphs
                    for cut in (40, 80, 120):
                        llm.generate(prompt[:cut], SamplingParams(max_tokens=48), spec=SpecPolicy(mode=mode, k=k))
                ar = llm.generate(prompt, sp, spec=SpecPolicy(mode="off"))
                row = {"kv": kv, "ctx": ctx, "ar_tok_s": ar.stats["decode_tok_s"]}
                for mode, k in (("mtp", 1), ("mtp", 3), ("ngram", 3)):
                    r = llm.generate(prompt, sp, spec=SpecPolicy(mode=mode, k=k))
                    first = next((i for i, (a, b) in enumerate(zip(ar.token_ids, r.token_ids)) if a != b), None)
                    row[f"{mode}{k}"] = {"equal": r.token_ids == ar.token_ids, "first_diff": first,
                                         "tau": round(r.stats["mean_accept_len"], 3),
                                         "tok_s": round(r.stats["decode_tok_s"], 1)}
                rows.append(row)
                print(json.dumps(row))
    ok = all(v["equal"] for r in rows for k, v in r.items() if isinstance(v, dict))
    print(json.dumps({"bench": "exact_gpu", "all_equal": ok, "results": rows}))


if __name__ == "__main__":
    main()
