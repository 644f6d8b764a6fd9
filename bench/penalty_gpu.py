"""Penalties on the GPU: greedy speculation == AR with repetition / presence / frequency penalties,
on the bundled model with CUDA graphs (the path the CPU tests cannot run), and the sampled path
with penalties (the eager accept) runs and keeps the request's figures.

For each penalty setting and each of the loop benchmark's prompts: greedy AR, MTP k=3 and n-gram
k=3 completions of --max-tokens tokens must be equal token for token; the sampled run (temperature
0.8, top-p 0.95, seed fixed) with MTP must give as many tokens as asked (or stop at end-of-text)
and report the eager-accept fallback in its stats. Plain requests run before and after, to check
that a penalised request leaves nothing behind (the next plain request equals the first).

    python -m bench.penalty_gpu [--max-tokens 96] [--out DIR]
Prints a table and one JSON line last; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


from specfire.api import LLM
from specfire.params import SamplingParams, SpecPolicy
from specfire.train.select import LOOP_PROMPTS

SETTINGS = [
    {},                                                           # plain (before)
    {"repetition_penalty": 1.05, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"presence_penalty": -0.5},
    {},                                                           # plain (after: nothing left behind)
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    prompts = LOOP_PROMPTS[:args.prompts]
    rows, bad = [], 0
    t0 = time.time()
    with LLM(device=args.device, progress=False) as llm:
        plain_first: list[list[int]] = []
        for si, pen in enumerate(SETTINGS):
            same, acc_sum, n_tok = 0, 0.0, 0
            outs = []
            for p in prompts:
                sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, **pen)
                ar = llm.generate(p, sp, spec=SpecPolicy(mode="off")).token_ids
                mtp = llm.generate(p, sp, spec=SpecPolicy(mode="mtp", k=3))
                ng = llm.generate(p, sp, spec=SpecPolicy(mode="ngram", k=3)).token_ids
                ok = ar == mtp.token_ids == ng
                same += ok
                bad += not ok
                acc_sum += float(mtp.stats.get("mean_accept_len") or 0.0)
                n_tok += len(ar)
                outs.append(ar)
                sps = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=7, **pen)
                smp = llm.generate(p, sps, spec=SpecPolicy(mode="mtp", k=3))
                note = smp.stats.get("penalties") or ""
                eager_said = (not pen) or ("eagerly" in note) == (args.device == "cuda")
                if not (0 < len(smp.token_ids) <= args.max_tokens) or not eager_said:
                    bad += 1
                    print(f"  sampled run wrong: {len(smp.token_ids)} tokens, penalties stat {note!r}", flush=True)
            if si == 0:
                plain_first = outs
            after_ok = (si != len(SETTINGS) - 1) or outs == plain_first
            bad += not after_ok
            rows.append({"penalties": pen, "greedy_equal": f"{same}/{len(prompts)}", "tokens": n_tok,
                         "mtp_mean_accept": round(acc_sum / len(prompts), 3), "plain_again_equal": after_ok})
            print(f"{json.dumps(pen):55s} AR == MTP == ngram {same}/{len(prompts)}  tokens {n_tok}  "
                  f"MTP accept {acc_sum / len(prompts):.2f}" + ("" if after_ok else "  PLAIN RUN CHANGED"), flush=True)
    res = {"rows": rows, "mismatches": bad, "device": args.device, "seconds": round(time.time() - t0, 1)}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "penalty_gpu.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
