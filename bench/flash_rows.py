"""Multi-row attention over the KV cache (decode and verify), bf16 and Q8, on 27B geometry.

For each KV kind and row count R (rows at positions seq .. seq+R-1, reading seq+r+1 keys):
parity (relative error vs attention_rows_ref in float32), bitwise row invariance (row r of the
R-row call == a one-row call at that position), time (CUDA graph of 20 calls, alternating two
caches so L2 never holds the KV), speedup vs running the R rows one at a time with the same
kernel, achieved bandwidth (KV bytes read / time, fraction of 4.17 TB/s), and the stock path
(torch SDPA over a head-major bf16 cache) for comparison. A table, then one JSON line.

    python bench/flash_rows.py --check --rows 1,2,3,4,5,8 --seq 33014
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import graph_time  # bench/timing.py: run as a script, this folder is on sys.path
import torch.nn.functional as F

from specfire.kernels import attention as A
from specfire.kernels.attention.kernel import BLOCK_M, BLOCK_N, PREFETCH, SPLIT, attention_rows_triton

PEAK = 4.17e12
ITERS = 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="parity and bitwise row invariance before timing")
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--seq", type=int, default=33014)
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--variants", default=f"{BLOCK_M}x{SPLIT}x{BLOCK_N}x4x2x{int(PREFETCH)}",
                    help="comma list of block_m x split x block_n x warps x stages x q8-prefetch(0/1)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    variants = [(tuple(int(y) for y in v.split("x")) + (0,))[:6] for v in a.variants.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    seq, hq, hkv, d = a.seq, a.hq, a.hkv, a.dim
    max_seq = seq + max(rows) + 16
    scale = d ** -0.5
    caches = {}
    for kind in ("bf16", "q8"):
        caches[kind] = []
        for copy in range(2):
            k = torch.randn(max_seq, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(max_seq, hkv, d, device=dev, dtype=torch.bfloat16)
            if kind == "bf16":
                caches[kind].append((k, v, None, None))
            else:
                kq, ks = A.quantize_q8(k)
                vq, vs = A.quantize_q8(v)
                caches[kind].append((kq, vq, ks, vs))
            del k, v
    qs = {r: torch.randn(r, hq, d, device=dev, dtype=torch.bfloat16) * 2 for r in rows}
    pos0 = seq

    def kv_bytes(kind: str, n: int) -> int:
        per = hkv * d * 2  # k and v, one byte each
        if kind == "bf16":
            per *= 2
        else:
            per += hkv * (d // A.q8_group(d)) * 2 * 2
        return n * per

    results = []
    ok = True
    for kind in ("bf16", "q8"):
        kc, vc, ks, vs = caches[kind][0]
        seen = set()
        for vi, (bm, sp, bn, nw, ns, pf) in enumerate(variants):
            pf = pf if kind == "q8" else 0          # prefetch only changes the Q8 kernel
            if (bm, sp, bn, nw, ns, pf) in seen:
                continue
            seen.add((bm, sp, bn, nw, ns, pf))
            kw = dict(block_m=bm, split=sp, block_n=bn, num_warps=nw, num_stages=ns, prefetch=bool(pf))
            vname = f"{bm}x{sp}x{bn}x{nw}x{ns}x{pf}"
            try:
                attention_rows_triton(qs[rows[0]], kc, vc, pos0, scale, ks, vs, **kw)
            except Exception as e:  # a variant that does not fit (shared memory) is reported, not fatal
                print(f"# {kind} variant {vname}: {type(e).__name__}: {str(e)[:120]}")
                continue
            one = {}
            for r in rows:
                q = qs[r]
                rec = dict(kv=kind, rows=r, variant=vname, seq=seq)
                out = attention_rows_triton(q, kc, vc, pos0, scale, ks, vs, **kw)
                if a.check:
                    if ks is None:
                        ref = A.attention_rows_ref(q, kc, vc, pos0, scale)
                    else:
                        ref = A.attention_rows_q8_ref(q, kc, vc, pos0, scale, ks, vs)
                    rec["rel_err"] = ((out - ref).norm() / ref.norm()).item()
                    inv = True
                    for i in range(r):
                        o1 = attention_rows_triton(q[i:i + 1], kc, vc, pos0 + i, scale, ks, vs, **kw)
                        inv &= torch.equal(o1[0], out[i])
                    rec["row_invariant"] = inv
                    ok &= inv and rec["rel_err"] < 2e-2
                fns = [lambda c=c: attention_rows_triton(q, c[0], c[1], pos0, scale, c[2], c[3], **kw)
                       for c in caches[kind]]
                t = graph_time(fns, ITERS)
                if r == 1:
                    one[kind] = t
                n = pos0 + r
                rec["us"] = t * 1e6
                rec["one_at_a_time_us"] = r * one[kind] * 1e6
                rec["speedup_vs_one_at_a_time"] = r * one[kind] / t
                rec["TBps"] = kv_bytes(kind, n) / t / 1e12
                rec["frac_peak"] = kv_bytes(kind, n) / t / PEAK
                if kind == "bf16" and vi == 0:
                    try:
                        heads = [(c[0][:n].permute(1, 0, 2).contiguous()[None], c[1][:n].permute(1, 0, 2).contiguous()[None])
                                 for c in caches[kind]]
                        qh = q.transpose(0, 1)[None]                        # [1, Hq, R, D]
                        mask = None if r == 1 else (torch.arange(n, device=dev)[None, :] <=
                                                    torch.arange(pos0, n, device=dev)[:, None])
                        sfns = [lambda h=h: F.scaled_dot_product_attention(qh, h[0], h[1], attn_mask=mask,
                                                                           scale=scale, enable_gqa=True)
                                for h in heads]
                        ts = graph_time(sfns, ITERS)
                        rec["stock_sdpa_us"] = ts * 1e6
                        rec["stock_frac_peak"] = kv_bytes(kind, n) / ts / PEAK
                        del heads
                    except Exception as e:
                        rec["stock_sdpa_us"] = None
                        print(f"# stock SDPA failed at R={r}: {type(e).__name__}: {str(e)[:120]}")
                results.append(rec)

    hdr = f"{'kv':4} {'variant':16} {'R':>2} {'rel_err':>9} {'inv':>4} {'us':>8} {'1-by-1 us':>9} {'speedup':>7} {'TB/s':>6} {'%peak':>6} {'sdpa us':>8}"
    print(hdr)
    for rec in results:
        print(f"{rec['kv']:4} {rec['variant']:16} {rec['rows']:>2} {rec.get('rel_err', float('nan')):9.2e} "
              f"{str(rec.get('row_invariant', '-'))[:4]:>4} {rec['us']:8.1f} {rec['one_at_a_time_us']:9.1f} "
              f"{rec['speedup_vs_one_at_a_time']:7.2f} {rec['TBps']:6.2f} {100 * rec['frac_peak']:6.1f} "
              f"{(rec.get('stock_sdpa_us') or float('nan')):8.1f}")
    summary = dict(bench="flash_rows", seq=seq, geometry=[hq, hkv, d], check_ok=ok if a.check else None,
                   device=torch.cuda.get_device_name(), results=results)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
