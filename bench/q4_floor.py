"""How fast can a launch of a 27B layer's size read its bytes at all? The 4-bit GEMV against a
plain read of the same bytes, per launch shape (issue 12: the GEMV >= 80% of 4.17 TB/s target).

    PYTHONPATH=$PWD python bench/q4_floor.py --out $OUT                        # GPU
    BENCH_SMOKE=1 TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/q4_floor.py   # CPU, the flow

Per launch shape of a 27B step (one weight of the launch's whole shape, random codes, group 128),
every figure the same harness as bench/q4_rows4.py (CUDA-graph replay over copies rotated past L2,
so a graph is up to 8 launches of the shape back to back, each launched with PDL like the model's):
- read: a kernel that only reads the same number of bytes (int32 words, xor-folded, one word out
  per program, PDL wait / release like the GEMV), best of a sweep of programs x block x warps:
  what a launch of this size can stream on this GPU, the ceiling the GEMV's own % sits under;
- empty: one program per SM that only waits (PDL) and stores a word: the per-launch floor;
- the GEMV as the model launches it (its group sums handed along by the kernel that wrote x, so no
  sum(x) launch: kernels/xsum.py), at M = 1, 2, 4, 8 and 16, q4_config's settings (and at M = 1 with
  its own sum(x) launch);
- the GEMV with its split-K partials written but not combined (timing only: the output is not
  made), which prices the combine (the atomic, the last program's partial reads, its store);
- a chain of 8 GDN-like layers (qkv+z, out, gate+up, down, distinct weights) as the model launches
  them, against read kernels of the same bytes in the same order: what a GEMV that streamed like
  a plain read would give a step's worth of launches.
Bits: each shape's launch is checked row-invariant (every prefix and every row of an 8-row call,
bitwise) before it is timed; the read kernel's xor of the whole buffer is checked against numpy.
One JSON line per record on stdout and in OUT/q4_floor.jsonl.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import linear  # noqa: E402
from linear import PEAK, SMOKE, graph_time, n_copies, random_q4, rotated_q4  # noqa: E402
from q4_rows4 import CHAIN, LAYERS, SHAPES  # noqa: E402  (the 27B launch shapes and the GDN-like chain)
from tp import Log as _Log  # noqa: E402

from specfire.kernels import pdl  # noqa: E402
from specfire.kernels.q4 import gemv as tq  # noqa: E402
from specfire.kernels.pdl import wait as pdl_wait  # noqa: E402
from specfire.kernels.q4.gemv import Q4Config, q4_config, q4_group  # noqa: E402

DEV = linear.DEV
BF = linear.BF
G = 64 if SMOKE else 128
# read kernel sweep: (programs per SM, int32 words per program per step, warps)
READ = [(p, b, w) for p in (2, 4, 8, 16) for b, w in ((1024, 4), (2048, 4), (4096, 8))]
# sweep: register caps (0: the compiler's), (warps, cap) over q4_config's tile, split-K factors
SWEEP_MAXNREG = [96, 88, 80]
SWEEP_WARPS = [(4, 0), (4, 64)]
SWEEP_SPLIT = [0.5, 1.5, 2.0]
CANDS = "caps"      # the sweep's candidate family (--cands)
FIT_N = [5120, 16384, 34816]
FIT_K = [2048, 5120, 10240, 17408]
NCU_SHAPES = [(34816, 5120, "MLP gate+up"), (5120, 6144, "attn o / GDN out"), (248320, 5120, "lm_head")]
if SMOKE:
    READ = [(1, 64, 1), (2, 128, 2)]
    FIT_N = [64]
    FIT_K = [256, 512, 1024]
    SWEEP_MAXNREG = [96]
    SWEEP_WARPS = [(4, 0)]
    SWEEP_SPLIT = [2.0]


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p xor-folds int32 words [p * per_prog, (p + 1) * per_prog) of src, BLOCK at a time."""
    pid = tl.program_id(0)
    pdl_wait(PDL)
    lo = pid * per_prog
    hi = tl.minimum(lo + per_prog, n_words)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(lo, hi, BLOCK):
        o = off + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + o, mask=o < hi, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


@triton.jit
def _empty_kernel(out_ptr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tl.store(out_ptr + tl.program_id(0), 1)


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4


def Log(out: str | None) -> _Log:
    """One JSON line per record on stdout and in OUT/q4_floor.jsonl."""
    return _Log(out, name="q4_floor.jsonl")


def t_us(fns) -> float:
    return graph_time(fns) * 1e6


def read_time(nbytes: int, log: Log, label: str) -> dict:
    words = nbytes // 4
    bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), device=DEV, dtype=torch.int32)
            for _ in range(n_copies(nbytes))]
    on = pdl.on(bufs[0])
    res = {}
    for p, b, w in READ:
        progs = p * sms()
        per = triton.cdiv(triton.cdiv(words, progs), b) * b
        grid = (triton.cdiv(words, per),)
        out = torch.empty(grid[0], device=DEV, dtype=torch.int32)
        fns = [lambda s=s: _read_kernel[grid](s, out, words, per, BLOCK=b, PDL=on, num_warps=w, **pdl.launch(on))
               for s in bufs]
        res[f"p{p} b{b} w{w}"] = t_us(fns)
    best = min(res, key=res.get)
    p, b, w = (int(v[1:]) for v in best.split())
    per = triton.cdiv(triton.cdiv(words, p * sms()), b) * b
    out = torch.empty(triton.cdiv(words, per), device=DEV, dtype=torch.int32)
    _read_kernel[(out.numel(),)](bufs[0], out, words, per, BLOCK=b, PDL=on, num_warps=w, **pdl.launch(on))
    check = int(np.bitwise_xor.reduce(out.cpu().numpy())) == int(np.bitwise_xor.reduce(bufs[0].cpu().numpy()))
    # the copy of the same bytes (half read, half written), the 4.17 TB/s figure's own kind of launch
    srcs = [s[:words // 2] for s in bufs]
    dst = torch.empty(words // 2, device=DEV, dtype=torch.int32)
    copy_us = t_us([lambda s=s: dst.copy_(s) for s in srcs])
    rec = {"what": label, "mb": round(nbytes / 1e6, 1), "best": best, "best_us": round(res[best], 2),
           "best_frac": round(nbytes / (res[best] * 1e-6) / PEAK, 4),
           "all_us": {k: round(v, 2) for k, v in res.items()}, "xor_equal_torch": check,
           "copy_us": round(copy_us, 2), "copy_frac": round(words // 2 * 8 / (copy_us * 1e-6) / PEAK, 4)}
    log("read", **rec)
    return rec


def empty_time(log: Log) -> None:
    out = torch.empty(sms(), device=DEV, dtype=torch.int32)
    on = pdl.on(out)
    fns = [lambda: _empty_kernel[(sms(),)](out, PDL=on, **pdl.launch(on)) for _ in range(8)]
    log("empty", us=round(t_us(fns), 2), pdl=bool(on))


def row_invariant(fn, x: torch.Tensor) -> bool:
    full = fn(x)
    ok = all(torch.equal(fn(x[:m]), full[:m]) for m in range(1, x.shape[0] + 1))
    return ok and all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(x.shape[0]))


def gsums(x: torch.Tensor, g: int = G) -> torch.Tensor:
    """x's group sums as the kernel that wrote x hands them along (float32 [M, K / g])."""
    return x.float().view(x.shape[0], -1, g).sum(-1).contiguous()


class NoCombine:
    """Stands in for the split-K sum launch: the partials stay uncombined (timing only)."""
    def __getitem__(self, grid):
        return lambda *a, **k: None


def read_launch(buf: torch.Tensor, cfg: tuple) -> callable:
    """One read kernel launch over buf with (programs per SM, block, warps)."""
    p, b, w = cfg
    words = buf.numel()
    per = triton.cdiv(triton.cdiv(words, p * sms()), b) * b
    out = torch.empty(triton.cdiv(words, per), device=DEV, dtype=torch.int32)
    on = pdl.on(buf)
    return lambda: _read_kernel[(out.numel(),)](buf, out, words, per, BLOCK=b, PDL=on, num_warps=w, **pdl.launch(on))


def per_shape(log: Log, deadline: float, best_read: dict) -> None:
    for n, k, label in SHAPES:
        if time.monotonic() > deadline:
            log("skipped", shape=[n, k], why="budget")
            continue
        qws = rotated_q4(n, k, G, DEV)
        qw0, nbytes = qws[0], qws[0].nbytes()
        x16 = torch.randn(16, k, device=DEV, dtype=BF)
        xs16 = gsums(x16)
        b = q4_config(n, k, G)
        x8 = x16[:8].contiguous()
        rec = {"shape": [n, k], "name": label, "mb": round(nbytes / 1e6, 1), "cfg": str(b),
               "row_invariant": row_invariant(lambda xx: q4_group(xx, [qw0], b, gsums(xx))[0], x8)}
        t = {}
        t_us([lambda w=w: q4_group(x16[:1], [w], b, xs16[:1]) for w in qws])       # warm-up (first timing runs slow)
        for m in (1, 2, 4, 8, 16):
            xm, xsm = x16[:m].contiguous(), xs16[:m].contiguous()
            t[f"m{m}"] = t_us([lambda w=w, xm=xm, xsm=xsm: q4_group(xm, [w], b, xsm) for w in qws])
        t["m1_with_sumx_launch"] = t_us([lambda w=w: q4_group(x16[:1], [w], b) for w in qws])
        if b.split_k > 1:
            nc = Q4Config(b.block_n, b.split_k, b.num_warps, b.num_stages, False, b.wa, b.rows, b.zc, b.rows_hi)
            saved = tq._splitk_sum
            tq._splitk_sum = NoCombine()
            try:
                t["m1_no_combine"] = t_us([lambda w=w: q4_group(x16[:1], [w], nc, xs16[:1]) for w in qws])
            finally:
                tq._splitk_sum = saved
        rec["us"] = {kk: round(v, 2) for kk, v in t.items()}
        rec["frac"] = {kk: round(nbytes / (v * 1e-6) / PEAK, 4) for kk, v in t.items()}
        rec["read"] = read_time(nbytes, log, label)
        best_read[(n, k)] = tuple(int(v[1:]) for v in rec["read"]["best"].split())
        rec["m1_over_read"] = round(t["m1"] / rec["read"]["best_us"], 3)
        log("shape", **rec)
        qws = qw0 = None
        if not SMOKE:
            torch.cuda.empty_cache()


def chain(log: Log, best_read: dict) -> None:
    """LAYERS GDN-like layers (qkv+z, out, gate+up, down; distinct weights), the GEMVs as the model
    launches them at M = 1, against read kernels of the same bytes in the same order (each size's
    best read setting): what a GEMV streaming like a plain read would give a chain of launches."""
    ws = [[random_q4(n, k, G, DEV) for n, k in CHAIN] for _ in range(LAYERS)]
    xs = [torch.randn(1, k, device=DEV, dtype=BF) for _, k in CHAIN]
    sums = [gsums(x) for x in xs]
    nbytes = sum(w.nbytes() for lay in ws for w in lay)
    bufs = [[torch.randint(-2 ** 31, 2 ** 31 - 1, (w.nbytes() // 4,), device=DEV, dtype=torch.int32) for w in lay]
            for lay in ws]
    reads = [[read_launch(bf, best_read.get((n, k), (16, 1024, 4))) for bf, (n, k) in zip(lay, CHAIN)] for lay in bufs]
    rec = {"layers": LAYERS, "mb": round(nbytes / 1e6, 1)}
    for rep in range(2):
        g_us = t_us([lambda lay=lay: [q4_group(x, [w], None, s) for x, w, s in zip(xs, lay, sums)] for lay in ws]) * len(ws)
        r_us = t_us([lambda lay=lay: [f() for f in lay] for lay in reads]) * len(ws)
        rec[f"gemv_us_{rep}"], rec[f"read_us_{rep}"] = round(g_us, 1), round(r_us, 1)
        rec[f"gemv_frac_{rep}"] = round(nbytes / (g_us * 1e-6) / PEAK, 4)
        rec[f"read_frac_{rep}"] = round(nbytes / (r_us * 1e-6) / PEAK, 4)
    log("chain", **rec)


def candidates(n: int, k: int) -> list[Q4Config]:
    """q4_config's launch of (N, K) and others that keep more programs resident per SM. CANDS "caps":
    registers per thread capped (maxnreg; the base kernel takes 126 on 2 warps, so 8 programs an
    SM), 4 warps over the same tile, and more / fewer split-K ways with them. CANDS "tiles": fewer
    code rows a warp instead (32 columns on 2 warps: 80 registers, 12 programs an SM; 64 columns on
    4 warps with 8-row tiles only: 79 registers), at q4_config's split-K and 1.5x / 2x it, 3 or 4
    stages. Every one is a function of the shape only and checked bitwise row-invariant before it
    is timed; another split-K or tile gives other bits than q4_config's (a new default, not an equal one)."""
    b = q4_config(n, k, G)
    groups = k // G
    out = [b]

    def add(**kw):
        c = dataclasses.replace(b, **kw)
        if c not in out and c.split_k <= groups:
            out.append(c)
    if CANDS == "tiles":
        splits = [b.split_k] + ([max(2, round(b.split_k * f)) for f in (1.5, 2.0)] if b.split_k > 1 else [])
        for sk in splits:
            for ns in (3, 4):
                add(block_n=32, num_warps=2, num_stages=ns, split_k=sk)
                add(block_n=64, num_warps=4, num_stages=ns, split_k=sk, rows_hi=0)
        return out
    for mr in SWEEP_MAXNREG:
        add(maxnreg=mr)
    for nw, mr in SWEEP_WARPS:
        add(num_warps=nw, maxnreg=mr)
    if b.split_k > 1:
        for f in SWEEP_SPLIT:
            sk = max(2, round(b.split_k * f))
            for mr in SWEEP_MAXNREG[:1]:
                add(split_k=sk, maxnreg=mr)
            for nw, mr in SWEEP_WARPS[:1]:
                add(split_k=sk, num_warps=nw, maxnreg=mr)
    return out


def cfg_name(c: Q4Config) -> str:
    return f"bn{c.block_n} split{c.split_k} w{c.num_warps} s{c.num_stages}" + (f" r{c.maxnreg}" if c.maxnreg else "")


def warm(part: str) -> None:
    """Compile worker (part 'i/n'): every i-th candidate kernel of the sweep, rows 1 and 16."""
    i, n_parts = (int(v) for v in part.split("/"))
    j = 0
    for n, k, _ in SHAPES:
        qw = None
        for c in candidates(n, k):
            j += 1
            if j % n_parts != i:
                continue
            qw = qw or random_q4(n, k, G, DEV)
            x = torch.randn(16, k, device=DEV, dtype=BF)
            for m in (1, 16):
                try:
                    q4_group(x[:m], [qw], c, gsums(x[:m]))
                except Exception as e:  # noqa: BLE001 - reported again (and skipped) by the sweep
                    print(f"warm {n}x{k} {cfg_name(c)}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    torch.cuda.synchronize()


def sweep(log: Log, deadline: float, adopt: str | None) -> None:
    """Per shape: every candidate's bits (row-invariant over 16 rows), then t(M = 1, 4, 16); the one
    with the least t(M=1) + t(M=4), where >= 2% under q4_config's, adopted (JSON in the form of
    bench/quant_e2e.py --q4-configs)."""
    table = {}
    for n, k, label in SHAPES:
        if time.monotonic() > deadline:
            log("skipped", what="sweep", shape=[n, k], why="budget")
            continue
        qws = rotated_q4(n, k, G, DEV)
        qw0, nbytes = qws[0], qws[0].nbytes()
        x16 = torch.randn(16, k, device=DEV, dtype=BF)
        base = q4_config(n, k, G)
        ref = q4_group(x16, [qw0], base, gsums(x16))[0]
        rows = {}
        for c in candidates(n, k):
            key = cfg_name(c)
            try:
                inv = row_invariant(lambda xx, c=c: q4_group(xx, [qw0], c, gsums(xx))[0], x16)
                same = torch.equal(q4_group(x16, [qw0], c, gsums(x16))[0], ref)
                t = {}
                for m in (1, 4, 16):
                    xm = x16[:m].contiguous()
                    sm = gsums(xm)
                    t[m] = t_us([lambda w=w, xm=xm, sm=sm, c=c: q4_group(xm, [w], c, sm) for w in qws])
                rows[key] = {"row_invariant": inv, "bits_of_base": same, "m1_us": round(t[1], 2),
                             "m4_us": round(t[4], 2), "m16_us": round(t[16], 2),
                             "m1_frac": round(nbytes / (t[1] * 1e-6) / PEAK, 4), "cfg": c}
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or launch here
                rows[key] = {"error": repr(e)[:200]}
            if time.monotonic() > deadline:
                break
        ok = {kk: v for kk, v in rows.items() if v.get("row_invariant")}
        score = {kk: v["m1_us"] + v["m4_us"] for kk, v in ok.items()}
        bkey = cfg_name(base)
        best = min(score, key=score.get) if score else None
        rec = {"shape": [n, k], "name": label, "mb": round(nbytes / 1e6, 1), "base": bkey,
               "rows": {kk: {a: b for a, b in v.items() if a != "cfg"} for kk, v in rows.items()}}
        if best and bkey in score and best != bkey and score[best] < 0.98 * score[bkey]:
            c = rows[best]["cfg"]
            table[f"{n},{k}"] = dataclasses.asdict(c)
            rec["adopted"] = {"cfg": best, "m1_us": rows[best]["m1_us"], "m4_us": rows[best]["m4_us"],
                              "gain_pct": round(100 * (1 - score[best] / score[bkey]), 2)}
        log("sweep", **rec)
        qws = qw0 = None
        torch.cuda.empty_cache() if not SMOKE else None
    if adopt:
        with open(adopt, "w") as f:
            json.dump(table, f, indent=1)
    log("adopted", table=table)


def fit(log: Log, best_read: dict) -> None:
    """t(launch) against its bytes: for N in FIT_N, the GEMV (q4_config's settings, M = 1, sums handed
    along) and the read kernel (p8 b1024 w4) over K in FIT_K; a least-squares line t = a + bytes / b
    per N: a is what a launch costs before its bytes stream, b the rate they stream at."""
    for n in FIT_N:
        pts, rpts = [], []
        for k in FIT_K:
            qws = rotated_q4(n, k, G, DEV)
            nbytes = qws[0].nbytes()
            x = torch.randn(1, k, device=DEV, dtype=BF)
            xs = gsums(x)
            b = q4_config(n, k, G)
            t_us([lambda w=w: q4_group(x, [w], b, xs) for w in qws])                  # warm-up
            t = t_us([lambda w=w: q4_group(x, [w], b, xs) for w in qws])
            bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), device=DEV, dtype=torch.int32)
                    for _ in range(n_copies(nbytes))]
            r = t_us([read_launch(bf, (8, 1024, 4)) for bf in bufs])
            pts.append((nbytes, t))
            rpts.append((nbytes, r))
            log("fit_point", n=n, k=k, mb=round(nbytes / 1e6, 2), cfg=str(b), gemv_us=round(t, 2), read_us=round(r, 2))
            qws = bufs = None
            if not SMOKE:
                torch.cuda.empty_cache()
        rec = {"n": n}
        for name, pp in (("gemv", pts), ("read", rpts)):
            xs_ = np.array([p_[0] for p_ in pp], dtype=np.float64)
            ys_ = np.array([p_[1] for p_ in pp], dtype=np.float64)
            slope, icpt = np.polyfit(xs_, ys_, 1)
            rec[name] = {"launch_us": round(float(icpt), 2),
                         "stream_frac": round(float(1e6 / slope / PEAK), 4) if slope > 0 else None}
        log("fit", **rec)


def ncu_targets(log: Log) -> None:
    """Eager launches for a profiler (ncu): per shape of NCU_SHAPES, the GEMV as the model launches it at
    M = 1 (three times: profile the last) and the read kernel over the same bytes (p8 b1024 w4)."""
    for n, k, label in NCU_SHAPES:
        qw = random_q4(n, k, G, DEV)
        x = torch.randn(1, k, device=DEV, dtype=BF)
        xs = gsums(x)
        buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (qw.nbytes() // 4,), device=DEV, dtype=torch.int32)
        rd = read_launch(buf, (8, 1024, 4))
        for _ in range(3):
            q4_group(x, [qw], None, xs)
            rd()
        torch.cuda.synchronize()
        log("ncu_target", shape=[n, k], name=label, mb=round(qw.nbytes() / 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--budget-s", type=float, default=120)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--sizes-mb", default="4,8,16,32,64,128,256,700",
                    help="plain reads of these sizes too (MB), the read ceiling's curve")
    ap.add_argument("--phases", default="floor,chain,sizes", help="comma list of floor, chain, sizes, sweep, ncu, fit")
    ap.add_argument("--adopt", default=None, help="sweep: write the adopted settings here (quant_e2e --q4-configs)")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--cands", default="caps", choices=["caps", "tiles"], help="sweep: the candidate family")
    args = ap.parse_args()
    global CANDS
    CANDS = args.cands
    if args.warm:
        warm(args.warm)
        return
    phases = set(args.phases.split(","))
    t0 = time.monotonic()
    log = Log(args.out)
    log("start", commit=args.commit, torch=torch.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu")
    if "sweep" in phases:
        if not SMOKE:
            procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{i}/{args.workers}",
                                      "--cands", args.cands])
                     for i in range(args.workers)]
            for p in procs:
                p.wait()
            log("progress", what="compiled", s=round(time.monotonic() - t0, 1))
        sweep(log, t0 + args.budget_s, args.adopt)
    if "ncu" in phases:
        ncu_targets(log)
    if "fit" in phases:
        fit(log, {})
    best_read: dict = {}
    if "floor" in phases:
        empty_time(log)
        per_shape(log, t0 + args.budget_s - 40, best_read)
    if "chain" in phases:
        chain(log, best_read)
    for mb in ([] if SMOKE or "sizes" not in phases else [float(v) for v in args.sizes_mb.split(",") if v]):
        if time.monotonic() > t0 + args.budget_s:
            break
        read_time(int(mb * 1e6) // 64 * 64, log, f"{mb:g} MB")
    log("done", seconds=round(time.monotonic() - t0, 1))


if __name__ == "__main__":
    main()
