"""`specfire run` decode speed on the CPU: AR on 2 threads, AR vs MTP vs auto on 1 thread.

Every measurement is one `specfire run` request made in this process exactly as the command makes
it (the flags parsed by specfire's own parser, `load_model`, then `llm.stream`; the sampling is
plain greedy with no penalty, not the model's generation_config.json defaults), and the figure is
the request's `decode_tok_s` (what `specfire run --json` prints). Modes alternate within each
repeat so load changes hit them alike; the median over repeats is reported. Pin the process to
cores from outside (`taskset -c 0,1`) to measure a 2-core machine on a bigger one.

    taskset -c 0,1 python -m bench.bundled_cpu [--model DIR] [--plan "2:off;1:off,mtp,auto"] [--reps 3]
Prints a table and one JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


from specfire import cli
from specfire.params import SamplingParams

PROMPTS = ("def fibonacci(n):",
           'class Stack:\n    """A last-in, first-out stack backed by a list."""\n\n    def __init__(self):\n')


def one_run(model: str | None, threads: int, mode: str, prompt: str, n: int, k: int) -> dict:
    argv = ["--threads", str(threads), "run", "--device", "cpu", "--spec", mode, "--spec-k", str(k),
            "-n", str(n), "--prompt", prompt, "--json"]
    if model:
        argv += ["--model", model]
    args = cli.build_parser().parse_args(argv)
    cli.apply_threads(args.threads)
    # plain greedy, no penalty: the model's own speed, not its generation_config.json defaults
    # (the sampling flags are unset here, so `specfire run` would take those)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with cli.load_model(args) as llm:
        res = None
        for chunk in llm.stream(prompt, sp):
            res = chunk.result
    s = res.stats
    return {"decode_tok_s": s["decode_tok_s"], "generated": s["generated_tokens"], "route": s["route"],
            "mean_accept_len": s.get("mean_accept_len", 0.0), "ids": res.token_ids}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--plan", default="2:off;1:off,mtp,auto", help="THREADS:MODE,MODE;... (modes: off | mtp | auto)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--label", default="", help="where this ran (e.g. 'H200 host CPU, taskset -c 0,1')")
    args = ap.parse_args()
    plan = [(int(t), m.split(",")) for t, m in (x.split(":") for x in args.plan.split(";"))]
    rows = []
    t0 = time.time()
    for threads, modes in plan:
        runs = {(m, p): [] for m in modes for p in range(len(PROMPTS))}
        for _ in range(args.reps):
            for pi, prompt in enumerate(PROMPTS):
                for m in modes:
                    runs[(m, pi)].append(one_run(args.model, threads, m, prompt, args.n, args.k))
        for m in modes:
            for pi in range(len(PROMPTS)):
                rs = runs[(m, pi)]
                same_as_ar = None
                if m != "off" and ("off", pi) in runs:
                    same_as_ar = all(r["ids"] == runs[("off", pi)][0]["ids"] for r in rs)
                rows.append({"threads": threads, "mode": m, "prompt": pi,
                             "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                             "all_tok_s": [round(r["decode_tok_s"], 1) for r in rs],
                             "mean_accept_len": rs[-1]["mean_accept_len"], "route": rs[-1]["route"],
                             "generated": rs[-1]["generated"], "same_as_ar": same_as_ar})
    print(f"{'threads':>7} {'mode':>5} {'prompt':>6} {'tok/s (median)':>15} {'x AR':>6} {'accept':>6}  runs")
    for r in rows:
        ar = next(x for x in rows if x["threads"] == r["threads"] and x["prompt"] == r["prompt"]
                  and x["mode"] == "off") if any(x["mode"] == "off" and x["threads"] == r["threads"]
                                                 for x in rows) else None
        r["x_ar"] = r["decode_tok_s"] / ar["decode_tok_s"] if ar else None
        print(f"{r['threads']:>7} {r['mode']:>5} {r['prompt']:>6} {r['decode_tok_s']:>15.1f} "
              f"{(r['x_ar'] or float('nan')):>6.2f} {r['mean_accept_len']:>6.2f}  {r['all_tok_s']} "
              f"{'(output == AR)' if r['same_as_ar'] else '' if r['same_as_ar'] is None else '(OUTPUT DIFFERS)'}")
    print(json.dumps({"bench": "bundled_cpu", "model": args.model or "bundled", "label": args.label,
                      "n": args.n, "k": args.k, "reps": args.reps, "affinity": sorted(os.sched_getaffinity(0)),
                      "seconds": round(time.time() - t0, 1), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
