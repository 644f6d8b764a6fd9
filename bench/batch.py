"""Concurrent decoding in process: `LLM.generate` of c prompts at once (one packed verify forward a
round over every running request, runtime/scheduler.py), against c = 1.

    python -m bench.batch --shape 27B --tied --concurrency 1,2,4,8 --spec off,mtp
    python -m bench.batch --exact-only           # the bundled model: mixed requests at once == each alone
    python -m bench.batch --smoke                # CPU: the bundled model, tiny levels and the check
    python -m bench.batch --shape 27B --tied --concurrency 4 --spec off --join 32768   # a long prompt joins
    python -m bench.batch --shape 27B --tied --tp 2 --tp-invariant    # on a 2-rank mesh (one packed call a round)

Per (route, c): one warm-up batch (kernels, CUDA graphs of each row layout), then c requests of a
--prompt-len random prompt generating --output-len tokens each (greedy, ignore_eos). Reports the
aggregate tok/s (all tokens / wall time, prefills included), its ratio to c = 1, per-request decode
tok/s, the forwards the scheduler ran (verifies per forward) and, for AR on one device, the fraction of the
bandwidth ceiling a round's bytes reach (the weights once plus every request's state), the median
wall time of a round whose forward held all c verifies (decode alone) and the prefills' seconds
(run one request at a time, inside the wall time). The in-process
rate is what bench/serving.py's HTTP figures are held against; `--requests N` offers its load:
N requests of fresh prompts per level, at most c in flight, each next one submitted when one ends
(driven on one thread, as the server's engine thread drives them). `--exact` (default on) first runs
eight requests of mixed policies (AR, MTP k=1 / 3, n-gram, seeded sampled, penalised, min_tokens)
on the bundled model, alone and then all at once in both arrival orders, and records whether each
output equals its own alone (bf16 and Q8 KV on a GPU). `--join N`: while the largest
concurrency's AR streams run, an N-token prompt arrives; its prefill goes one piece a round between
their steps, and the streams' inter-token gaps while it prefills (p50 / p99 / max) are held against
their median gap before it came. A table, then one JSON line last.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile
import time

import torch

from bench.common import (CEILING, checkpoint_step_bytes, machine, model_config, random_prompt, scratch_dir,
                          state_bytes, write_checkpoint, write_tokenizer)


def level(m, mode: str, k: int, c: int, args, step_bytes: int, per_seq: int) -> dict:
    from specfire import SamplingParams, SpecPolicy

    pol = SpecPolicy(mode, k) if mode != "off" else SpecPolicy("off")
    vocab = m.cfg.vocab_size
    prompts = [random_prompt(vocab, args.prompt_len, seed=100 * c + i) for i in range(c)]
    m.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * c, spec=[pol] * c)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    if args.requests:   # untimed, other prompts: the row patterns of the loop's joins and ends captured
        closed_loop(m, sp, pol, c, 2 * c, args.prompt_len, vocab, seed=1)      # (as bench/serving.py warms)
    s = m.scheduler
    f0, v0 = s.forwards, s.verifies
    rounds: list[float] = []                # wall time of the rounds whose forward held all c verifies

    def timed_round(real=s.round) -> None:
        v, t0 = s.verifies, time.perf_counter()
        real()
        if s.verifies - v == c:
            rounds.append(time.perf_counter() - t0)
    s.round = timed_round                   # (the driving thread calls self.round())
    t, cpu = time.perf_counter(), time.thread_time()
    try:
        if args.requests:
            rs = closed_loop(m, sp, pol, c, args.requests, args.prompt_len, vocab)
        else:
            rs = m.generate(prompts, [sp] * c, spec=[pol] * c)
    finally:
        del s.round
    dt, cpu = time.perf_counter() - t, time.thread_time() - cpu
    toks = sum(len(r.token_ids) for r in rs)
    fw = s.forwards - f0
    dec = sorted(r.stats["decode_tok_s"] for r in rs)
    row = {"route": mode, "k": k, "c": c, "tokens": toks, "wall_s": round(dt, 3), "agg_tok_s": round(toks / dt, 1),
           "decode_tok_s_min": round(dec[0], 1), "decode_tok_s_median": round(dec[len(dec) // 2], 1),
           "forwards": fw, "verifies_per_forward": round((s.verifies - v0) / fw, 2) if fw else 0.0,
           "mean_accept_len": round(rs[0].stats["mean_accept_len"], 2),
           "round_ms_median": round(sorted(rounds)[len(rounds) // 2] * 1e3, 2) if rounds else 0.0,
           "prefill_s": round(sum(r.stats["prefill_s"] for r in rs), 3),
           # the driving thread's CPU per token (what a server's engine process spends beside it)
           "host_cpu_ms_per_tok": round(cpu / toks * 1e3, 4) if toks else 0.0}
    if mode == "off" and fw and torch.cuda.is_available() and m.tp == 1:
        round_bytes = step_bytes + (c - 1) * per_seq
        row["of_ceiling"] = round(round_bytes * fw / dt / CEILING, 3)
    return row


def closed_loop(m, sp, pol, c: int, n: int, prompt_len: int, vocab: int, seed: int = 0) -> list:
    """n requests of fresh prompts, at most c in flight, the next submitted when one ends (what
    bench/serving.py's clients offer the server), driven on this one thread as the server's engine
    thread drives them: the results (`seed`: another set of prompts)."""
    from specfire.runtime import scheduler as sch

    out: list = []
    failed: list = []
    sent = 0

    def submit() -> None:
        nonlocal sent
        ids = random_prompt(vocab, prompt_len, seed=10_000 + 97 * c + sent + 10 ** 9 * seed)
        sent += 1
        m.scheduler.submit(sch.Request(ids, sp, pol, on_event))

    def on_event(kind: str, payload) -> None:
        if kind == sch.DONE:
            out.append(payload.result)
            if sent < n:
                submit()
        elif kind in (sch.ERROR, sch.CANCELLED):
            failed.append((kind, payload))  # (a handler's exception would only be logged)

    for _ in range(min(c, n)):
        submit()
    m.scheduler.drive_until(lambda: len(out) + len(failed) == n or bool(failed))
    if failed:
        raise RuntimeError(f"a closed-loop request ended with {failed[0][0]}: {failed[0][1]}")
    return out


def join(m, c: int, n: int, args) -> dict:
    """c AR streams; once each has streamed 16 chunks an n-token prompt arrives (one warm-up first,
    for its prefill's kernels): the streams' gaps between chunks before it arrived, and while it
    prefilled (until its first token)."""
    import threading

    from specfire import SamplingParams

    vocab = m.cfg.vocab_size
    long_prompt = random_prompt(vocab, n, seed=999)
    m.generate(long_prompt, SamplingParams(max_tokens=1))
    prompts = [random_prompt(vocab, args.prompt_len, seed=700 + i) for i in range(c)]
    stamps: list[list[float]] = [[] for _ in range(c)]
    stop = threading.Event()

    def run(i: int) -> None:
        sp = SamplingParams(max_tokens=m.max_seq_len - args.prompt_len - 1, ignore_eos=True)
        for _ in m.stream(prompts[i], sp, spec="off"):
            stamps[i].append(time.perf_counter())
            if stop.is_set():
                break                  # closing the stream cancels the request

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(c)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 16:
        time.sleep(0.005)
    t_join = time.perf_counter()
    first = m.generate(long_prompt, SamplingParams(max_tokens=1))
    t_first = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (before if b <= t_join else during if b <= t_first else []).append(b - a)
    before, during = sorted(before[c:]), sorted(during)   # the first gaps may include prefills

    def pct(xs: list[float], q: float) -> float:
        return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else 0.0

    med = pct(before, 0.5)
    return {"c": c, "join_tokens": n, "join_ttft_s": round(t_first - t_join, 3),
            "gap_ms_median_before": med, "gap_ms_p50_during": pct(during, 0.5), "gap_ms_p99_during": pct(during, 0.99),
            "gap_ms_max_during": pct(during, 1.0), "gaps_during": len(during),
            "p99_over_median": round(pct(during, 0.99) / med, 2) if med else 0.0,
            "join_cached_tokens": first.stats.get("cached_tokens", 0)}


def mixed(max_tokens: int):
    """(SamplingParams, SpecPolicy) of the exactness check's eight requests."""
    from specfire import SamplingParams as S, SpecPolicy as P

    n = max_tokens
    return [(S(max_tokens=n), P("off")), (S(max_tokens=n + 8), P("mtp", 3)),
            (S(max_tokens=n - 4, temperature=0.8, seed=5), P("ngram", 2)),
            (S(max_tokens=n + 4, frequency_penalty=0.5, repetition_penalty=1.1), P("auto", 3)),
            (S(max_tokens=n + 20, temperature=0.9, top_p=0.9, seed=11), P("mtp", 3)),
            (S(max_tokens=n - 8, min_tokens=(n - 8) // 2), P("off")), (S(max_tokens=n + 10), P("mtp", 1)),
            (S(max_tokens=n + 10), P("off"))]


def exact(path: str, max_tokens: int, kw: dict) -> list[dict]:
    """Each mixed request alone, then all at once in arrival and reversed order: equal or not."""
    from specfire import LLM
    from specfire.config import ModelConfig
    from specfire.runtime.graphs import PackedChains

    reqs = mixed(max_tokens)
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = [random_prompt(vocab, 20 + 7 * i, seed=i) for i in range(len(reqs))]
    sps, pols = [sp for sp, _ in reqs], [p for _, p in reqs]
    out = []
    for kv in ("auto", "q8") if torch.cuda.is_available() else ("auto",):
        with LLM(path, progress=False, max_seq_len=1024, max_num_seqs=len(reqs), kv_dtype=kv, **kw) as m:
            alone_r = [m.generate(p, sp, spec=pol) for p, sp, pol in zip(prompts, sps, pols)]
            alone = [r.token_ids for r in alone_r]
            fwd0, ver0 = m.scheduler.forwards, m.scheduler.verifies
            got_r = m.generate(prompts, sps, spec=pols)
            got = [r.token_ids for r in got_r]
            rev = [r.token_ids for r in m.generate(prompts[::-1], sps[::-1], spec=pols[::-1])][::-1]
            rec = {"kv_dtype": kv, "equal": [a == b for a, b in zip(alone, got)],
                   "equal_reversed": [a == b for a, b in zip(alone, rev)],
                   # drafts change what is accepted, never what is emitted: the same acceptance alone and
                   # together says the packed chains drafted what each chain drafts alone
                   # (None: an `auto` request, whose route choice accounts for the batch)
                   "accepted_as_alone": [None if pol.mode == "auto" else a.stats.get("per_route") == b.stats.get("per_route")
                                         for a, b, pol in zip(alone_r, got_r, pols)],
                   "verifies_per_forward": round((m.scheduler.verifies - ver0) / max(1, m.scheduler.forwards - fwd0), 2)}
            packs = getattr(m.slots.first.trunk, "packs", None)
            if packs is not None:           # CUDA graphs: how often a packed graph was re-pointed at other slots
                rec.update(packed_graphs=len(packs.graphs), captures=packs.captures, rebinds=packs.rebinds)
            mtp = m.slots.first.drafters.get("mtp")
            chains = PackedChains.of(mtp.head) if mtp is not None else None
            if chains is not None:          # the same for the packed draft chains
                rec.update(chain_graphs=len(chains.graphs), chain_captures=chains.captures, chain_rebinds=chains.rebinds)
            print(json.dumps({"stage": "exact", **rec}), flush=True)
            out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--shape", default=None, help="random weights of this shape (bench/common.py SHAPES)")
    ap.add_argument("--tied", action="store_true", help="--shape: final norms -1, every MTP draft accepted")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--spec", default="off,mtp", help="routes: off, mtp, ngram (comma-separated)")
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="slots (default: the largest concurrency)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the exact check runs on it too)")
    ap.add_argument("--tp-invariant", action="store_true", help="LLM(tp_invariant=True): the bits of every degree")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for batch.json")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                    help="first check mixed requests at once == each alone on the bundled model")
    ap.add_argument("--exact-only", action="store_true", help="only that check")
    ap.add_argument("--join", type=int, default=None, metavar="N",
                    help="also: an N-token prompt joins the largest concurrency's AR streams")
    ap.add_argument("--prefill-piece", default=None, metavar="ROWS[,ROWS...]",
                    help="prompt rows per prefill forward (what a joining prompt costs the running streams' round); "
                         "with --join, several values join once each")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="per level, N requests of fresh prompts with at most c in flight (closed loop, as "
                         "bench/serving.py offers them) instead of one batch of c")
    ap.add_argument("--smoke", action="store_true", help="CPU: the bundled model, tiny levels")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.model, args.concurrency, args.prompt_len, args.output_len = None, None, "1,2", 12, 8
        args.join = args.join and 48
    concs = [int(x) for x in args.concurrency.split(",")]
    routes = args.spec.split(",")
    from specfire import LLM
    from specfire.api import BUNDLED_MODEL

    kw = {"device": "cpu", "threads": 1} if args.smoke else {}
    kw.update(tp=args.tp, tp_invariant=args.tp_invariant)
    checks = exact(BUNDLED_MODEL, 12 if args.smoke else 40, kw) if args.exact or args.exact_only else []
    ok = all(all(c["equal"]) and all(c["equal_reversed"]) for c in checks)
    if args.exact_only:
        print(json.dumps({"bench": "batch", **machine(), "exact": checks, "ok": ok}))
        return 0 if ok else 1
    work = tempfile.mkdtemp(prefix="batch-", dir=scratch_dir() if args.shape else None)
    atexit.register(shutil.rmtree, work, True)      # a --shape checkpoint in /dev/shm is tens of GB of RAM
    path = args.model or BUNDLED_MODEL
    if args.shape:
        cfg = model_config(args.shape)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        path = write_checkpoint(os.path.join(work, args.shape), cfg, torch.bfloat16 if dev == "cuda" else torch.float32,
                                dev, tied=args.tied)
        write_tokenizer(path, cfg.vocab_size)
    rows, joined = [], None
    seq_len = args.prompt_len + args.output_len + 16
    if args.join:
        seq_len = max(seq_len, args.join + 16, args.prompt_len + 4 * args.output_len)
    with LLM(path, progress=False, max_seq_len=seq_len, max_num_seqs=args.max_num_seqs or max(concs) + bool(args.join),
             **kw) as m:
        pieces = [int(x) for x in args.prefill_piece.split(",")] if args.prefill_piece else []
        if pieces:                          # (before any other slot is built: a slot takes the first one's)
            m.engine.trunk.piece = pieces[0]
        piece = m.engine.trunk.piece
        ctx = args.prompt_len + args.output_len // 2
        step, per_seq = checkpoint_step_bytes(path, ctx), state_bytes(m.cfg, ctx)
        for mode in routes:
            for c in concs:
                rows.append(level(m, mode, args.spec_k if mode != "off" else 0, c, args, step, per_seq))
                base = next(r for r in rows if r["route"] == mode)
                rows[-1]["x_c1"] = round(rows[-1]["agg_tok_s"] / base["agg_tok_s"], 2)
                print(json.dumps({"stage": "level", **rows[-1]}), flush=True)
        if args.join:
            joined = []
            for p in pieces or [piece]:
                for eng in m.slots.engines:   # every slot prefills in pieces of p rows
                    eng.trunk.piece = p
                joined.append({"prefill_piece": p, **join(m, max(concs), args.join, args)})
                print(json.dumps({"stage": "join", **joined[-1]}), flush=True)
    print(f"{'route':6} {'c':>3} {'agg tok/s':>10} {'x c=1':>6} {'decode p50':>10} {'verif/fwd':>9} {'of ceil':>8} "
          f"{'round ms':>8} {'prefill s':>9}")
    for r in rows:
        print(f"{r['route']:6} {r['c']:>3} {r['agg_tok_s']:>10} {r['x_c1']:>6} {r['decode_tok_s_median']:>10} "
              f"{r['verifies_per_forward']:>9} {r.get('of_ceiling', ''):>8} {r['round_ms_median']:>8} {r['prefill_s']:>9}")
    model = f"random {args.shape}{' tied' if args.tied else ''}" if args.shape else path
    summary = {"bench": "batch", **machine(), "model": model, "tp": args.tp, "prefill_piece": piece,
               "prompt_len": args.prompt_len,
               "output_len": args.output_len, "levels": rows, "join": joined, "exact": checks, "ok": ok}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "batch.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
