"""Where a CPU decode step of the bundled model spends its time, and what the exactness layers cost.

1. CPU time per token (least process time over --reps rounds, variants interleaved; 1 thread, so
   other jobs on a shared machine matter less than for wall-clock rates) of greedy AR and MTP k=3
   decoding on one device as it ships (`default`) and in the canonical mode a tensor-parallel mesh
   computes (`canonical`, `canonical.set_enabled(True)`: the canonical split-K of row-parallel
   projections, kernels/splitk, plus elementwise math padded to whole vectors, kernels/lanes.py).
2. A torch.profiler table of one AR decode (self CPU time by op) as shipped.

    PYTHONPATH=. python bench/bundled_cpu_profile.py [--model DIR] [-n 96] [--reps 3] [--top 25]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specfire.api import LLM                           # noqa: E402
from specfire.config import SamplingParams, SpecPolicy  # noqa: E402
from specfire.kernels import canonical

PROMPT = "def fibonacci(n):"


def variant(name: str) -> None:
    canonical.set_enabled(True if name == "canonical" else None)


def cpu_per_token(llm: LLM, spec, n: int, reps: int) -> tuple[float, list[int], float]:
    """Least process time per generated token over reps (prefill excluded via a 1-token request)."""
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    best, ids, acc = float("inf"), [], 0.0
    for _ in range(reps):
        c0 = time.process_time()
        llm.generate(PROMPT, one, spec="off")
        c1 = time.process_time()
        r = llm.generate(PROMPT, sp, spec=spec)
        c2 = time.process_time()
        best = min(best, ((c2 - c1) - (c1 - c0)) / (len(r.token_ids) - 1))
        ids, acc = r.token_ids, r.stats.get("mean_accept_len", 0.0)
    return best, ids, acc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, device="cpu", dtype="float32", progress=False)
    llm.generate(PROMPT, SamplingParams(max_tokens=8), spec="off")
    names = ("default", "canonical")
    modes = (("ar", "off"), ("mtp3", SpecPolicy(mode="mtp", k=3)))
    best: dict[tuple[str, str], tuple[float, list[int], float]] = {}
    for _ in range(args.reps):          # variants interleaved: load changes hit all of them alike
        for name in names:
            variant(name)
            for mode, spec in modes:
                per, ids, acc = cpu_per_token(llm, spec, args.n, 1)
                if (name, mode) not in best or per < best[(name, mode)][0]:
                    best[(name, mode)] = (per, ids, acc)
    ref = best[("default", "ar")][1]
    rows = [{"variant": name, "mode": mode, "cpu_ms_per_token": best[(name, mode)][0] * 1e3,
             "tok_per_cpu_s": 1 / best[(name, mode)][0], "mean_accept_len": best[(name, mode)][2],
             "same_as_default_ar": best[(name, mode)][1] == ref} for name in names for mode, _ in modes]
    variant("default")
    base = {r["mode"]: r["cpu_ms_per_token"] for r in rows[:2]}
    print(f"{'variant':<20} {'mode':<5} {'ms/token':>9} {'tok/CPU-s':>10} {'vs default':>10} {'accept':>7}  same tokens")
    for r in rows:
        r["vs_default"] = r["cpu_ms_per_token"] / base[r["mode"]]
        print(f"{r['variant']:<20} {r['mode']:<5} {r['cpu_ms_per_token']:>9.3f} {r['tok_per_cpu_s']:>10.1f} "
              f"{r['vs_default']:>10.3f} {r['mean_accept_len']:>7.2f}  {r['same_as_default_ar']}")
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=33, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(PROMPT, sp, spec="off")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print("\nOne AR request of 33 tokens (prefill + 32 decode steps), shipped settings:\n" + table)
    llm.close()
    print(json.dumps({"bench": "bundled_cpu_profile", "model": args.model or "bundled", "n": args.n,
                      "reps": args.reps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
