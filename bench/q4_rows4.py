"""The 4-bit GEMV at 4 rows against 1 row on the 27B launch shapes (issue 12, ninth wave).

    PYTHONPATH=$PWD python bench/q4_rows4.py --adopt $OUT/q4_mtiles.json --out $OUT     # GPU
    BENCH_SMOKE=1 TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/q4_rows4.py             # CPU, the flow

Per launch shape of a 27B step (one weight of the launch's whole shape, random codes, group 128):
1. Bits, before any timing: q4_config's launch with DISCARD and COMBINE_ILP off is row-invariant
   (every prefix M = 1..8 and every single row equal the 8-row call, bitwise); with DISCARD (the
   split-K partials' L2 lines dropped after the combine), COMBINE_ILP (the combine's loads four at
   a time) or both (kernels/q4/gemv.py) the same bits; every tile candidate (another block_n /
   warps / stages, the same split-K) gives the 8-row call's bits at M = 1..8.
2. Time (CUDA-graph replay over weight copies rotated past L2, events): q4_config's launch at
   M = 1 and 4 with the four flag settings; each tile candidate at M = 4 with both flags on; the
   fastest (>= 2% under q4_config's M = 4 time, both flags on) adopted for M = 4 (`--adopt` JSON: "N,K,M" -> [block_n,
   num_warps, num_stages], read by bench/cycle_profile.py --q4-mtiles and by kernels/q4/gemv.py
   M_TILES), then checked again through q4_gemv's default path (launch_config) bit for bit.
3. The MTP draft chain's lm_head over a 32,768-token draft vocabulary (M = 1; q4_config's
   fallback for it): tile candidates at its split-K, bits checked, the fastest adopted for M = 1
   ("32768,5120,1") where >= 2% faster.
4. A step-like chain: 8 GDN-like layers (qkv+z, out, gate+up, down, distinct weights: 1.6 GB),
   one CUDA graph per (variant, M), M = 1 and 4, variants in the order base (every switch off),
   all (DISCARD, COMBINE_ILP, the adopted tiles), ilp, discard, tiles, base, all: the M = 4 premium
   of a chain of launches and what each switch buys at M = 1 and 4.
One JSON line per record on stdout and in OUT/q4_rows4.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import linear  # noqa: E402
from linear import PEAK, SMOKE, graph_time, random_q4, rotated_q4  # noqa: E402

from specfire.kernels.q4 import gemv as tq  # noqa: E402
from specfire.kernels.q4.gemv import Q4Config, q4_config, q4_gemv  # noqa: E402

DEV = linear.DEV
BF = linear.BF
G = 64 if SMOKE else 128
SHAPES = [(34816, 5120, "MLP gate+up"), (5120, 17408, "MLP down"), (16384, 5120, "GDN qkv+z"),
          (5120, 6144, "attn o / GDN out"), (14336, 5120, "attn q+gate,k,v"), (248320, 5120, "lm_head")]
# (block_n, num_warps, num_stages) tried at M = 4; the split-K stays q4_config's
TILES = [(32, 1, 4), (64, 2, 3), (64, 2, 4), (128, 2, 3), (128, 4, 3), (256, 4, 3)]
CHAIN = [(16384, 5120), (5120, 6144), (34816, 5120), (5120, 17408)]
LAYERS = 8
# the MTP draft chain's lm_head over a 32,768-token draft vocabulary (M = 1, three a k=3 chain):
# q4_config has no measured entry for it (its fallback: 64 columns, 2 warps, 3 stages, no split)
DRAFT = (32768, 5120)
DRAFT_TILES = [(16, 1, 4), (32, 1, 3), (32, 1, 4), (32, 2, 4), (64, 2, 3), (64, 2, 4), (64, 4, 4), (128, 4, 3),
               (128, 4, 4)]
# (DISCARD, COMBINE_ILP) of kernels/q4/gemv.py
FLAGS = {"base": (False, False), "disc": (True, False), "ilp": (False, True), "dilp": (True, True)}
if SMOKE:
    SHAPES = [(96, 256, "a"), (64, 512, "b")]
    TILES = [(32, 1, 2), (64, 2, 2)]
    CHAIN = [(96, 256), (64, 512)]
    LAYERS = 2
    DRAFT = (128, 256)
    DRAFT_TILES = [(16, 1, 2), (32, 1, 2)]


def base_cfg(n: int, k: int) -> Q4Config:
    return q4_config(n, k, G)


def cands(n: int, k: int, tiles=None) -> list[Q4Config]:
    b = base_cfg(n, k)
    out = []
    for bn, nw, ns in tiles or (DRAFT_TILES if (n, k) == DRAFT else TILES):
        c = Q4Config(bn, b.split_k, nw, ns, b.sem, b.wa, b.rows, b.zc, b.rows_hi)
        if c != b and c not in out:
            out.append(c)
    return out


def name(c: Q4Config) -> str:
    return f"bn{c.block_n} w{c.num_warps} s{c.num_stages} split{c.split_k}"


# launches as a 27B model makes them (grouped projections, the MTP head's fc, the draft lm_head of a
# 32,768-token draft vocabulary), compiled by the warm-up too so bench/cycle_profile.py after this
# finds its kernels in Triton's cache for every switch setting
MODEL = [([17408, 17408], 5120), ([10240, 6144], 5120), ([12288, 1024, 1024], 5120), ([5120], 10240),
         ([32768], 5120)]
if SMOKE:
    MODEL = []


def warm(part: str) -> None:
    """Compile worker (part 'i/n'): every i-th kernel this bench (and the model's launches) can run,
    every (DISCARD, COMBINE_ILP) setting, q4_config's tile and the candidates."""
    from specfire.kernels.q4 import QuantWeight
    from specfire.kernels.q4.gemv import q4_group

    i, n_parts = (int(v) for v in part.split("/"))
    j = 0
    for ns, k in [([n], k) for n, k, _ in SHAPES] + [([n], k) for n, k in CHAIN] + MODEL + [([DRAFT[0]], DRAFT[1])]:
        qws = None
        for c in [base_cfg(sum(ns), k)] + cands(sum(ns), k):
            for disc, ilp in FLAGS.values():
                j += 1
                if j % n_parts != i:
                    continue
                if qws is None:
                    qws = []
                    for n in ns:
                        s_ = torch.full((k // G, n), 1e-3, device=DEV, dtype=torch.bfloat16)
                        qws.append(QuantWeight(torch.empty(n, k // 2, device=DEV, dtype=torch.uint8), s_, s_.clone(),
                                               False, BF))
                tq.DISCARD, tq.COMBINE_ILP = disc, ilp
                try:
                    q4_group(torch.randn(4, k, device=DEV, dtype=BF), qws, c)
                except Exception as e:
                    print(f"warm {ns}x{k} {name(c)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()


class Log:
    def __init__(self, out: str | None):
        self.f = open(os.path.join(out, "q4_rows4.jsonl"), "a") if out else None

    def __call__(self, kind: str, **kw) -> None:
        line = json.dumps({"kind": kind, **kw})
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def same_rows(fn, x: torch.Tensor, full: torch.Tensor) -> bool:
    """fn(x[:m]) == full[:m] for every m and fn(x[i:i+1]) == full[i] for every row, bitwise."""
    ok = all(torch.equal(fn(x[:m]), full[:m]) for m in range(1, x.shape[0] + 1))
    return ok and all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(x.shape[0]))


def t_us(fns) -> float:
    return graph_time(fns) * 1e6


def per_shape(log: Log, adopted: dict, deadline: float) -> bool:
    every = True
    for n, k, label in SHAPES:
        if time.monotonic() > deadline:
            log("skipped", shape=[n, k], why="budget")
            continue
        qws = rotated_q4(n, k, G, DEV)
        qw0, nbytes = qws[0], qws[0].nbytes()
        x8 = torch.randn(8, k, device=DEV, dtype=BF)
        b = base_cfg(n, k)
        tq.M_TILES.clear()
        tq.DISCARD, tq.COMBINE_ILP = FLAGS["base"]
        full = q4_gemv(x8, qw0, b)
        bits = {"base_rows": same_rows(lambda t: q4_gemv(t, qw0, b), x8, full)}
        for f in ("disc", "ilp", "dilp"):
            tq.DISCARD, tq.COMBINE_ILP = FLAGS[f]
            bits[f"{f}_rows"] = same_rows(lambda t: q4_gemv(t, qw0, b), x8, full)
        cs = cands(n, k)        # the tiles with DISCARD and COMBINE_ILP on (dilp: the intended default)
        for c in cs:
            bits[name(c)] = same_rows(lambda t, c=c: q4_gemv(t, qw0, c), x8, full)
        ok = all(bits.values())
        every &= ok
        rec = {"shape": [n, k], "name": label, "mb": round(nbytes / 1e6, 1), "base": name(b), "bits": bits, "ok": ok}
        t = {}
        for f in ("base", "disc", "ilp", "dilp"):
            tq.DISCARD, tq.COMBINE_ILP = FLAGS[f]
            for m in (1, 4):
                t[f"{f}_m{m}"] = t_us([lambda w=w: q4_gemv(x8[:m], w, b) for w in qws])
        tq.DISCARD, tq.COMBINE_ILP = FLAGS["dilp"]
        tiles = {}
        for c in cs:
            if not bits[name(c)]:
                continue
            try:
                tiles[name(c)] = t_us([lambda w=w, c=c: q4_gemv(x8[:4], w, c) for w in qws])
            except Exception as e:
                tiles[name(c)] = repr(e)[:120]
        timed = {kk: v for kk, v in tiles.items() if isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        rec.update(t_us={kk: round(v, 2) for kk, v in t.items()}, m4_tiles_us={kk: (round(v, 2) if isinstance(v, float)
                                                                                else v) for kk, v in tiles.items()},
                   frac={kk: round(nbytes / (v * 1e-6) / PEAK, 4) for kk, v in t.items()},
                   m4_premium_pct={f: round(100 * (t[f"{f}_m4"] / t[f"{f}_m1"] - 1), 2) for f in FLAGS})
        if best is not None and ok and timed[best] < 0.98 * t["dilp_m4"]:
            c = next(c for c in cs if name(c) == best)
            key = f"{n},{k},4"
            tq.M_TILES[(n, k, 4)] = (c.block_n, c.num_warps, c.num_stages)
            y4 = q4_gemv(x8[:4], qw0)                       # the default path through launch_config
            again = torch.equal(y4, full[:4]) and torch.equal(q4_gemv(x8[:1], qw0), full[:1])
            rec["adopted_m4"] = {"tile": best, "us": round(timed[best], 2), "default_path_bits": again}
            every &= again
            if again:
                adopted[key] = [c.block_n, c.num_warps, c.num_stages]
            tq.M_TILES.clear()
        log("shape", **rec)
        qws = qw0 = None
        if not SMOKE:
            torch.cuda.empty_cache()
    return every


def draft(log: Log, adopted: dict) -> bool:
    """The draft lm_head (DRAFT) at M = 1: q4_config's fallback against DRAFT_TILES (the same
    split-K, so the same bits: checked), DISCARD and COMBINE_ILP on (no split: they do nothing);
    the fastest adopted for M = 1 where >= 2% faster."""
    n, k = DRAFT
    qws = rotated_q4(n, k, G, DEV)
    qw0, nbytes = qws[0], qws[0].nbytes()
    x8 = torch.randn(8, k, device=DEV, dtype=BF)
    b = base_cfg(n, k)
    tq.M_TILES.clear()
    full = q4_gemv(x8, qw0, b)
    bits = {"base_rows": same_rows(lambda t: q4_gemv(t, qw0, b), x8, full)}
    cs = cands(n, k)
    for c in cs:
        bits[name(c)] = same_rows(lambda t, c=c: q4_gemv(t, qw0, c), x8, full)
    t = {}
    for rep_ in range(2):                  # every candidate twice, in turn: the best of the two
        for c in [b] + cs:
            if bits[name(c) if c != b else "base_rows"]:
                v = t_us([lambda w=w, c=c: q4_gemv(x8[:1], w, c) for w in qws])
                t[name(c)] = min(v, t.get(name(c), v))
    best = min(t, key=t.get)
    rec = {"shape": [n, k], "mb": round(nbytes / 1e6, 1), "base": name(b), "bits": bits, "ok": all(bits.values()),
           "m1_us": {kk: round(v, 2) for kk, v in t.items()},
           "m1_frac": {kk: round(nbytes / (v * 1e-6) / PEAK, 4) for kk, v in t.items()}}
    if best != name(b) and t[best] < 0.98 * t[name(b)] and rec["ok"]:
        c = next(c for c in cs if name(c) == best)
        tq.M_TILES[(n, k, 1)] = (c.block_n, c.num_warps, c.num_stages)
        again = torch.equal(q4_gemv(x8[:1], qw0), full[:1])          # the default path (launch_config)
        rec["adopted_m1"] = {"tile": best, "us": round(t[best], 2), "default_path_bits": again}
        if again:
            adopted[f"{n},{k},1"] = [c.block_n, c.num_warps, c.num_stages]
        tq.M_TILES.clear()
    log("draft", **rec)
    return rec["ok"]


def chain(log: Log, adopted: dict, deadline: float) -> None:
    """LAYERS x CHAIN launches with distinct weights, one graph per (variant, M)."""
    ws = [[random_q4(n, k, G, DEV) for n, k in CHAIN] for _ in range(LAYERS)]
    xs = {m: [torch.randn(m, k, device=DEV, dtype=BF) for _, k in CHAIN] for m in (1, 4)}
    nbytes = sum(w.nbytes() for lay in ws for w in lay)
    table = {(int(a), int(b), int(c)): tuple(v) for key, v in adopted.items() for a, b, c in [key.split(",")]}
    ref = {}
    for var in ("base", "all", "ilp", "discard", "tiles", "base", "all"):
        if time.monotonic() > deadline:
            log("skipped", what="chain", variant=var, why="budget")
            continue
        tq.DISCARD = var in ("discard", "all")
        tq.COMBINE_ILP = var in ("ilp", "all")
        tq.M_TILES.clear()
        if var in ("tiles", "all"):
            tq.M_TILES.update(table)
        row = {}
        for m in (1, 4):
            fns = [lambda lay=lay, m=m: [q4_gemv(x, w) for x, w in zip(xs[m], lay)] for lay in ws]
            row[f"m{m}_us"] = round(t_us(fns) * len(ws), 1)     # one chain of LAYERS layers
            outs = [q4_gemv(x, w) for x, w in zip(xs[m], ws[0])]
            if m not in ref:
                ref[m] = outs
            row[f"m{m}_bits_equal_base"] = all(torch.equal(a, b) for a, b in zip(outs, ref[m]))
        row["m4_premium_us"] = round(row["m4_us"] - row["m1_us"], 1)
        row["m4_premium_pct"] = round(100 * (row["m4_us"] / row["m1_us"] - 1), 2)
        row["m1_frac"] = round(nbytes / (row["m1_us"] * 1e-6) / PEAK, 4)
        row["m4_frac"] = round(nbytes / (row["m4_us"] * 1e-6) / PEAK, 4)
        log("chain", variant=var, layers=LAYERS, mb=round(nbytes / 1e6, 1), **row)
    tq.DISCARD = tq.COMBINE_ILP = False
    tq.M_TILES.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--adopt", default=None, help="write the adopted M = 4 tiles here (JSON)")
    ap.add_argument("--budget-s", type=float, default=120)
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--phases", default="shapes,draft,chain", help="comma list of shapes, draft, chain")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if args.warm:
        warm(args.warm)
        return
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    log = Log(args.out)
    log("start", commit=args.commit, torch=torch.__version__,
        device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu")
    if not SMOKE:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{i}/{args.workers}"])
                 for i in range(args.workers)]
        for p in procs:
            p.wait()
        log("progress", what="compiled", s=round(time.monotonic() - t0, 1))
    adopted: dict = {}
    saved = (tq.DISCARD, tq.COMBINE_ILP, dict(tq.M_TILES))
    try:
        ok = per_shape(log, adopted, deadline - 25) if "shapes" in phases else True
        if "draft" in phases:
            ok &= draft(log, adopted)
        if args.adopt:
            with open(args.adopt, "w") as f:
                json.dump(adopted, f, indent=1)
        log("adopted", m_tiles=adopted, every_bit_check_held=ok)
        if "chain" in phases:
            chain(log, adopted, deadline)
    finally:
        tq.DISCARD, tq.COMBINE_ILP = saved[0], saved[1]
        tq.M_TILES.clear()
        tq.M_TILES.update(saved[2])
    log("done", seconds=round(time.monotonic() - t0, 1))


if __name__ == "__main__":
    main()
