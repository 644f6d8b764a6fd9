"""Q8 KV attention vs bf16 KV attention per call (decode and verify rows), 27B geometry.

Three caches: bf16; Q8 "group" (one fp16 scale per 32 elements, values head_dim-contiguous: the
format before this bench); Q8 "token" (the cache's format: one scale per position and KV head,
values key-minor as `kernels/attention q8_value_cache` stores them). For each context length, kind,
kernel configuration and row count R (rows at positions seq .. seq+R-1): parity (relative error vs
the float32 reference of the dequantized cache), bitwise row invariance (each row of the R-row
call == a one-row call at its position), time per call (CUDA graph of `iters` calls rotating over
enough cache copies that L2 never holds the one being read, median of 5 replays), bytes the call
must read and their fraction of 4.17 TB/s. Table rows print as measured; JSON at the end.

    python bench/q8kv.py --seqs 33014,8192,512 --rows 1,2,3,4,5 --budget 60 --out $OUT
    BENCH_SMOKE=1 TRITON_INTERPRET=1 python bench/q8kv.py     # CPU check of the script, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from specfire.kernels import attention as A
from specfire.kernels.attention.kernel import attention_rows_triton

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
PEAK = 4.17e12
T0 = time.time()
# kind, label, kernel keywords (block_n x stages x warps, span, tile of (row, head) pairs, q8_mode)
DEFAULT_VARIANTS = [   # in order of priority (the budget cuts the tail); rNNN = registers per thread cap
    ("bf16", "default", {}),
    ("group", "default", {}),
    ("token", "32/3/4", dict(block_n=32, num_stages=3, num_warps=4)),
    ("token", "64/3/8 r128", dict(block_n=64, num_stages=3, num_warps=8, maxnreg=128)),
    ("token", "64/3/4", dict(block_n=64, num_stages=3, num_warps=4)),
    ("token", "64/2/8 r128", dict(block_n=64, num_stages=2, num_warps=8, maxnreg=128)),
    ("token", "32/3/8 r128", dict(block_n=32, num_stages=3, num_warps=8, maxnreg=128)),
    ("token", "64/2/4", dict(block_n=64, num_stages=2, num_warps=4)),
    ("token", "32/3/4 span256", dict(block_n=32, num_stages=3, num_warps=4, split=256)),
    ("token", "32/2/4 span256 r128", dict(block_n=32, num_stages=2, num_warps=4, split=256, maxnreg=128)),
    ("token", "32/3/4 span384 r168", dict(block_n=32, num_stages=3, num_warps=4, split=384, maxnreg=168)),
    ("token", "64/3/8", dict(block_n=64, num_stages=3, num_warps=8)),
    ("token", "32/4/4", dict(block_n=32, num_stages=4, num_warps=4)),
    ("token-rows", "32/3/4", dict(block_n=32, num_stages=3, num_warps=4)),
    ("token", "32/3/4 tile16", dict(block_n=32, num_stages=3, num_warps=4, block_m=16)),
    ("token", "32/3/4 no-asm", dict(block_n=32, num_stages=3, num_warps=4, q8_mode=1)),
    ("token", "32/3/4 r168", dict(block_n=32, num_stages=3, num_warps=4, maxnreg=168)),
]
# context lengths after the first run these only (the first runs every variant)
OTHERS = ("bf16:default,group:default,token:32/3/4,token:64/3/8 r128,token:64/3/4,token:32/3/4 span256,"
          "token:32/2/4 span256 r128")


def build(kind: str, n: int, hkv: int, d: int, dev, gen):
    """One cache copy of `n` positions: (k, v, k_scale, v_scale)."""
    k = torch.randn(n, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(n, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    if kind == "bf16":
        return k, v, None, None
    if kind == "group":
        kq, ks = A.quantize_q8(k, A.Q8_GROUP)
        vq, vs = A.quantize_q8(v, A.Q8_GROUP)
        return kq, vq, ks, vs
    kq, ks = A.quantize_q8(k)
    vq, vs = A.quantize_q8(v)
    if kind == "token":
        vc = A.q8_value_cache(n, hkv, d, dev)
        vc.copy_(vq)
        vq = vc
    return kq, vq, ks, vs


def kv_bytes(kind: str, n: int, hkv: int, d: int) -> int:
    if kind == "bf16":
        return n * hkv * d * 2 * 2
    ns = d // A.Q8_GROUP if kind == "group" else 1
    return n * hkv * (d + 2 * ns) * 2


def graph_time(fns, iters: int) -> float:
    if SMOKE:
        t = time.perf_counter()
        fns[0]()
        return time.perf_counter() - t
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import graph_time as gt
    return gt(fns, iters)


def _warm(job) -> str:
    """Compile one variant's kernels in a worker process (Triton's on-disk cache then serves the
    main process): a small cache with the same strides' divisibility, R = 1 and R = 2."""
    kind, label, kw, hq, hkv, d = job
    try:
        dev = torch.device("cpu" if SMOKE else "cuda")
        gen = torch.Generator(device=dev).manual_seed(1)
        n = 40 if SMOKE else 1216
        kc, vc, ks, vs = build(kind, n, hkv, d, dev, gen)
        for r in (1, 2):
            q = torch.randn(r, hq, d, device=dev, generator=gen).to(torch.bfloat16)
            attention_rows_triton(q, kc, vc, n - 8, d ** -0.5, ks, vs, **kw)
        if not SMOKE:
            torch.cuda.synchronize()
        return f"{kind}:{label} ok"
    except Exception as e:
        return f"{kind}:{label} {type(e).__name__}: {str(e)[:100]}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="40,9" if SMOKE else "33014,8192,512")
    ap.add_argument("--rows", default="1,2,3" if SMOKE else "1,2,3,4,5")
    ap.add_argument("--hq", type=int, default=6 if SMOKE else 24)
    ap.add_argument("--hkv", type=int, default=2 if SMOKE else 4)
    ap.add_argument("--dim", type=int, default=32 if SMOKE else 256)
    ap.add_argument("--only", default="", help="comma list of 'kind:label' to run (default: all)")
    ap.add_argument("--devpos", default="bf16:default,group:default,token:32/3/4,token:64/3/8 r128",
                    help="variants also timed with the position on the device (first context length)")
    ap.add_argument("--others", default=OTHERS, help="variants for the context lengths after the first")
    ap.add_argument("--warm-workers", type=int, default=0 if SMOKE else 12, help="parallel compile processes")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds; later variants are skipped past it")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    seqs = [int(x) for x in a.seqs.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    hq, hkv, d = a.hq, a.hkv, a.dim
    scale = d ** -0.5
    variants = [v for v in DEFAULT_VARIANTS if not a.only or f"{v[0]}:{v[1]}" in a.only.split(",")]
    if SMOKE:   # tiny spans and blocks so several spans, blocks and masked tails run on the CPU
        variants = [(k, lab, {**kw, "block_n": 16, "split": 32 if "span" not in lab else 16,
                              "block_m": 16, "num_stages": 1}) for k, lab, kw in variants]
    if a.warm_workers:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(a.warm_workers, mp_context=mp.get_context("spawn")) as ex:
            for msg in ex.map(_warm, [(k, lab, kw, hq, hkv, d) for k, lab, kw in variants]):
                print(f"# warm {msg} ({time.time() - T0:.1f} s)", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    results, ok_all, skipped = [], True, []
    hdr = (f"{'seq':>6} {'kv':10} {'variant':16} {'R':>2} {'rel_err':>8} {'inv':>4} {'us':>7} {'MB':>7} "
           f"{'TB/s':>5} {'%4.17':>6}")
    print(hdr, flush=True)
    for seq in seqs:
        caches = {}
        qs = {r: (torch.randn(r, hq, d, device=dev, generator=gen) * 2).to(torch.bfloat16) for r in rows}
        for kind, label, kw in variants:
            if seq != seqs[0] and f"{kind}:{label}" not in a.others.split(","):
                continue
            if time.time() - T0 > a.budget:
                skipped.append(f"{seq}:{kind}:{label}")
                continue
            n = seq + max(rows) + 16
            if kind not in caches:
                copies = 1 if SMOKE else min(64, max(2, math.ceil(160e6 / kv_bytes(kind, n, hkv, d))))
                caches[kind] = [build(kind, n, hkv, d, dev, gen) for _ in range(copies)]
            kc, vc, ks, vs = caches[kind][0]
            try:
                attention_rows_triton(qs[rows[0]], kc, vc, seq, scale, ks, vs, **kw)
            except Exception as e:   # a configuration that does not fit is reported, not fatal
                print(f"# {seq} {kind} {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            for devpos in ([False, True] if seq == seqs[0] and f"{kind}:{label}" in a.devpos.split(",") else [False]):
                for r in rows:
                    q = qs[r]
                    # devpos: the position as a device tensor, as the model's CUDA graphs pass it (the
                    # launch then covers every span of the cache; spans past the rows exit at once)
                    pos = (lambda p: torch.tensor([p], device=dev)) if devpos else (lambda p: p)
                    out = attention_rows_triton(q, kc, vc, pos(seq), scale, ks, vs, **kw)
                    ref = (A.attention_rows_ref(q, kc, vc, seq, scale) if ks is None else
                           A.attention_rows_q8_ref(q, kc, vc, seq, scale, ks, vs))
                    err = float((out - ref).norm() / ref.norm())
                    inv = all(torch.equal(attention_rows_triton(q[i:i + 1], kc, vc, pos(seq + i), scale, ks, vs,
                                                                **kw)[0], out[i]) for i in range(r))
                    ok_all &= inv and err < 5e-3
                    pt = pos(seq)
                    fns = [lambda c=c: attention_rows_triton(q, c[0], c[1], pt, scale, c[2], c[3], **kw)
                           for c in caches[kind]]
                    t = graph_time(fns, max(20, len(fns)))
                    nb = kv_bytes(kind, seq + r, hkv, d)
                    vname = label + (" devpos" if devpos else "")
                    rec = dict(seq=seq, kv=kind, variant=vname, rows=r, rel_err=err, row_invariant=inv,
                               us=t * 1e6, bytes=nb, TBps=nb / t / 1e12, frac_peak=nb / t / PEAK)
                    results.append(rec)
                    print(f"{seq:>6} {kind:10} {vname:16} {r:>2} {err:8.1e} {str(inv)[:4]:>4} {t * 1e6:7.1f} "
                          f"{nb / 1e6:7.2f} {nb / t / 1e12:5.2f} {100 * nb / t / PEAK:6.1f}", flush=True)
        del caches
    best = {}
    for rec in results:
        key = (rec["seq"], rec["kv"], rec["rows"])
        if rec["row_invariant"] and (key not in best or rec["us"] < best[key]["us"]):
            best[key] = rec
    print("\nfastest row-invariant configuration per (seq, kind, R):")
    for (seq, kind, r), rec in sorted(best.items()):
        print(f"{seq:>6} {kind:10} R={r} {rec['variant']:16} {rec['us']:7.1f} us {100 * rec['frac_peak']:5.1f}%")
    summary = dict(bench="q8kv", geometry=[hq, hkv, d], check_ok=ok_all, skipped=skipped,
                   device="cpu" if SMOKE else torch.cuda.get_device_name(), seconds=time.time() - T0,
                   results=results)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "q8kv.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
