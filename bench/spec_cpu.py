"""Speculative decoding on the CPU: the bundled model's MTP and n-gram drafters against AR.

Prints, per route and k = 1..4, on held-out code prompts (bench/common.py held_out_prompts):
mean_accept_len (1 + accepted/cycles), acceptance per draft position, decode tok/s beside AR's
(AR timed right after each run, so both see the same load on a shared machine) and their ratio,
checking that every output equals AR's; then the cost of a rollback (trunk.commit) relative to a
verify of k+1 rows, on the bundled model and on a mid-size random one. One JSON line last.

    python -m bench.spec_cpu [--prompts 12] [--tokens 64] [--threads 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from bench.common import held_out_prompts, model_config, write_checkpoint
from specfire import LLM, SamplingParams


def spec_run(llm: LLM, prompts: list, n: int, spec, rounds: int = 1, beside=None) -> dict:
    """Greedy requests; acceptance pooled over every cycle of every request; decode time per
    prompt is the least over `rounds` repeats (the 2-core machine is shared, so load spikes).
    With `beside` (another policy, e.g. "off"), that policy runs right after each repeat, so both
    see the same load; its figures come back under "beside"."""
    cycles: list[tuple[int, int]] = []

    def record(k, acc, out):
        if k:
            cycles.append((k, acc))
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    tokens, decode_s, outs, b_s, b_outs = 0, 0.0, [], 0.0, []
    for p in prompts:
        best = b_best = None
        for r in range(rounds):
            res = llm.generate(p, sp, spec=spec, on_cycle=record if r == 0 else None)
            best = res.stats["decode_s"] if best is None else min(best, res.stats["decode_s"])
            if beside is not None:
                other = llm.generate(p, sp, spec=beside)
                b_best = other.stats["decode_s"] if b_best is None else min(b_best, other.stats["decode_s"])
        outs.append(res.token_ids)
        tokens += res.stats["generated_tokens"] - 1
        decode_s += best
        if beside is not None:
            b_outs.append(other.token_ids)
            b_s += b_best
    kmax = max((k for k, _ in cycles), default=0)
    per_pos = [sum(a > i for k, a in cycles if k > i) / max(1, sum(k > i for k, _ in cycles)) for i in range(kmax)]
    out = {
        "mean_accept_len": 1 + sum(a for _, a in cycles) / len(cycles) if cycles else 1.0,
        "accept_per_pos": per_pos,
        "all_accepted_frac": sum(a == k for k, a in cycles) / len(cycles) if cycles else 0.0,
        "decode_tok_s": tokens / decode_s,
        "outputs": outs,
    }
    if beside is not None:
        out["beside"] = {"decode_tok_s": tokens / b_s, "outputs": b_outs}
    return out


def rollback_cost(llm: LLM, ks: list[int], reps: int) -> list[dict]:
    trunk = llm.engine.trunk
    v = llm.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, v, (64,), generator=g)
    rows = []
    for k in ks:
        ids = torch.randint(0, v, (k + 1,), generator=g)
        tv, tc = [], []
        for _ in range(reps):
            trunk.begin()
            trunk.prefill(prompt)
            t0 = time.perf_counter()
            trunk.verify(ids, 64)
            t1 = time.perf_counter()
            trunk.commit(k // 2)
            t2 = time.perf_counter()
            tv.append(t1 - t0)
            tc.append(t2 - t1)
        v_ms, c_ms = min(tv) * 1e3, min(tc) * 1e3
        rows.append({"k": k, "verify_ms": v_ms, "commit_ms": c_ms, "commit_over_verify": c_ms / v_ms})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="repeats per request; the fastest counts")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="spec_cpu_")
    prompts = [p for _, p in held_out_prompts(args.prompts, 24)]
    res: dict = {"model": args.model or "bundled", "threads": args.threads, "prompts": len(prompts),
                 "tokens": args.tokens}

    with LLM(args.model, device="cpu", progress=False) as llm:
        spec_run(llm, prompts[:2], 16, "off")                      # warm-up
        ar = spec_run(llm, prompts, args.tokens, "off")
        res["ar_decode_tok_s"] = ar["decode_tok_s"]
        print(f"{res['model']}, {len(prompts)} held-out prompts x {args.tokens} tokens, {args.threads} thread(s)")
        print(f"AR decode {ar['decode_tok_s']:.0f} tok/s")
        print(f"{'route':6} {'k':>2} {'mean_acc_len':>12} {'tok/s':>8} {'AR tok/s':>8} {'vs AR':>6}  accept per position")
        res["mtp"], res["ngram"] = [], []
        for route in ("mtp", "ngram"):
            for k in (1, 2, 3, 4):
                r = spec_run(llm, prompts, args.tokens, {"mode": route, "k": k}, args.rounds, beside="off")
                a = r["beside"]                                      # AR timed right after each run
                assert r["outputs"] == ar["outputs"] == a["outputs"], f"{route} k={k} output differs from AR"
                row = {"k": k, "mean_accept_len": r["mean_accept_len"], "decode_tok_s": r["decode_tok_s"],
                       "ar_decode_tok_s": a["decode_tok_s"],
                       "speed_vs_ar": r["decode_tok_s"] / a["decode_tok_s"], "accept_per_pos": r["accept_per_pos"]}
                res[route].append(row)
                print(f"{route:6} {k:>2} {row['mean_accept_len']:>12.3f} {row['decode_tok_s']:>8.0f} "
                      f"{row['ar_decode_tok_s']:>8.0f} "
                      f"{row['speed_vs_ar']:>6.2f}  " + " ".join(f"{a:.2f}" for a in row["accept_per_pos"]))

        print("\nrollback (commit) vs verify, fastest of", args.reps)
        print(f"{'model':6} {'k':>2} {'verify ms':>10} {'commit ms':>10} {'ratio':>7}")
        res["rollback"] = {"model": rollback_cost(llm, [1, 2, 3, 4], args.reps)}
    mid = write_checkpoint(os.path.join(root, "mid"), model_config("mid"), torch.float32, "cpu")
    with LLM(mid, device="cpu", spec="off", progress=False) as llm:
        res["rollback"]["mid"] = rollback_cost(llm, [1, 2, 3, 4], args.reps)
    shutil.rmtree(root, ignore_errors=True)
    for name, rows in res["rollback"].items():
        for r in rows:
            print(f"{name:6} {r['k']:>2} {r['verify_ms']:>10.3f} {r['commit_ms']:>10.4f} {r['commit_over_verify']:>7.4f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
