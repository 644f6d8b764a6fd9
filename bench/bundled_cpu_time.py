"""Decode rate of a checkpoint per second of CPU time consumed (1 intra-op thread).

On a shared machine wall-clock tok/s measures the other jobs as much as the model; the CPU time
this process spends decoding is close to what one idle core would need. Runs AR and MTP (k given)
alternately on one prompt, reports tokens per CPU-second and per wall-second (best of --reps).

    PYTHONPATH=. python bench/bundled_cpu_time.py [--model DIR] [--prompt TEXT] [-n 128] [--k 3] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specfire.api import LLM                         # noqa: E402
from specfire.config import SamplingParams, SpecPolicy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, device="cpu", dtype="float32", progress=False)
    sp = SamplingParams(max_tokens=args.n, temperature=0.0, ignore_eos=True)
    llm.generate(args.prompt, SamplingParams(max_tokens=8), spec="off")          # warm-up
    best = {}
    same = True
    ref = None
    for _ in range(args.reps):
        for mode, spec in (("ar", "off"), ("mtp", SpecPolicy(mode="mtp", k=args.k))):
            c0, w0 = time.process_time(), time.perf_counter()
            r = llm.generate(args.prompt, sp, spec=spec)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            ref = ref or r.token_ids
            same &= r.token_ids == ref
            n = len(r.token_ids)
            cur = best.get(mode, {"tok_per_cpu_s": 0.0, "tok_per_wall_s": 0.0})
            best[mode] = {"tok_per_cpu_s": max(cur["tok_per_cpu_s"], n / cpu),
                          "tok_per_wall_s": max(cur["tok_per_wall_s"], n / wall),
                          "mean_accept_len": r.stats.get("mean_accept_len", 0.0)}
    llm.close()
    for mode, b in best.items():
        acc = "" if mode == "ar" else ", mean_accept_len %.2f" % b["mean_accept_len"]
        print(f"{mode:>4}: {b['tok_per_cpu_s']:.1f} tok per CPU-second, {b['tok_per_wall_s']:.1f} tok per wall-second "
              f"(best of {args.reps}; prefill included){acc}")
    print(f"MTP/AR per CPU-second {best['mtp']['tok_per_cpu_s'] / best['ar']['tok_per_cpu_s']:.2f}x; identical output: {same}")
    print(json.dumps({"bench": "bundled_cpu_time", "model": args.model or "bundled", "n": args.n, "k": args.k,
                      "results": best, "identical": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
