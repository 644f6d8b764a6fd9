"""Row-invariant GEMV, 4-bit dequant-GEMV and the fused small ops on the GPU: check, then time.

One device call: (1) parity against the references and bitwise row invariance (every M = 1..16
row equals the one-row result) in bf16 on the real 27B shapes; (2) a launch-config sweep per
shape (configs depend on the shape only, never on M); (3) timings against the stock paths
(cuBLAS F.linear, torch's int4 mm when it works) with CUDA-graph replay over rotating weights
larger than L2; (4) 4-bit quality (layer-output relative error) by group size and rotation;
(5) end to end: a tiny model quantized, greedy MTP == AR on the GPU; (q4rows) the 4-bit launch
settings of every 27B launch shape swept, checked bitwise and adopted (--adopt writes them as
JSON for bench/quant_e2e.py --q4-configs); (bf16small) the same for the bf16 GDN gate group.
Prints tables and one JSON line last.

    python bench/linear.py [--quick] [--out results.json]

The 4-bit kernel's own sweep (with torch's int4 mm beside it), the Q8 KV
attention modes and 4-bit decode end to end are in bench/quant_gpu.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specfire.kernels import small as greedy  # noqa: E402
from specfire.kernels import norm
from specfire.kernels import small as rope
from specfire.kernels.small import silu_mul_ref  # noqa: E402
from specfire.kernels.q4 import QuantWeight, hadamard_rotate, quantize_tensor  # noqa: E402
from specfire.kernels.small import kernel as ts  # noqa: E402
from specfire.kernels.norm import kernel as nk  # noqa: E402
from specfire.kernels.gemv.kernel import GemvConfig, gemv, gemv_config, gemv_group  # noqa: E402
from specfire.kernels.q4.config import Q4Config, q4_config  # noqa: E402
from specfire.kernels.q4.gemv import q4_gemv  # noqa: E402

PEAK = 4.17e12  # measured device-to-device copy bandwidth of the H200, bytes/s
SHAPES = [(17408, 5120), (5120, 17408), (12288, 5120), (5120, 12288), (6144, 5120), (10240, 5120),
          (248320, 5120)]  # [N, K]: MLP gate/up, down, attn q, (K=12288), GDN z, GDN qkv, lm_head
ROWS = (1, 4, 8, 16)
L2_ROTATE_BYTES = 400 * 2 ** 20
DEV = "cuda"
BF = torch.bfloat16
QUALITY_SHAPES = [(17408, 5120), (5120, 17408)]
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # CPU dry run of the script's logic (TRITON_INTERPRET=1)
if SMOKE:
    DEV = "cpu"
    BF = torch.float32
    SHAPES = [(40, 256), (24, 128)]
    QUALITY_SHAPES = [(64, 512)]


def graph_time(fns: list, reps: int = 20) -> float:
    """Seconds per call: the calls in `fns` (one per rotated weight) captured once into a CUDA
    graph, replayed `reps` times, timed with events."""
    if SMOKE:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    del g
    return a.elapsed_time(b) / 1e3 / (reps * len(fns))


def n_copies(nbytes: int) -> int:
    return max(1, min(8, math.ceil(L2_ROTATE_BYTES / nbytes)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def row_invariant(fn, x: torch.Tensor) -> bool:
    """fn(x[:M]) == fn(x)[:M] for every M, and every row == its own one-row call, bitwise."""
    full = fn(x)
    ok = all(torch.equal(fn(x[:m]), full[:m]) for m in range(1, x.shape[0] + 1))
    return ok and all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(x.shape[0]))


# ---- bf16 GEMV ------------------------------------------------------------------------------

def gemv_sweep(n: int) -> list[GemvConfig]:
    """Candidates; split-K only where the N tiles alone leave SMs idle."""
    splits = (1,) if n >= 10240 else (1, 2, 4)
    return [GemvConfig(bn, bk, sk, nw, ns) for bn in (32, 64, 128) for bk in (128, 256) for sk in splits
            for nw, ns in ((4, 4), (8, 3))]


def bench_gemv(res: dict, quick: bool) -> None:
    print("\n== bf16 GEMV: parity, row invariance (bitwise), config sweep, timing vs cuBLAS ==")
    dev = DEV
    for n, k in SHAPES:
        nbytes = n * k * 2
        c = n_copies(nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=BF) * k ** -0.5 for _ in range(c)]
        x16 = torch.randn(16, k, device=dev, dtype=BF)
        ref = x16.float() @ ws[0].float().t()
        y = gemv(x16, ws[0])
        par = rel(y, ref)
        stock_par = rel(F.linear(x16, ws[0]), ref)
        inv = row_invariant(lambda t: gemv(t, ws[0]), x16)
        stock_inv = row_invariant(lambda t: F.linear(t, ws[0]), x16)
        # sweep: score = time at M=1 + time at M=16 (one config serves every M)
        sweep = []
        cands = [gemv_config(n, k)] + ([] if quick else [g for g in gemv_sweep(n) if g != gemv_config(n, k)])
        for cfg in cands:
            try:
                t1 = graph_time([lambda w=w: gemv(x16[:1], w, cfg) for w in ws])
                t16 = graph_time([lambda w=w: gemv(x16, w, cfg) for w in ws])
            except Exception as e:  # a config the compiler refuses (shared memory) is skipped
                sweep.append({"cfg": cfg.__dict__, "error": type(e).__name__})
                continue
            sweep.append({"cfg": cfg.__dict__, "t1_us": t1 * 1e6, "t16_us": t16 * 1e6})
        ok = [s for s in sweep if "error" not in s]
        best = min(ok, key=lambda s: s["t1_us"] + s["t16_us"])
        best_cfg = GemvConfig(**best["cfg"])
        rows = []
        for m in ROWS:
            xm = x16[:m]
            t_ours = graph_time([lambda w=w: gemv(xm, w) for w in ws])
            t_best = graph_time([lambda w=w: gemv(xm, w, best_cfg) for w in ws])
            t_stock = graph_time([lambda w=w: F.linear(xm, w) for w in ws])
            rows.append({"M": m, "ours_us": t_ours * 1e6, "best_us": t_best * 1e6, "stock_us": t_stock * 1e6,
                         "ours_frac": nbytes / t_ours / PEAK, "best_frac": nbytes / t_best / PEAK,
                         "stock_frac": nbytes / t_stock / PEAK})
            print(f"gemv {n:>6}x{k:<6} M={m:<2} ours {t_ours * 1e6:7.1f} us {nbytes / t_ours / 1e9:6.0f} GB/s "
                  f"({nbytes / t_ours / PEAK:5.1%})  best-cfg {nbytes / t_best / PEAK:5.1%}  cuBLAS "
                  f"{t_stock * 1e6:7.1f} us {nbytes / t_stock / 1e9:6.0f} GB/s ({nbytes / t_stock / PEAK:5.1%})")
        print(f"     parity rel err {par:.2e} (cuBLAS {stock_par:.2e}); row-invariant: ours {inv}, cuBLAS "
              f"{stock_inv}; best config {best['cfg']}")
        res["gemv"].append({"shape": [n, k], "rel_err": par, "stock_rel_err": stock_par, "row_invariant": inv,
                            "stock_row_invariant": stock_inv, "default_cfg": gemv_config(n, k).__dict__,
                            "best_cfg": best["cfg"], "rows": rows, "sweep": sweep})
        del ws
        torch.cuda.empty_cache()


# ---- 4-bit ----------------------------------------------------------------------------------

def q4_sweep(n: int, g: int) -> list[Q4Config]:
    """Tile widths, warps, pipeline depths and split-K (bench/quant_gpu.py has the full per-shape
    sweep)."""
    splits = (1, 2, 4) if n >= 10240 else (1, 2, 4, 8)
    return [Q4Config(bn, sk, nw, ns) for bn, nw in ((64, 1), (64, 2), (32, 1)) for sk in splits for ns in (3, 4)]


def random_q4(n: int, k: int, g: int, dev: str) -> QuantWeight:
    """Random codes, scales and zeros in kernel layout (speed does not depend on the values)."""
    q = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
    s = (torch.rand(n, k // g, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (-8 * s.float()).to(torch.bfloat16)
    return QuantWeight.from_stored(q, s, z, False, BF, dev)


def rotated_q4(n: int, k: int, g: int, dev: str) -> list[QuantWeight]:
    """Random 4-bit weights of one shape, as many copies as rotate past L2 (n_copies): timed calls
    cycle through them so no call finds its weight in L2. The first is the one the bits are checked on."""
    w0 = random_q4(n, k, g, dev)
    return [w0] + [random_q4(n, k, g, dev) for _ in range(n_copies(w0.nbytes()) - 1)]


def torch_int4(n: int, k: int, g: int, dev: str):
    """torch's own int4 matmul (tinygemm) on the same bytes, or None where this build lacks it."""
    try:
        w = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        sz = torch.rand(k // g, n, 2, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm(x, packed, g, sz)
        return lambda xm: torch.ops.aten._weight_int4pack_mm(xm, packed, g, sz)
    except Exception as e:
        print(f"     torch int4 mm unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None


def bench_q4(res: dict, quick: bool, groups=(128, 64), full: bool = True) -> None:
    print("\n== 4-bit dequant-GEMV: parity, row invariance (bitwise), sweep, timing vs bf16 cuBLAS / torch int4 ==")
    dev = DEV
    for g in groups:
        for n, k in SHAPES:
            qw0 = random_q4(n, k, g, dev)
            nbytes = qw0.nbytes()
            c = n_copies(nbytes)
            qws = [qw0] + [random_q4(n, k, g, dev) for _ in range(c - 1)]
            x16 = torch.randn(16, k, device=dev, dtype=BF)
            ref = x16.float() @ qw0.dequantize().t()
            par = rel(q4_gemv(x16, qw0), ref)
            inv = row_invariant(lambda t: q4_gemv(t, qw0), x16)
            sweep = []
            base = q4_config(n, k, g)
            cands = [base] + ([] if quick else [q for q in q4_sweep(n, g) if q != base])
            for cfg in cands:
                try:
                    e = rel(q4_gemv(x16, qw0, cfg), ref)
                    if not e < 1e-2:
                        sweep.append({"cfg": cfg.__dict__, "error": f"parity {e:.2e}"})
                        continue
                    t1 = graph_time([lambda w=w: q4_gemv(x16[:1], w, cfg) for w in qws])
                    t16 = graph_time([lambda w=w: q4_gemv(x16, w, cfg) for w in qws])
                except Exception as e:
                    sweep.append({"cfg": cfg.__dict__, "error": type(e).__name__})
                    continue
                sweep.append({"cfg": cfg.__dict__, "t1_us": t1 * 1e6, "t16_us": t16 * 1e6, "rel_err": e})
            ok = [s for s in sweep if "error" not in s]
            best = min(ok, key=lambda s: s["t1_us"] + s["t16_us"])
            best_cfg = Q4Config(**best["cfg"])
            ti4 = [torch_int4(n, k, g, dev)]
            ti4 = None if ti4[0] is None else ti4 + [torch_int4(n, k, g, dev) for _ in range(max(c, 4) - 1)]
            rows = []
            for m in ROWS:
                xm = x16[:m]
                t_ours = graph_time([lambda w=w: q4_gemv(xm, w) for w in qws])
                t_best = graph_time([lambda w=w: q4_gemv(xm, w, best_cfg) for w in qws])
                t_i4 = graph_time([lambda f=f: f(xm) for f in ti4]) if ti4 is not None else float("nan")
                r = {"M": m, "ours_us": t_ours * 1e6, "best_us": t_best * 1e6, "ours_frac": nbytes / t_ours / PEAK,
                     "best_frac": nbytes / t_best / PEAK, "int4_us": t_i4 * 1e6,
                     "int4_frac": (n * k // 2 + n * k // g * 4) / t_i4 / PEAK}
                rows.append(r)
                print(f"q4 g{g:<3} {n:>6}x{k:<6} M={m:<2} ours {t_ours * 1e6:7.1f} us "
                      f"{nbytes / t_ours / 1e9:6.0f} GB/s ({r['ours_frac']:5.1%})  best-cfg {r['best_frac']:5.1%}  "
                      f"torch-int4 {t_i4 * 1e6:7.1f} us ({r['int4_frac']:5.1%})")
            print(f"     parity rel err {par:.2e}; row-invariant {inv}; bytes {nbytes / 1e6:.1f} MB; "
                  f"best config {best['cfg']}")
            res["q4"].append({"group": g, "shape": [n, k], "bytes": nbytes, "rel_err": par, "row_invariant": inv,
                              "default_cfg": base.__dict__, "best_cfg": best["cfg"], "rows": rows, "sweep": sweep})
            del qws, qw0
            torch.cuda.empty_cache()
        if not full:
            break


# the launch shapes of a 27B decode step (grouped projections launch with their concatenated N),
# most step time first, and the MTP head's fc (three times a k=3 cycle)
Q4_LAUNCH = [(34816, 5120, "MLP gate+up"), (5120, 17408, "MLP down"), (16384, 5120, "GDN qkv+z"),
             (5120, 6144, "attn o / GDN out"), (14336, 5120, "attn q+gate,k,v"), (248320, 5120, "lm_head"),
             (5120, 10240, "MTP fc")]
if SMOKE:
    Q4_LAUNCH = [(96, 512, "small"), (40, 256, "odd")]
SMS = 132          # H200 streaming multiprocessors

# (columns per CTA, warps, pipeline stages); every one with 8-row tiles and the codes as the MMA's A operand
Q4_BASES = ((64, 2, 3), (128, 2, 3), (64, 2, 4), (128, 4, 3), (256, 4, 3), (32, 1, 4), (64, 2, 6), (64, 4, 4))


def q4_splits(n: int, k: int, bn: int, per_sm=(3, 4.5, 6, 8, 12)) -> list[int]:
    """Split-Ks (a function of the shape only) that put about `per_sm` CTAs on each SM, as the
    kernel launches them (the groups cut into equal runs, the last one shorter), deduplicated."""
    groups = k // 128 if not SMOKE else max(1, k // 64)
    tiles = -(-n // bn)
    if tiles >= 8 * SMS:
        return [1]
    out = []
    for c in per_sm:
        sp = max(1, min(groups, round(c * SMS / tiles)))
        per = -(-groups // sp)
        eff = -(-groups // per)
        if eff not in out:
            out.append(eff)
    return out


def q4_rows_candidates(n: int, k: int, base: Q4Config) -> list[Q4Config]:
    """Phase 1 (a function of the shape only): the committed config, the same with the zero term
    after the loop (zc: no sum(x) launch) and with the split-K combined by a second launch, then
    every base at the split-Ks of q4_splits. Phase 2 (bench_q4_rows) adds zc to the fastest three."""
    out = [base, dataclasses.replace(base, zc=16)]
    if base.split_k > 1:
        out.append(dataclasses.replace(base, sem=False))
    for bn, nw, ns in Q4_BASES:
        out += [Q4Config(bn, sp, nw, ns, wa=True, rows=8) for sp in q4_splits(n, k, bn)]
    out = [c for i, c in enumerate(out) if c not in out[:i]]
    return out[:4] if SMOKE else out


def warm_q4_rows(part: str) -> None:
    """Compile worker (part 'i/n'): every i-th (shape, kernel) pair the q4rows sweep can launch
    (phase 1 and 2 candidates, zc on and off, the 16-row tile of rows_hi), on a weight of the real
    shape (uninitialised codes: Triton specialises on N, K and the tile counts), so the sweep finds
    every kernel in Triton's cache."""
    i, n_parts = (int(v) for v in part.split("/"))
    warm_bf16_small(i, n_parts)
    seen, j = set(), 0
    for n, k, _ in Q4_LAUNCH:
        qw = None
        for c0 in q4_rows_candidates(n, k, q4_config(n, k, 128)):
            for cfg, m in ((c0, 1), (dataclasses.replace(c0, zc=16), 1), (dataclasses.replace(c0, rows_hi=16), 16),
                           (dataclasses.replace(c0, zc=16, rows_hi=16), 16)):
                # what Triton specialises on: the constexprs, the buffers' types (split, combine) and
                # whether the tile count divides by 16 (N, K / 2 and the strides do for every shape here)
                key = (cfg.block_n, cfg.num_warps, cfg.num_stages, 16 if m > cfg.rows else cfg.rows, cfg.zc, cfg.wa,
                       cfg.split_k > 1, cfg.sem and cfg.split_k > 1, -(-n // cfg.block_n) % 16 == 0)
                if key in seen:
                    continue
                seen.add(key)
                j += 1
                if j % n_parts != i:
                    continue
                if qw is None:
                    g = 128 if not SMOKE else 64
                    s_ = torch.full((k // g, n), 1e-3, device=DEV, dtype=torch.bfloat16)
                    qw = QuantWeight(torch.empty(n, k // 2, device=DEV, dtype=torch.uint8), s_, s_.clone(), False, BF)
                try:
                    q4_gemv(torch.randn(m, k, device=DEV, dtype=BF), qw, cfg)
                except Exception as e:       # the sweep reports it where it is launched
                    print(f"warm {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del qw
    if not SMOKE:
        torch.cuda.synchronize()


def _cfg_name(c: Q4Config) -> str:
    return (f"bn{c.block_n} w{c.num_warps} s{c.num_stages} split{c.split_k}" + ("" if c.sem or c.split_k == 1 else " 2nd")
            + (f" zc{c.zc}" if c.zc else "") + (f" hi{c.rows_hi}" if c.rows_hi else ""))


def bench_q4_rows(res: dict, budget: float, adopt_path: str | None) -> None:
    """Per 27B launch shape: every candidate checked (parity against the float32 product, bitwise
    row invariance: every prefix M = 1..16 and every single row equal the 16-row call), timed at
    M = 1 and 4; phase 2 adds the zero term after the loop (zc) to the fastest three; the fastest by
    t1 + t4 adopted; then the adopted config with rows_hi = 16 (M > 8 in one 16-row tile) is
    checked the same way (its M <= 8 rows must equal its 16-row call) and adopted where faster at
    M = 16; then the adopted and the committed config at M = 1, 2, 4, 8, 16. Each shape gets a
    share of `budget` seconds (the committed config always runs); the adopted configs go to
    `adopt_path` as JSON after every shape."""
    print("\n== 4-bit GEMV per launch shape (group 128): sweep, adopted vs committed, % of 4.17 TB/s ==", flush=True)
    t0 = time.time()
    g = 128 if not SMOKE else 64
    adopted = {}
    procs = [] if SMOKE else [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-q4rows", f"{i}/12"])
                              for i in range(12)]
    for p in procs:      # compiled before anything is timed (timing beside 12 compilers is noise)
        p.wait()
    print(f"[q4 rows warm-up {time.time() - t0:.0f} s]", flush=True)
    weights = {"MLP gate+up": 64, "MLP down": 64, "GDN qkv+z": 48, "attn o / GDN out": 64, "attn q+gate,k,v": 16,
               "lm_head": 1, "MTP fc": 0}     # launches in a 27B AR step (the fc runs in the draft chain)
    for si, (n, k, name) in enumerate(Q4_LAUNCH):
        left = budget - (time.time() - t0)
        end = time.time() + left / (len(Q4_LAUNCH) - si)      # this shape's share of what is left
        qws = rotated_q4(n, k, g, DEV)
        qw0, nbytes = qws[0], qws[0].nbytes()
        x16 = torch.randn(16, k, device=DEV, dtype=BF)
        ref = x16.float() @ qw0.dequantize().t()
        base = q4_config(n, k, g)
        sweep = []

        def trial(cfg, timed=((1, "t1_us"), (4, "t4_us"))):
            try:
                e = rel(q4_gemv(x16, qw0, cfg), ref)
                inv = row_invariant(lambda t: q4_gemv(t, qw0, cfg), x16)
                if not (e < 1e-2 and inv):
                    sweep.append({"cfg": cfg.__dict__, "error": f"parity {e:.2e} row-invariant {inv}"})
                    print(f"  {name}: {_cfg_name(cfg)} REJECTED parity {e:.2e} row-invariant {inv}", flush=True)
                    return None
                r = {"cfg": cfg.__dict__, "rel_err": e, "row_invariant": inv}
                for m, key in timed:
                    r[key] = graph_time([lambda w=w: q4_gemv(x16[:m], w, cfg) for w in qws]) * 1e6
            except Exception as ex:
                sweep.append({"cfg": cfg.__dict__, "error": f"{type(ex).__name__}: {str(ex)[:100]}"})
                print(f"  {name}: {_cfg_name(cfg)} failed {type(ex).__name__}: {str(ex)[:100]}", flush=True)
                return None
            sweep.append(r)
            print(f"  {name} {n}x{k} {_cfg_name(cfg)}: " + "  ".join(
                f"M{m} {r[key]:6.1f} us ({nbytes / r[key] * 1e6 / PEAK:5.1%})" for m, key in timed), flush=True)
            return r

        cands = q4_rows_candidates(n, k, base)
        for cfg in cands:
            if time.time() > end and cfg != base:
                sweep.append({"cfg": cfg.__dict__, "error": "budget"})
                continue
            trial(cfg)
        ok = sorted((r for r in sweep if "t1_us" in r), key=lambda r: r["t1_us"] + r["t4_us"])
        for r in ok[:3]:                                        # phase 2: zc on the fastest three
            c = Q4Config(**r["cfg"])
            if not c.zc and dataclasses.replace(c, zc=16) not in cands and time.time() < end + 5:
                trial(dataclasses.replace(c, zc=16))
        ok = [r for r in sweep if "t1_us" in r]
        best = min(ok, key=lambda r: r["t1_us"] + r["t4_us"])
        best_cfg = Q4Config(**best["cfg"])
        # rows_hi: M = 9..16 in one 16-row tile; adopted only if bitwise row-invariant and faster at M = 16
        hi_cfg = dataclasses.replace(best_cfg, rows_hi=16)
        hi = trial(hi_cfg, timed=((16, "t16_us"), (12, "t12_us")))
        lo16 = graph_time([lambda w=w: q4_gemv(x16, w, best_cfg) for w in qws]) * 1e6
        hi_rec = {"checked": hi is not None, "t16_us": hi["t16_us"] if hi else None, "two_tiles_t16_us": lo16}
        if hi is not None and hi["t16_us"] < lo16:
            best_cfg = hi_cfg
        table = []
        for m in (1, 2, 4, 8, 16):
            tb = graph_time([lambda w=w: q4_gemv(x16[:m], w, best_cfg) for w in qws])
            tc = graph_time([lambda w=w: q4_gemv(x16[:m], w, base) for w in qws]) if m in (1, 4, 16) else float("nan")
            table.append({"M": m, "adopted_us": tb * 1e6, "adopted_frac": nbytes / tb / PEAK,
                          "committed_us": tc * 1e6, "committed_frac": nbytes / tc / PEAK})
        print(f"  => {name} {n}x{k} ({nbytes / 1e6:.1f} MB) adopted {_cfg_name(best_cfg)}: " +
              "  ".join(f"M{r['M']} {r['adopted_us']:.1f} us {r['adopted_frac']:.1%}" for r in table) +
              f" | committed ({_cfg_name(base)}) M1 {table[0]['committed_frac']:.1%} M4 {table[2]['committed_frac']:.1%}"
              f" M16 {table[-1]['committed_frac']:.1%} | 16-row tile: {hi_rec} [{time.time() - t0:.0f} s]", flush=True)
        adopted[f"{n},{k}"] = best_cfg.__dict__
        res["q4_rows"].append({"name": name, "shape": [n, k], "bytes": nbytes, "adopted": best_cfg.__dict__,
                               "committed": base.__dict__, "rows_hi": hi_rec, "table": table, "sweep": sweep,
                               "per_step": weights.get(name, 0)})
        if adopt_path:
            with open(adopt_path, "w") as f:
                json.dump(adopted, f, indent=1)
        del qws, qw0
        if not SMOKE:
            torch.cuda.empty_cache()
    step = sum(r["per_step"] * r["table"][0]["adopted_us"] for r in res["q4_rows"])
    step_c = sum(r["per_step"] * r["table"][0]["committed_us"] for r in res["q4_rows"])
    print(f"[q4 rows sweep {time.time() - t0:.0f} s; a 27B AR step's 4-bit GEMVs at M=1: adopted {step / 1e3:.2f} ms, "
          f"committed {step_c / 1e3:.2f} ms]", flush=True)


# the bf16 projections that stay beside the 4-bit ones: the GDN gate projections in_proj_b / in_proj_a
# of the 27B shape (48 rows each, one grouped launch), whose default settings run 2 CTAs
BF16_SMALL = (48, 5120) if not SMOKE else (24, 256)
BF16_SMALL_CANDS = [GemvConfig(bn, bk, sp, nw, 3) for bn in (16, 32) for bk in (128, 256) for nw in (2, 4)
                    for sp in (5, 10, 20)]


def warm_bf16_small(i: int, n_parts: int) -> None:
    from specfire.kernels.gemv import kernel as triton_gemv

    n, k = BF16_SMALL
    ws = [torch.randn(n, k, device=DEV, dtype=BF) for _ in range(2)]
    x = torch.randn(1, k, device=DEV, dtype=BF)
    for j, cfg in enumerate(BF16_SMALL_CANDS):
        if j % n_parts == i and cfg.split_k == 10:     # the split does not change the kernel
            for sem in (True, False):
                triton_gemv.GROUP_SEM = sem
                gemv_group(x, ws, [None, None], cfg=cfg)
    triton_gemv.GROUP_SEM = True


def bench_bf16_small(res: dict, adopt_path: str | None) -> None:
    """The GDN b + a group (2 x [48, 5120] bf16, one launch): the default settings against split-K
    ones (one launch + one fixed-order sum), each checked (parity, bitwise row invariance), timed
    at M = 1 and 4; the fastest by t1 + t4 is written beside the 4-bit configs as 'bf16:N,K'."""
    print("\n== bf16 GDN b + a group: default vs split-K settings ==", flush=True)
    n, k = BF16_SMALL
    nb = 2 * n * k * 2
    sets = [[torch.randn(n, k, device=DEV, dtype=BF) * k ** -0.5 for _ in range(2)] for _ in range(8)]
    x16 = torch.randn(16, k, device=DEV, dtype=BF)
    ref = [x16.float() @ w.float().t() for w in sets[0]]
    from specfire.kernels.gemv import kernel as triton_gemv

    if not SMOKE:      # compile the candidates' kernels in parallel first
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-bf16", f"{i}/8"]) for i in range(8)]
        for p in procs:
            p.wait()
    base = gemv_config(n, k)
    out = []
    rule = GemvConfig(64, 256, 1, 4, 4)          # what gemv_config's rules gave before the measured entry
    for cfg, sem in [(base, True), (rule, True)] + [(c, s) for c in BF16_SMALL_CANDS for s in (True, False)]:
        if cfg.split_k == 1 and not sem:
            continue
        triton_gemv.GROUP_SEM = sem
        fn = lambda t, c=cfg: gemv_group(t, sets[0], [None, None], cfg=c)  # noqa: E731
        try:
            e = max(rel(y, r) for y, r in zip(fn(x16), ref))
            full = fn(x16)
            inv = all(all(torch.equal(a, b[:m]) for a, b in zip(fn(x16[:m]), full)) for m in range(1, 17)) and all(
                all(torch.equal(a[0], b[i]) for a, b in zip(fn(x16[i:i + 1]), full)) for i in range(16))
            if not (e < 1e-2 and inv):
                print(f"  {cfg} REJECTED parity {e:.2e} row-invariant {inv}", flush=True)
                continue
            t1 = graph_time([lambda ws=ws, c=cfg: gemv_group(x16[:1], ws, [None, None], cfg=c) for ws in sets]) * 1e6
            t4 = graph_time([lambda ws=ws, c=cfg: gemv_group(x16[:4], ws, [None, None], cfg=c) for ws in sets]) * 1e6
        except Exception as ex:
            print(f"  {cfg} failed {type(ex).__name__}: {str(ex)[:100]}", flush=True)
            continue
        out.append({"cfg": cfg.__dict__, "sem": sem, "t1_us": t1, "t4_us": t4, "rel_err": e, "default": cfg == base})
        print(f"  {'default ' if cfg == base else ''}{cfg} {'in-kernel' if sem else 'second-launch'} combine: "
              f"M1 {t1:.2f} us ({nb / t1 * 1e6 / PEAK:.1%}) M4 {t4:.2f} us", flush=True)
    triton_gemv.GROUP_SEM = True
    best = min(out, key=lambda r: r["t1_us"] + r["t4_us"])
    dflt = next((r for r in out if r["default"]), None)
    print(f"  => adopted {best['cfg']} ({'in-kernel' if best['sem'] else 'second-launch'} combine): M1 "
          f"{best['t1_us']:.2f} us, M4 {best['t4_us']:.2f} us (default: "
          f"{dflt['t1_us'] if dflt else float('nan'):.2f} / {dflt['t4_us'] if dflt else float('nan'):.2f} us)", flush=True)
    res["bf16_small"] = {"shape": [n, k], "weights": 2, "sweep": out, "adopted": best["cfg"]}
    if adopt_path:
        adopted = {}
        if os.path.exists(adopt_path):
            with open(adopt_path) as f:
                adopted = json.load(f)
        adopted[f"bf16:{n},{k}"] = best["cfg"]
        with open(adopt_path, "w") as f:
            json.dump(adopted, f, indent=1)


def bench_quality(res: dict) -> None:
    """Layer-output relative error of the 4-bit format on 27B-shaped random layers."""
    print("\n== 4-bit quality: relative error of y = x W^T, 16 random rows ==")
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in QUALITY_SHAPES:
        x = torch.randn(16, k, device=dev, generator=gen)
        for dist in ("gaussian", "outliers"):
            w = torch.randn(n, k, device=dev, generator=gen) * k ** -0.5
            if dist == "outliers":  # 0.5% of the weights 8x larger, a few input channels 4x larger
                w = torch.where(torch.rand(n, k, device=dev, generator=gen) < 0.005, w * 8, w)
                w[:, torch.randperm(k, device=dev, generator=gen)[:k // 100]] *= 4
            y = x @ w.t()
            for g in (32, 64, 128, 256):
                for had in (False, True):
                    q, s, z = quantize_tensor(w, g, had)
                    qw = QuantWeight.from_stored(q, s, z, had, torch.float32, dev)
                    e = rel(qw.prepare_input(x) @ qw.dequantize().t(), y)
                    bits = 4 + 32 / g
                    print(f"q4 {n:>6}x{k:<6} {dist:<9} group {g:<3} hadamard {had!s:<5} rel err {e:.4f} "
                          f"({bits:.3f} bits/weight)")
                    res["quality"].append({"shape": [n, k], "dist": dist, "group": g, "hadamard": had,
                                           "rel_err": e, "bits_per_weight": bits})
            del w
    torch.cuda.empty_cache()


# ---- small ops ------------------------------------------------------------------------------

def bench_small(res: dict) -> None:
    print("\n== fused small ops: parity vs reference (bf16), time per call in a CUDA graph ==")
    dev, bf = DEV, BF
    r = torch.randn
    x, h = r(8, 5120, device=dev, dtype=bf), r(8, 5120, device=dev, dtype=bf)
    w = (r(5120, device=dev) * 0.3).to(bf)
    xg, zg, wg = r(8, 48, 128, device=dev, dtype=bf), r(8, 48, 128, device=dev, dtype=bf), r(128, device=dev, dtype=bf)
    qg = r(8, 24, 512, device=dev, dtype=bf)
    q = qg[..., :256]
    cos, sin = rope.rope_cos_sin(torch.arange(1000, 1008, device=dev), 64, 1e7)
    a, b = r(8, 17408, device=dev, dtype=bf), r(8, 17408, device=dev, dtype=bf)
    logits = r(4, 248320, device=dev)
    tgt = logits.argmax(-1)
    draft = tgt[:3].clone()
    draft[2] += 1
    cases = [
        ("rms_norm 8x5120", lambda: nk.rms_norm_triton(x, w, 1e-6), lambda: norm.rms_norm_ref(x, w, 1e-6)),
        ("add_rms_norm 8x5120", lambda: nk.add_rms_norm_triton(x, h, w, 1e-6)[1],
         lambda: norm.add_rms_norm_ref(x, h, w, 1e-6)[1]),
        ("gated_rms_norm 8x48x128", lambda: nk.gated_rms_norm_triton(xg, zg, wg, 1e-6),
         lambda: norm.gated_rms_norm_ref(xg, zg, wg, 1e-6)),
        ("rope 8x24x256 (64 rotary)", lambda: ts.apply_rope_triton(q, cos, sin), lambda: rope.apply_rope_ref(q, cos, sin)),
        ("silu_mul 8x17408", lambda: ts.silu_mul_triton(a, b), lambda: silu_mul_ref(a, b)),
        ("argmax 4x248320", lambda: ts.argmax_triton(logits), lambda: greedy.argmax_ref(logits)),
        ("greedy_accept 4x248320", lambda: ts.greedy_accept_triton(logits, draft)[0],
         lambda: greedy.greedy_accept_ref(logits, draft)[0]),
    ]
    xr = r(1, 5120, device=dev, dtype=bf)
    cases.append(("hadamard_rotate 1x5120 b128", lambda: hadamard_rotate(xr, 128), lambda: hadamard_rotate(xr, 128)))
    for name, fk, fr in cases:
        yk, yr = fk(), fr()
        if yk.dtype == torch.int64:
            err = 0.0 if torch.equal(yk, yr) else 1.0
        else:
            err = float((yk.float() - yr.float()).abs().max())
        nd = float((yk != yr).float().mean())
        tk, tr = graph_time([fk], 200), graph_time([fr], 200)
        print(f"{name:<28} max abs diff {err:.2e} (differing {nd:.2%})  fused {tk * 1e6:6.1f} us  "
              f"reference {tr * 1e6:6.1f} us")
        res["small"].append({"op": name, "max_abs_diff": err, "frac_differing": nd, "fused_us": tk * 1e6,
                             "ref_us": tr * 1e6})
    t, n = ts.greedy_accept_triton(logits, draft)
    res["small"].append({"op": "greedy_accept n", "got": int(n), "want": 2})
    print(f"greedy_accept n = {int(n)} (want 2), targets equal: {torch.equal(t, tgt)}")


def bench_e2e(res: dict) -> None:
    """Tiny model, quantized with the CLI, on the GPU in bf16: greedy MTP must equal AR."""
    print("\n== end to end on the GPU: tiny model, bf16 and 4-bit, greedy MTP vs AR ==")
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tinymodels import make_checkpoint
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.cli import main as cli

    root = tempfile.mkdtemp()
    src = make_checkpoint(os.path.join(root, "src"), "base", seed=3, hidden_size=128, intermediate_size=256)
    dst = os.path.join(root, "q4")
    cli(["quantize", src, dst, "--group-size", "64"])
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    for name, path in (("bf16", src), ("q4", dst)):
        with LLM(path, device=DEV, spec="auto") as llm:
            ar = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="off"))
            mtp = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="mtp", k=3))
        same = ar.token_ids == mtp.token_ids
        print(f"{name}: MTP == AR: {same} ({len(ar.token_ids)} tokens, mean accept "
              f"{mtp.stats['mean_accept_len']:.2f})")
        res["e2e"].append({"model": name, "mtp_equals_ar": same, "tokens": len(ar.token_ids)})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default configs only, one group size")
    ap.add_argument("--sweep", default="gemv,q4", help="which kernels get the config sweep (comma list)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of gemv,q4,q4rows,bf16small,quality,small,e2e")
    ap.add_argument("--q4rows-budget", type=float, default=60.0, help="seconds of 8-row-tile sweep before it stops")
    ap.add_argument("--adopt", default=None, help="write the q4rows section's adopted configs (JSON) here")
    ap.add_argument("--warm-q4rows", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-bf16", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm_q4rows:
        warm_q4_rows(args.warm_q4rows)
        return 0
    if args.warm_bf16:
        warm_bf16_small(*(int(v) for v in args.warm_bf16.split("/")))
        torch.cuda.synchronize()
        return 0
    torch.manual_seed(0)
    import triton
    res: dict = {"gpu": "cpu-smoke" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "gemv": [], "q4": [], "q4_rows": [], "quality": [], "small": [], "e2e": []}
    print(f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  ceiling {PEAK / 1e12:.2f} TB/s")
    skip = set(args.skip.split(","))
    t0 = time.time()
    for name, fn in (("gemv", lambda r: bench_gemv(r, args.quick or "gemv" not in args.sweep)),
                     ("q4", lambda r: bench_q4(r, args.quick or "q4" not in args.sweep, full=not args.quick)),
                     ("q4rows", lambda r: bench_q4_rows(r, args.q4rows_budget, args.adopt)),
                     ("bf16small", lambda r: bench_bf16_small(r, args.adopt)),
                     ("small", bench_small), ("e2e", bench_e2e), ("quality", bench_quality)):
        if name in skip:
            continue
        try:
            fn(res)
        except Exception as e:  # keep the other sections' results
            import traceback
            traceback.print_exc()
            res[name + "_error"] = f"{type(e).__name__}: {e}"
        print(f"[{name} done at {time.time() - t0:.0f} s]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    summary = {
        "gpu": res["gpu"],
        "gemv_frac_M1": {f"{g['shape'][0]}x{g['shape'][1]}": round(g["rows"][0]["ours_frac"], 3) for g in res["gemv"]},
        "gemv_best_frac_M1": {f"{g['shape'][0]}x{g['shape'][1]}": round(g["rows"][0]["best_frac"], 3)
                              for g in res["gemv"]},
        "cublas_frac_M1": {f"{g['shape'][0]}x{g['shape'][1]}": round(g["rows"][0]["stock_frac"], 3)
                           for g in res["gemv"]},
        "gemv_row_invariant": all(g["row_invariant"] for g in res["gemv"]) if res["gemv"] else None,
        "q4_frac_M1": {f"g{q['group']}:{q['shape'][0]}x{q['shape'][1]}": round(q["rows"][0]["ours_frac"], 3)
                       for q in res["q4"]},
        "q4_best_frac_M1": {f"g{q['group']}:{q['shape'][0]}x{q['shape'][1]}": round(q["rows"][0]["best_frac"], 3)
                            for q in res["q4"]},
        "q4_row_invariant": all(q["row_invariant"] for q in res["q4"]) if res["q4"] else None,
        "e2e_mtp_equals_ar": [e["mtp_equals_ar"] for e in res["e2e"]],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
