"""Gated DeltaNet rows path (decode, verify) on 27B shapes: recurrence with its per-row log, conv window.

Checks first (parity to the float32 reference recurrence; bitwise row invariance: T rows at once
== T chained one-row calls, each from the state the previous one's log committed), then times the
kernel (CUDA graph, rotating over per-layer states so L2 never holds them) against the PyTorch
reference on the same GPU. Bytes = state read once (the log is a few KB; the commit's read and
write of the state are kernels/gdn/kernel.py commit_rows_triton's, not timed here). Before the
per-row log the kernel wrote the state after every row (figures in docs/BENCHMARKS.md).
A table, then one JSON line.

    python bench/gdn.py --check --rows 1,2,3,4,5,6,7,8,16
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import graph_time  # bench/timing.py: run as a script, this folder is on sys.path

from specfire.kernels import gdn as G
from specfire.kernels.gdn.kernel import (BV, NUM_WARPS, commit_rows_triton, conv_window_triton, gdn_chunked_triton,
                                     gdn_rows_triton)

PEAK = 4.17e12
ITERS = 24


def eager_time(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3 / iters


def inputs(t: int, hv: int, hk: int, dk: int, dv: int, dev) -> tuple[torch.Tensor, ...]:
    rep = hv // hk
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, device=dev), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, device=dev), dim=-1)
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    v = torch.randn(t, hv, dv, device=dev)
    g = -torch.rand(t, hv, device=dev) * 0.5
    beta = torch.rand(t, hv, device=dev)
    return q, k, v, g, beta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,16")
    ap.add_argument("--hv", type=int, default=48)
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--layers", type=int, default=48, help="states rotated through while timing")
    ap.add_argument("--variants", default=f"{BV}x{NUM_WARPS}", help="comma list of bv x warps; the first is the default")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    variants = [tuple(int(y) for y in v.split("x")) for v in a.variants.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hv, hk, dk, dv = a.hv, a.hk, a.dk, a.dv
    states = [torch.randn(hv, dk, dv, device=dev) * 0.1 for _ in range(a.layers)]
    state_bytes = hv * dk * dv * 4
    ok = True
    results = []
    for r in rows:
        q, k, v, g, beta = inputs(r, hv, hk, dk, dv, dev)
        rec = dict(op="gdn_rows", rows=r)
        if a.check:
            o, (delta, dec) = gdn_rows_triton(q, k, v, g, beta, states[0], True)
            ro, rfinal = G.gdn_rows_ref(q, k, v, g, beta, states[0])
            final = states[0][None].clone()
            commit_rows_triton(final, k.contiguous()[None], delta[None], dec[None], r)
            rec["o_rel_err"] = ((o - ro).norm() / ro.norm()).item()
            rec["state_rel_err"] = ((final[0] - rfinal).norm() / rfinal.norm()).item()
            s, inv = states[0][None].clone(), True
            for i in range(r):
                o1, (d1, e1) = gdn_rows_triton(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], s[0], True)
                inv &= torch.equal(o1[0], o[i]) and torch.equal(d1[0], delta[i])
                commit_rows_triton(s, k[i:i + 1].contiguous()[None], d1[None], e1[None], 1)
            inv &= torch.equal(s, final)
            rec["row_invariant"] = inv
            ok &= inv and rec["o_rel_err"] < 1e-5 and rec["state_rel_err"] < 1e-5
        for bv, nw in variants:
            fns = [lambda s=s: gdn_rows_triton(q, k, v, g, beta, s, True, bv=bv, num_warps=nw) for s in states]
            t = graph_time(fns, ITERS)
            nbytes = state_bytes
            rec[f"us_{bv}x{nw}"] = t * 1e6
            rec[f"frac_peak_{bv}x{nw}"] = nbytes / t / PEAK
        bv, nw = variants[0]
        rec["us"] = rec[f"us_{bv}x{nw}"]
        rec["TBps"] = state_bytes / (rec["us"] * 1e-6) / 1e12
        rec["frac_peak"] = rec[f"frac_peak_{bv}x{nw}"]
        rec["ref_us"] = eager_time(lambda: G.gdn_rows_ref(q, k, v, g, beta, states[1], True)) * 1e6
        results.append(rec)

    conv_dim, kk = 2 * hk * dk + hv * dv, 4
    w = torch.randn(conv_dim, kk, device=dev)
    windows = [torch.randn(kk - 1, conv_dim, device=dev) for _ in range(8)]
    for r in (1, 4, 8):
        x = torch.randn(r, conv_dim, device=dev)
        rec = dict(op="conv_window", rows=r)
        out, full = conv_window_triton(x, windows[0], w)
        ro, rf = G.conv_window_ref(x, windows[0], w)
        rec["rel_err"] = ((out - ro).norm() / ro.norm()).item()
        o1, _ = conv_window_triton(x[-1:], full[r - 1:r - 1 + kk - 1], w)
        rec["row_invariant"] = torch.equal(o1[0], out[-1])
        ok &= rec["row_invariant"] and rec["rel_err"] < 1e-5
        rec["us"] = graph_time([lambda wi=wi: conv_window_triton(x, wi, w) for wi in windows], ITERS) * 1e6
        rec["ref_us"] = graph_time([lambda wi=wi: G.conv_window_ref(x, wi, w) for wi in windows], ITERS) * 1e6
        results.append(rec)

    for t_pre in (1024, 4096):
        q, k, v, g, beta = inputs(t_pre, hv, hk, dk, dv, dev)
        o, s = gdn_chunked_triton(q, k, v, g, beta, states[0])
        ro, rs = G.gdn_rows_ref(q, k, v, g, beta, states[0]) if t_pre <= 1024 else G.gdn_chunked_ref(
            q, k, v, g, beta, states[0])
        rec = dict(op="gdn_chunked", rows=t_pre, rel_err=((o - ro).norm() / ro.norm()).item(),
                   state_rel_err=((s - rs).norm() / rs.norm()).item())
        ok &= rec["rel_err"] < 1e-4 and rec["state_rel_err"] < 1e-4
        rec["us"] = eager_time(lambda: gdn_chunked_triton(q, k, v, g, beta, states[0]), iters=3) * 1e6
        rec["ref_us"] = eager_time(lambda: G.gdn_chunked_ref(q, k, v, g, beta, states[0]), iters=3) * 1e6
        results.append(rec)

    print(f"{'op':12} {'T':>4} {'err':>9} {'inv':>5} {'us':>8} {'TB/s':>6} {'%peak':>6} {'ref us':>8}  variants")
    for rec in results:
        err = rec.get("o_rel_err", rec.get("rel_err", float("nan")))
        var = " ".join(f"{k[3:]}={v:.1f}" for k, v in rec.items() if k.startswith("us_"))
        print(f"{rec['op']:12} {rec['rows']:>4} {err:9.2e} {str(rec.get('row_invariant', '-'))[:5]:>5} "
              f"{rec['us']:8.1f} {rec.get('TBps', float('nan')):6.2f} {100 * rec.get('frac_peak', float('nan')):6.1f} "
              f"{rec.get('ref_us', float('nan')):8.1f}  {var}")
    summary = dict(bench="gdn", shapes=dict(hv=hv, hk=hk, dk=dk, dv=dv), check_ok=ok if a.check else None,
                   device=torch.cuda.get_device_name(), results=results)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
