"""The headline figures in one run: the 27B shape with random weights on one GPU, through `LLM.generate`.

    python -m bench.headline [--out DIR]      # one H200: about 6 minutes, most of it writing and loading weights
    python -m bench.headline --smoke          # CPU: the tiny shape, a few tokens (tests/bench/test_headline.py)

One random bf16 checkpoint with both final norms -1 (bench/common.py `write_checkpoint`: every logit
ties, greedy picks token 0, so every MTP draft is accepted) and its 4-bit copy made by `specfire
quantize`; three loads: bf16, bf16 with `draft_vocab=32768`, 4-bit with `draft_vocab=32768`. Each
load times AR and MTP k=3 on --reps fresh random prompts (modes alternating, after one warm-up
request each): the median of the requests' `decode_tok_s`, and the bandwidth it implies, tok/s x
the bytes one AR step moves (checkpoint tensors, KV, GDN state) / 4.17 TB/s; for MTP that is the
AR-equivalent fraction. Checks that MTP's tokens equal AR's and that every draft was accepted.
Prints a table, then one JSON line last; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.common import (CEILING, Log, checkpoint_step_bytes, device, machine, model_config, peak_gb, quantize,
                          random_prompt, reset_peak, scratch_dir, write_checkpoint)
from specfire import LLM, SamplingParams, SpecPolicy

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def measure(path: str, weights: str, draft_vocab: int | None, modes: list[str], args, dev: str) -> list[dict]:
    """One load: AR and MTP k=3 (or those in `modes`) over --reps prompts; one row per mode."""
    t = time.perf_counter()
    reset_peak()
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    spec = {"ar": SpecPolicy("off"), "mtp3": SpecPolicy("mtp", k=3)}
    rows = []
    with LLM(path, device=dev, progress=False, max_seq_len=args.prompt + args.tokens + 64,
             draft_vocab=draft_vocab) as llm:
        load_s = time.perf_counter() - t
        vocab = llm.cfg.vocab_size
        nbytes = checkpoint_step_bytes(path, args.prompt + args.tokens // 2, llm.dtype.itemsize)
        warm = random_prompt(vocab, args.prompt, seed=0)
        for m in ["ar"] + [m for m in modes if m != "ar"]:          # compile, capture the graphs
            llm.generate(warm, sp, spec=spec[m])
        say(f"{weights}, draft_vocab {draft_vocab}: loaded in {load_s:.1f} s, warm after {time.perf_counter() - t:.1f} s")
        runs: dict[str, list] = {m: [] for m in ["ar"] + modes}
        for rep in range(args.reps):
            ids = random_prompt(vocab, args.prompt, seed=rep + 1)
            for m in runs:
                runs[m].append(llm.generate(ids, sp, spec=spec[m]))
        ar_ids = [r.token_ids for r in runs["ar"]]
        ar_tok_s = statistics.median(r.stats["decode_tok_s"] for r in runs["ar"])
        for m in modes:
            rs = runs[m]
            tok_s = statistics.median(r.stats["decode_tok_s"] for r in rs)
            row = {"weights": weights, "route": m, "draft_vocab": draft_vocab or vocab, "tok_s": tok_s,
                   "bw_frac": tok_s * nbytes / CEILING, "step_bytes": nbytes, "reps": len(rs),
                   "tok_s_all": [r.stats["decode_tok_s"] for r in rs], "load_s": load_s}
            if m != "ar":
                drafted = sum(r.stats["drafted"] for r in rs)
                accepted = sum(r.stats["accepted"] for r in rs)
                cycle = statistics.median(r.stats["decode_s"] / max(1, r.stats["cycles"]) for r in rs)
                row.update(mean_accept_len=statistics.median(r.stats["mean_accept_len"] for r in rs),
                           all_accepted=drafted > 0 and accepted == drafted, cycle_ms=cycle * 1e3,
                           cycle_vs_ar=cycle * ar_tok_s, equals_ar=[r.token_ids for r in rs] == ar_ids)
            rows.append(row)
    del llm
    gc.collect()
    for r in rows:
        r["peak_gb"] = peak_gb()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> None:
    print("\n| weights | route | draft vocab | tok/s | of 4.17 TB/s | drafts accepted | cycle / AR step | = AR |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['weights']} | | {r['draft_vocab']} | error: {r['error'][:80]} | | | | |")
        elif r["route"] == "ar":
            print(f"| {r['weights']} | AR | - | {r['tok_s']:.1f} | {100 * r['bw_frac']:.1f}% | | | |")
        else:
            print(f"| {r['weights']} | MTP k=3 | {r['draft_vocab']} | {r['tok_s']:.1f} | "
                  f"{100 * r['bw_frac']:.1f}% (AR-equivalent) | {'all' if r['all_accepted'] else 'NOT all'} | "
                  f"{r['cycle_vs_ar']:.3f}x | {'yes' if r['equals_ar'] else 'NO'} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a request")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    ap.add_argument("--reps", type=int, default=3, help="timed requests per mode and load")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="the reduced draft vocabulary")
    ap.add_argument("--group-size", type=int, default=128, help="`specfire quantize --group-size`")
    ap.add_argument("--ckpt-dir", default=None, help="where the checkpoints go (default /dev/shm)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for headline.jsonl")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, few tokens")
    args = ap.parse_args()
    dev = device()
    if args.smoke:
        dev = "cpu"
        args.shape, args.prompt, args.tokens, args.reps, args.draft_vocab, args.group_size = "tiny", 16, 12, 1, 128, 32
    cfg = model_config(args.shape)
    log = Log(args.out, "headline.jsonl")
    info = {**machine(), "shape": args.shape, "prompt": args.prompt, "tokens": args.tokens, "reps": args.reps}
    log("start", **info)
    work = tempfile.mkdtemp(prefix="headline-", dir=args.ckpt_dir or scratch_dir())
    bf16, q4 = os.path.join(work, "bf16"), os.path.join(work, "q4")
    rows: list[dict] = []
    info["quantize_s"] = None

    def run(path, weights, dv, modes):
        try:
            got = measure(path, weights, dv, modes, args, dev)
        except Exception as e:                     # a load that fails must not cost the others their time
            got = [{"weights": weights, "draft_vocab": dv, "error": f"{type(e).__name__}: {e}"}]
        for r in got:
            log("figure", **r)
        rows.extend(got)

    try:
        write_checkpoint(bf16, cfg, torch.bfloat16, "cuda" if dev == "cuda" else "cpu", tied=True)
        say(f"wrote the {args.shape} bf16 checkpoint (final norms -1)")
        run(bf16, "bf16", None, ["ar", "mtp3"])
        run(bf16, "bf16", args.draft_vocab, ["mtp3"])
        qargs = ["--group-size", str(args.group_size)] + (["--device", "cpu"] if dev == "cpu" else [])
        info["quantize_s"] = round(quantize(bf16, q4, *qargs), 3)
        shutil.rmtree(bf16, ignore_errors=True)
        say(f"specfire quantize: {info['quantize_s']:.1f} s")
        run(q4, "4-bit", args.draft_vocab, ["ar", "mtp3"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table(rows)
    ok = all("error" not in r and (r["route"] == "ar" or (r["equals_ar"] and r["all_accepted"])) for r in rows)
    summary = {"bench": "headline", **info, "seconds": round(time.perf_counter() - T0, 1), "ok": ok,
               "results": [{k: v for k, v in r.items() if k != "tok_s_all"} for r in rows]}
    log("done", ok=ok, seconds=summary["seconds"])
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
