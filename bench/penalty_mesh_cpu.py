"""Penalised against unpenalised greedy decoding on the CPU: one device and a 2-rank gloo mesh.

The tiny random checkpoint of tests/test_tp.py (the `base` recipe, seed 7: vocab 131, float32),
the prompt of its penalty test (30 random ids + a repeat of the first 15), canonical split-K mode
on the one device (the bits a mesh reproduces, as the tests run it). For each of three settings
(none; repetition_penalty 1.3; frequency 0.6 + presence 0.4) and each route (AR, MTP k=3, n-gram
k=4), `--tokens` tokens with end-of-text ignored, so every run generates the same count; the runs
are interleaved over `--reps` rounds (the machine is shared) and the median wall time per token is
printed. Then the same requests once more under cProfile on rank 0 (this process): Python function
calls per generated token and the top cumulative-time entries of one AR request with and without a
penalty, which says whether the penalised path does more host-side work. Then the penalty's own
cost alone: `penalize` on one and on four gathered rows plus the counts' update, timed in a loop.

Last, the two prompts of test_tp.py's greedy and penalty tests run as the tests run them (40 tokens
asked, end-of-text honoured), to show how many tokens each test really generates.

    PYTHONPATH=$PWD python bench/penalty_mesh_cpu.py [--tokens 40] [--reps 5] [--tp 1 2]
Prints tables and one JSON line last; exits 1 if a penalised mesh output differs from one device's.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SETTINGS = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.6, "presence_penalty": 0.4}]
ROUTES = [("off", 0), ("mtp", 3), ("ngram", 4)]


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    """test_tp.py's prompt: n random ids and a repeat of the first n // 2."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, vocab - 1, (n,), generator=g).tolist()
    return body + body[: n // 2]


def label(kw: dict) -> str:
    return ", ".join(f"{k.split('_')[0]} {v:g}" for k, v in kw.items()) or "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)                     # as tests/conftest.py: tiny model, shared cores

    from tinymodels import make_checkpoint

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.kernels import canonical

    path = make_checkpoint(os.path.join(tempfile.mkdtemp(prefix="penmesh-"), "base"), "base", seed=7)
    canonical.set_enabled(True)
    llms = {tp: LLM(path, tp=tp, device="cpu", progress=False) for tp in args.tp}
    vocab = llms[args.tp[0]].cfg.vocab_size
    ids = prompt(vocab, 30, seed=6)
    for llm in llms.values():
        llm.generate(ids, SamplingParams(max_tokens=4), spec="off")                    # warm-up
        for kw in SETTINGS:
            for route, k in ROUTES:
                llm.generate(ids, SamplingParams(max_tokens=4, **kw), spec=SpecPolicy(route, k=k) if k else "off")

    times: dict[tuple, list[float]] = {}
    outs: dict[tuple, list[int]] = {}
    for _ in range(args.reps):
        for tp, llm in llms.items():
            for kw in SETTINGS:
                for route, k in ROUTES:
                    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **kw)
                    t0 = time.perf_counter()
                    res = llm.generate(ids, sp, spec=SpecPolicy(route, k=k) if k else "off")
                    dt = time.perf_counter() - t0
                    key = (tp, label(kw), res.stats["route"])
                    times.setdefault(key, []).append(dt / len(res.token_ids) * 1e3)
                    outs[key] = res.token_ids
    rows = []
    print(f"{'tp':>3} {'penalty':>22} {'route':>6} {'ms/token (median)':>18} {'min':>7} {'max':>7}")
    for (tp, pen, route), v in times.items():
        med = statistics.median(v)
        rows.append(dict(tp=tp, penalty=pen, route=route, ms_per_token=med, min=min(v), max=max(v)))
        print(f"{tp:>3} {pen:>22} {route:>6} {med:>18.2f} {min(v):>7.2f} {max(v):>7.2f}")
    ok = True
    if 1 in llms and len(llms) > 1:
        for (tp, pen, route), toks in outs.items():
            if tp != 1 and toks != outs[(1, pen, "ar")]:
                ok = False
                print(f"MISMATCH tp={tp} {pen} {route}")
    print(f"every route on every mesh == one device's AR: {ok}")

    prof = []
    for tp, llm in llms.items():
        for kw in SETTINGS:
            for route, k in ROUTES:
                sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **kw)
                pr = cProfile.Profile()
                pr.enable()
                res = llm.generate(ids, sp, spec=SpecPolicy(route, k=k) if k else "off")
                pr.disable()
                st = pstats.Stats(pr)
                n = len(res.token_ids)
                prof.append(dict(tp=tp, penalty=label(kw), route=res.stats["route"],
                                 calls_per_token=st.total_calls / n, prof_ms_per_token=st.total_tt / n * 1e3))
                if route == "off" and kw in (SETTINGS[0], SETTINGS[2]):
                    buf = io.StringIO()
                    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(8)
                    print(f"--- cProfile, tp={tp}, AR, penalty {label(kw)}: top 8 by own time")
                    print("\n".join(ln for ln in buf.getvalue().splitlines()[6:] if ln.strip()))
    print(f"{'tp':>3} {'penalty':>22} {'route':>6} {'py calls/token':>15} {'profiled ms/token':>18}")
    for p in prof:
        print(f"{p['tp']:>3} {p['penalty']:>22} {p['route']:>6} {p['calls_per_token']:>15.0f} "
              f"{p['prof_ms_per_token']:>18.2f}")

    # the penalty's own host work per step: `penalize` on rank 0's gathered rows + the counts' update
    from specfire.runtime.sampling import Penalties, penalize
    pen = Penalties(vocab, "cpu").begin(torch.tensor(ids))
    unit = []
    for kw in SETTINGS[1:]:
        sp = SamplingParams(**kw)
        for r in (1, 4):
            logits = torch.randn(r, vocab)
            draft = torch.randint(0, vocab, (r - 1,))
            targets = torch.randint(0, vocab, (r,))
            n = torch.tensor(0)
            calls = 2000
            with torch.inference_mode():
                t0 = time.perf_counter()
                for _ in range(calls):
                    penalize(logits, pen, sp, draft if r > 1 else None)
                    pen.add(targets, n)
                dt = (time.perf_counter() - t0) / calls * 1e6
            unit.append(dict(penalty=label(kw), rows=r, us_per_step=dt))
            print(f"penalize + count, {label(kw)}, {r} verify row(s): {dt:.1f} us a step")

    tests = []
    for name, seed, settings, routes in (
            ("test_greedy_ar_mtp_ngram_on_mesh_equal_ar", 2, [{}], [("off", 0), ("mtp", 1), ("mtp", 3), ("mtp", 5), ("ngram", 4)]),
            ("test_penalties_on_mesh_equal_ar", 6, SETTINGS[1:], [("off", 0), ("mtp", 3), ("ngram", 4)])):
        p = prompt(vocab, 30, seed=seed)
        for kw in settings:
            for tp, llm in llms.items():
                for route, k in (routes if tp != 1 else [("off", 0)]):
                    res = llm.generate(p, SamplingParams(max_tokens=40, **kw),
                                       spec=SpecPolicy(route, k=k) if k else "off")
                    tests.append(dict(test=name, tp=tp, penalty=label(kw), route=f"{route}{k or ''}",
                                      tokens=len(res.token_ids)))
    print(f"{'test':>42} {'tp':>3} {'penalty':>22} {'route':>6} {'tokens':>6}")
    for t in tests:
        print(f"{t['test']:>42} {t['tp']:>3} {t['penalty']:>22} {t['route']:>6} {t['tokens']:>6}")
    for llm in llms.values():
        llm.close()
    print(json.dumps({"tokens": args.tokens, "reps": args.reps, "rows": rows, "profile": prof, "tests": tests, "penalize_us": unit,
                      "identical": ok, "loadavg": os.getloadavg()[0]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
