"""The host side of a scheduler round: per request per round, the time the driving thread spends
outside the packed verify forward (staging, accept, commit, reads, text, events), at c requests
at once.

    python -m bench.round_host --concurrency 1,8 --tokens 96 --reps 5          # the bundled model, CPU
    python -m bench.round_host --ahead              # the GPU's one-step-ahead AR forced on (a CPU reads each step first)
    python -m bench.round_host --shape tiny --ahead  # random tiny weights: next to no device work, the Python shows

Each rep runs c greedy AR requests (ignore_eos) through LLM.generate and times every round in
which all c verifies shared the forward: host = round - verify_many, divided by c. On a GPU the
verify_many call only queues the forward: the host work after it runs beside the forward, the part
before it ("before fwd") is what the device waits through (AR goes ahead: its steps stage the next
forward before they read; a drafting step reads first, and a CPU's drafts are computed there).
Reports min and median over rounds, and the host waits on device -> host copies per request and
round. A table, then one JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--shape", default=None, help="random weights of this shape instead (bench/common.py SHAPES; "
                    "tiny: the device work is next to nothing, the host's Python shows)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spec", default="off", help="route of every request: off, mtp, ngram")
    ap.add_argument("--ahead", action="store_true", help="force the engines' one-step-ahead AR (queue_ahead)")
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest calls of the rounds (cProfile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CUDA graphs: the forward only queues)")
    args = ap.parse_args()

    from bench.common import model_config, random_prompt, write_checkpoint, write_tokenizer
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.api import BUNDLED_MODEL
    from specfire.runtime import scheduler as sch

    concs = [int(x) for x in args.concurrency.split(",")]
    rows = []
    path = args.model or BUNDLED_MODEL
    if args.shape:
        cfg = model_config(args.shape)
        path = write_checkpoint(os.path.join(tempfile.mkdtemp(prefix="round-host-"), args.shape), cfg,
                                torch.float32 if args.device == "cpu" else torch.bfloat16, args.device)
        write_tokenizer(path, cfg.vocab_size)
    with LLM(path, device=args.device, threads=args.threads, progress=False,
             max_seq_len=args.prompt_len + args.tokens + 16, max_num_seqs=max(concs)) as m:
        real_vm, real_round = sch.verify_many, sch.Scheduler.round
        cur = {"verify": 0.0, "calls": 0}

        def timed_vm(calls):
            t = cur["at"] = time.perf_counter()
            try:
                return real_vm(calls)
            finally:
                cur["verify"] += time.perf_counter() - t
                cur["calls"] = len(calls)

        samples: list[float] = []               # host s per request, one per full round
        per_round_reads: list[float] = []
        before: list[float] = []                # of which before the forward's launch
        reads = [0]

        shared = m.slots.first.shared
        real_read = None
        if getattr(shared, "reads", None) is None:     # (a build without batched reads: count per-step reads)
            from specfire.runtime import spec as spec_mod
            real_read = spec_mod.Launched.read

            def counted_read(self):
                if self.got is None:
                    reads[0] += 1
                return real_read(self)
            spec_mod.Launched.read = counted_read

        def timed_round(self):
            cur["verify"], cur["calls"] = 0.0, 0
            r0 = waits()
            t = time.perf_counter()
            real_round(self)
            dt = time.perf_counter() - t
            if cur["calls"] == c and len(self.running) == c:
                samples.append((dt - cur["verify"]) / c)
                before.append((cur["at"] - t) / c)
                per_round_reads.append((waits() - r0) / c)

        def waits() -> int:
            return reads[0] if real_read is not None else shared.reads.waits

        sch.verify_many, sch.Scheduler.round = timed_vm, timed_round
        if args.ahead:
            for e in m.slots.engines:
                e.queue_ahead = True
        pol = SpecPolicy(args.spec, 3) if args.spec != "off" else SpecPolicy("off")
        prof = None
        if args.profile:
            import cProfile
            prof = cProfile.Profile()
        try:
            for c in concs:
                prompts = [random_prompt(m.cfg.vocab_size, args.prompt_len, seed=i) for i in range(c)]
                sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
                m.generate(prompts, sp, spec=pol)        # warm-up (builds the slots)
                if args.ahead:
                    for e in m.slots.engines:
                        e.queue_ahead = True
                samples.clear()
                before.clear()
                per_round_reads.clear()
                reps = []
                for _ in range(args.reps):
                    n0 = len(samples)
                    if prof is not None and c == concs[-1]:
                        prof.enable()
                    m.generate(prompts, sp, spec=pol)
                    if prof is not None:
                        prof.disable()
                    reps.append(statistics.median(samples[n0:]) * 1e3)
                ms = sorted(x * 1e3 for x in samples)
                rows.append({"c": c, "rounds": len(ms), "host_ms_per_req_min": round(ms[0], 3),
                             "host_ms_per_req_median": round(statistics.median(ms), 3),
                             "before_forward_ms_per_req_median": round(statistics.median(before) * 1e3, 3),
                             "rep_medians_ms": [round(x, 3) for x in reps],
                             "reads_per_req_round": round(statistics.mean(per_round_reads), 2)})
        finally:
            sch.verify_many, sch.Scheduler.round = real_vm, real_round
            if real_read is not None:
                spec_mod.Launched.read = real_read
    print(f"{'c':>3} {'rounds':>7} {'host ms/req min':>16} {'median':>8} {'before fwd':>10} {'waits/req':>10}")
    for r in rows:
        print(f"{r['c']:>3} {r['rounds']:>7} {r['host_ms_per_req_min']:>16} {r['host_ms_per_req_median']:>8} "
              f"{r['before_forward_ms_per_req_median']:>10} {r['reads_per_req_round']:>10}")
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    print(json.dumps({"bench": "round_host", "model": args.shape or path, "spec": args.spec, "ahead": args.ahead, "tokens": args.tokens,
                      "threads": args.threads, "torch": torch.__version__, "levels": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
