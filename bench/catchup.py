"""The MTP head's prompt catch-up (`MtpDrafter.begin`: the head's one decoder layer over the prompt's
rows but the last, in prefill mode) on one GPU, 27B shape, 4-bit, with the catch-up's fused kernels
off and on in the same process (kernels/head `catchup_enabled`, SPECFIRE_CATCHUP_FUSE; switched
with `set_catchup`).

    PYTHONPATH=$PWD python bench/catchup.py --shape 27B --vocab 32768 --budget-s 140 --out $OUT
    PYTHONPATH=$PWD python bench/catchup.py --smoke          # the flow on the CPU, tiny shape

Checkpoint: bench/tp_mtp.py's 4-bit one with both final norms -1 (bench/draft_vocab.py tie_norms:
every logit ties, greedy picks token 0, every draft accepted), loaded with `draft_vocab=N`; a
512-token random prompt. Stages, each skipped when the --budget-s would run out:

1. `begin` timed per mode (off / on alternately, --reps each): after a prefill and a sync, CUDA
   events around the call (the device span from the call's start, idle waits for the host
   included), the host's time to return from the call (its launches), and the wall time to the
   end of the device work; medians and minima. The head's KV rows after it, compared across the
   modes (bitwise, and the largest difference).
2. End to end through `LLM.generate` per --e2e-modes entry (main: both changes off; fused: the
   catch-up's kernels; fused_prefix: and `MtpDrafter.prefix`, a request's shorter last cycle
   taking the first drafts of the chain queued for k): AR and MTP k=3 at --tokens and --long new tokens
   (median of --e2e-reps at --tokens), cycle / AR, MTP == AR, time to the first token; whether
   the catch-up's device work had ended when the decode clock started (an event recorded after
   `begin`, queried at the drafter's first commit); per-cycle host intervals of one MTP run.
3. The catch-up captured as a CUDA graph per mode and replayed: its device time without the host.
4. Last (a profiler session slows the process's later launches): torch.profiler over one `begin`
   per mode: the kernels in order with their device time, the launches, the device's idle gaps,
   the host span; chrome traces in OUT.
One JSON line per record on stdout and in OUT/catchup.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tp import CEILING, Log, _time_graph, md5, smoke_shapes  # noqa: E402

MODES = (("unfused", False), ("fused", True))
# end to end: (the catch-up's fused kernels, MtpDrafter.prefix: a shorter last cycle takes the first
# drafts of the chain queued for k); "main" is the path before both
E2E_MODES = {"main": (False, False), "fused": (True, False), "fused_prefix": (True, True),
             "prefix": (False, True)}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _prefilled(llm, prompt):
    trunk = llm.engine.trunk
    trunk.begin()
    with torch.inference_mode():
        return trunk.prefill(prompt)


def time_begin(llm, prompt, on: bool, reps: int, cuda: bool) -> tuple[dict, tuple]:
    from specfire.kernels import head as head_fused

    mtp = llm.engine.drafters["mtp"]
    head_fused.set_catchup(on)
    dev, host, wall = [], [], []
    try:
        for _ in range(reps):
            rows = _prefilled(llm, prompt)
            _sync(cuda)
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            mtp.begin(prompt, rows.hidden)
            t1 = time.perf_counter()
            if cuda:
                e1.record()
                e1.synchronize()
                dev.append(e0.elapsed_time(e1))
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
        n = prompt.shape[0] - 1
        lc = mtp.state.layers[0]
        kv = (lc.k[:n].clone(), lc.v[:n].clone())
    finally:
        head_fused.set_catchup(None)
    r = lambda xs: round(statistics.median(xs), 3) if xs else None   # noqa: E731
    m = lambda xs: round(min(xs), 3) if xs else None                 # noqa: E731
    return dict(device_span_ms=r(dev), device_span_min_ms=m(dev), host_ms=r(host), host_min_ms=m(host),
                wall_ms=r(wall), wall_min_ms=m(wall), runs_wall_ms=[round(x, 3) for x in wall]), kv


def graph_begin(llm, prompt, on: bool) -> float:
    """The catch-up (`MtpDrafter._prefill` over the prompt's rows) captured and replayed: device ms."""
    from specfire.kernels import head as head_fused

    mtp = llm.engine.drafters["mtp"]
    rows = _prefilled(llm, prompt)
    toks, hid = prompt[1:], rows.hidden[:-1]
    head_fused.set_catchup(on)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            mtp._prefill(toks, hid, 0)                 # warm: the rotary table built outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.inference_mode():
            mtp._prefill(toks, hid, 0)
        ms = _time_graph(g, 10) * 1e3
        del g
        return ms
    finally:
        head_fused.set_catchup(None)


def e2e(llm, ids, on: bool, prefix: bool, tokens: int, long: int, reps: int, cuda: bool, nbytes) -> dict:
    from specfire import SamplingParams, SpecPolicy
    from specfire.kernels import head as head_fused

    mtp = llm.engine.drafters["mtp"]
    pol = SpecPolicy("mtp", k=3)
    clock = {}
    cls_begin, cls_commit = type(mtp).begin, type(mtp).commit

    def begin(prompt, hidden):
        cls_begin(mtp, prompt, hidden)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            clock.update(ev=ev)
        clock.update(first=True)

    def commit(out, hidden, out_dev):
        if clock.get("first"):
            clock.update(first=False, t1=time.perf_counter(),
                         done=clock["ev"].query() if "ev" in clock else None)
        cls_commit(mtp, out, hidden, out_dev)

    head_fused.set_catchup(on)
    mtp.begin, mtp.commit = begin, commit
    mtp.prefix = prefix
    try:
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), spec=pol)
        ar_s, cyc_s, ttft_ar, ttft_m, eq, done, ar_ids, tau = [], [], [], [], True, [], None, 0.0
        req_ar, req_m = [], []                # the whole request: prefill_s + decode_s
        for _ in range(reps):
            a = llm.generate(ids, sp, spec="off")
            m = llm.generate(ids, sp, spec=pol)
            done.append(clock.get("done"))
            ar_s.append(a.stats["decode_s"] / max(1, len(a.token_ids) - 1))
            cyc_s.append(m.stats["decode_s"] / max(1, m.stats["cycles"]))
            ttft_ar.append(a.stats["prefill_s"])
            ttft_m.append(m.stats["prefill_s"])
            req_ar.append(a.stats["prefill_s"] + a.stats["decode_s"])
            req_m.append(m.stats["prefill_s"] + m.stats["decode_s"])
            ar_ids = ar_ids or a.token_ids
            eq = eq and m.token_ids == a.token_ids == ar_ids
            tau = m.stats["mean_accept_len"]
        ar, cyc = statistics.median(ar_s), statistics.median(cyc_s)
        row = dict(tokens=tokens, ar_step_ms=round(ar * 1e3, 3), ar_tok_s=round(1 / ar, 1),
                   ar_of_ceiling=round(nbytes / ar / CEILING, 4), mtp3_cycle_ms=round(cyc * 1e3, 3),
                   mtp3_tok_s=round(tau / cyc, 1), cycle_over_ar=round(cyc / ar, 4), tau=round(tau, 3),
                   mtp_equals_ar=eq, ar_md5=md5(ar_ids), cycle_runs_ms=[round(x * 1e3, 3) for x in cyc_s],
                   ar_runs_ms=[round(x * 1e3, 3) for x in ar_s],
                   prefill_ms_ar=round(statistics.median(ttft_ar) * 1e3, 3),
                   prefill_ms_mtp=round(statistics.median(ttft_m) * 1e3, 3),
                   request_ms_ar=round(statistics.median(req_ar) * 1e3, 3),
                   request_ms_mtp=round(statistics.median(req_m) * 1e3, 3),
                   catchup_done_when_decode_clock_starts=done)
        # one MTP run's cycles on the host: from the decode clock's start (the first commit) to each
        ts: list[float] = []
        llm.generate(ids, sp, spec=pol, on_cycle=lambda k, n, out: ts.append(time.perf_counter()))
        if ts and "t1" in clock:
            row["cycle_intervals_ms"] = _intervals(clock["t1"], ts)
        ts = []                               # AR steps alike, from the first step's launch-to-read
        llm.generate(ids, sp, spec="off", on_cycle=lambda k, n, out: ts.append(time.perf_counter()))
        if len(ts) > 1:
            row["ar_step_intervals_ms"] = _intervals(ts[0], ts[1:])
        if long:
            lsp = SamplingParams(max_tokens=long, ignore_eos=True)
            a = llm.generate(ids, lsp, spec="off")
            m = llm.generate(ids, lsp, spec=pol)
            la = a.stats["decode_s"] / max(1, len(a.token_ids) - 1)
            lc = m.stats["decode_s"] / max(1, m.stats["cycles"])
            row["long"] = dict(tokens=long, ar_step_ms=round(la * 1e3, 3), ar_tok_s=round(1 / la, 1),
                               ar_of_ceiling=round(nbytes / la / CEILING, 4), mtp3_cycle_ms=round(lc * 1e3, 3),
                               cycle_over_ar=round(lc / la, 4), mtp3_tok_s=round(m.stats["decode_tok_s"], 1),
                               cycles=m.stats["cycles"], mtp_equals_ar=m.token_ids == a.token_ids)
        return row
    finally:
        head_fused.set_catchup(None)
        mtp.prefix = True
        del mtp.begin, mtp.commit


def _intervals(t1: float, ts: list[float]) -> dict:
    """Host intervals from t1 to each timestamp, then between them: the first 3, median, last 2."""
    iv = [ts[0] - t1] + [b - a for a, b in zip(ts, ts[1:])]
    return dict(first3=[round(x * 1e3, 3) for x in iv[:3]], median=round(statistics.median(iv) * 1e3, 3),
                last2=[round(x * 1e3, 3) for x in iv[-2:]], n=len(iv), total=round(sum(iv) * 1e3, 3))


def profile_begin(llm, prompt, on: bool, cuda: bool, out: str | None, name: str) -> dict:
    """torch.profiler over one `begin` after a prefill and a sync; a summary of its trace."""
    from torch.profiler import ProfilerActivity, profile

    from specfire.kernels import head as head_fused

    mtp = llm.engine.drafters["mtp"]
    rows = _prefilled(llm, prompt)
    _sync(cuda)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    head_fused.set_catchup(on)
    try:
        with profile(activities=acts) as prof:
            mtp.begin(prompt, rows.hidden)
            _sync(cuda)
    finally:
        head_fused.set_catchup(None)
    d = out or tempfile.mkdtemp(prefix="catchup-")
    path = os.path.join(d, f"trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f).get("traceEvents", [])
    if not out:
        shutil.rmtree(d, ignore_errors=True)
    return summarize(evs)


def summarize(evs: list) -> dict:
    """Kernels in order (device us, start from the first launch), launches, device gaps, host span."""
    kern = sorted((e for e in evs if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    mems = [e for e in evs if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "dur" in e]
    launches = sorted((e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e
                       and ("aunch" in e.get("name", "") or "Memcpy" in e.get("name", "")
                            or "Memset" in e.get("name", ""))), key=lambda e: e["ts"])
    ops = [e for e in evs if e.get("cat") == "cpu_op" and "dur" in e]
    t_host0 = min((e["ts"] for e in ops + launches), default=0.0)
    t_host1 = max((e["ts"] + e["dur"] for e in launches + ops), default=t_host0)
    row = dict(kernels=len(kern), launches=len(launches), memcpy_memset=len(mems),
               host_span_us=round(t_host1 - t_host0, 1))
    by_corr = {e.get("args", {}).get("correlation"): e for e in launches}
    if kern:
        busy = sum(e["dur"] for e in kern)
        span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kern, kern[1:])]
        row.update(kernel_busy_us=round(busy, 1), kernel_span_us=round(span, 1),
                   first_kernel_after_host_start_us=round(kern[0]["ts"] - t_host0, 1),
                   last_kernel_end_after_host_start_us=round(kern[-1]["ts"] + kern[-1]["dur"] - t_host0, 1),
                   device_gaps_us=round(sum(g for g in gaps if g > 0), 1),
                   gaps_over_5us=sum(1 for g in gaps if g > 5))
        order = []
        for e in kern:
            ln = by_corr.get(e.get("args", {}).get("correlation"))
            order.append([e["name"][:70], round(e["dur"], 1), round(e["ts"] - t_host0, 1),
                          None if ln is None else round(ln["ts"] - t_host0, 1)])
        row["kernel_order"] = order            # [name, device us, start us, its launch us] from the host's start
        fam: dict = {}
        for e in kern:
            k = e["name"][:50]
            c, t = fam.get(k, (0, 0.0))
            fam[k] = (c + 1, t + e["dur"])
        row["top_kernels"] = sorted(([k, c, round(t, 1)] for k, (c, t) in fam.items()), key=lambda x: -x[2])[:15]
    self_ops: dict = {}
    for e in ops:
        c, t = self_ops.get(e["name"], (0, 0.0))
        self_ops[e["name"]] = (c + 1, t + e["dur"])
    row["top_cpu_ops"] = sorted(([k, c, round(t, 1)] for k, (c, t) in self_ops.items()), key=lambda x: -x[2])[:15]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--vocab", type=int, default=32768, help="draft vocabulary (0: the whole one)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5, help="begin calls per mode and round (two rounds)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--e2e-reps", type=int, default=3)
    ap.add_argument("--e2e-modes", default="main,fused,fused_prefix", help=f"of {', '.join(E2E_MODES)}")
    ap.add_argument("--stages", default="time,graph,e2e,profile")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip a stage that would start past this")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: the flow, no timings worth keeping")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    for m in args.e2e_modes.split(","):
        if m not in E2E_MODES:
            raise SystemExit(f"--e2e-modes: unknown {m!r} (known: {', '.join(E2E_MODES)})")
    bad = stages - {"time", "graph", "e2e", "profile"}
    if bad:
        raise SystemExit(f"--stages: unknown {sorted(bad)} (known: time, graph, e2e, profile)")
    t_end = time.monotonic() + args.budget_s
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"

    import tp_mtp
    from draft_vocab import tie_norms
    if args.smoke:
        import decode
        smoke_shapes()
        decode.SHAPES["tiny"] = {**decode.SHAPES["tiny"], "intermediate_size": 128}
        args.shape, args.prompt, args.tokens, args.vocab, args.long, args.reps, args.e2e_reps = \
            "tiny", 40, 12, 100, 20, 1, 1
        tp_mtp.GROUP = 32
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    log = Log(args.out, name="catchup.jsonl")
    log("start", commit=args.commit, shape=args.shape, torch=torch.__version__, stages=sorted(stages),
        device=torch.cuda.get_device_name() if cuda else "cpu")
    d = tempfile.mkdtemp(prefix="catchup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        t0 = time.perf_counter()
        tp_mtp.job_q4ckpt(cfg, d, device, log)
        tie_norms(os.path.join(d, "q4"), os.path.join(d, "q4tied"), cfg)
        log("progress", what="q4ckpt", s=round(time.perf_counter() - t0, 1))
        run(os.path.join(d, "q4tied"), args, stages, device, log, t_end,
            lambda c, ctx: tp_mtp.q4_step_bytes(c, d, 1, ctx))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    log("done", seconds=round(time.monotonic() - (t_end - args.budget_s), 1))


def run(path: str, args, stages: set, device: str, log: Log, t_end: float, nbytes) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy

    cuda = device == "cuda"
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    with LLM(path, device=device, progress=False, max_seq_len=args.prompt + max(args.long, 2 * args.tokens) + 64,
             draft_vocab=args.vocab or None) as llm:
        log("progress", what="loaded", s=round(time.perf_counter() - t0, 1))
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (args.prompt,), generator=g).tolist()
        prompt = torch.tensor(ids, device=llm.engine.trunk.device)
        nb = nbytes(llm.cfg, args.prompt + args.tokens // 2)
        warm = SamplingParams(max_tokens=8, ignore_eos=True)
        t1 = time.perf_counter()
        llm.generate(ids, warm, spec="off")
        llm.generate(ids, warm, spec=SpecPolicy("mtp", k=3))
        log("progress", what="warm", s=round(time.perf_counter() - t1, 1))

        def left(what: str, need: float) -> bool:
            if time.monotonic() + need > t_end:
                log("skipped", what=what, why="time budget")
                return False
            return True

        if "time" in stages and left("time", 5):
            kv, res = {}, {}
            for rnd in range(2):                                        # off, on, off, on: drift shows
                for name, on in MODES:
                    row, kv[name] = time_begin(llm, prompt, on, args.reps, cuda)
                    log("begin", mode=name, round=rnd, rows=args.prompt - 1, **row)
                    res.setdefault(name, []).append(row)
            (ku, vu), (kf, vf) = kv["unfused"], kv["fused"]
            log("kv", k_equal=torch.equal(ku, kf), v_equal=torch.equal(vu, vf),
                k_max_diff=float((ku.float() - kf.float()).abs().max()),
                v_max_diff=float((vu.float() - vf.float()).abs().max()))
        if "e2e" in stages:
            for name in args.e2e_modes.split(","):
                on, prefix = E2E_MODES[name]
                if not left(f"e2e {name}", 12):
                    continue
                try:
                    log("e2e", mode=name, catchup_fused=on, prefix=prefix,
                        **e2e(llm, ids, on, prefix, args.tokens, args.long, args.e2e_reps, cuda, nb))
                except Exception as e:
                    import traceback
                    log("error", what=f"e2e {name}", error=repr(e), tb=traceback.format_exc()[-1500:])
        if cuda and "graph" in stages and left("graph", 5):
            for name, on in MODES:
                try:
                    log("graph", mode=name, replay_ms=round(graph_begin(llm, prompt, on), 3))
                except Exception as e:                     # a diagnosis: its failure must not end the call
                    import traceback
                    log("error", what=f"graph {name}", error=repr(e), tb=traceback.format_exc()[-1500:])
        if "profile" in stages:
            for name, on in MODES:
                if not left(f"profile {name}", 4):
                    continue
                try:
                    log("profile", mode=name, **profile_begin(llm, prompt, on, cuda, args.out, name))
                except Exception as e:
                    import traceback
                    log("error", what=f"profile {name}", error=repr(e), tb=traceback.format_exc()[-1500:])


if __name__ == "__main__":
    main()
