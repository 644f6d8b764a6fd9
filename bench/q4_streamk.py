"""An experiment (issue 12): the 4-bit GEMV over a fixed grid of programs, each streaming an equal run
of (column tile, group) units ("stream-K"), against the engine's kernel, on the 27B launch shapes.

    PYTHONPATH=$PWD python bench/q4_streamk.py --out $OUT                            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/q4_streamk.py --smoke            # CPU: bits vs reference

Why (bench/q4_floor.py, bench/q4_gluon.py): a layer launch of the engine kernel runs at 1.36-1.9x
the time of a plain read of the same bytes, while its lm_head launch (7,760 programs, many waves)
streams at 92%, and leaving out the nibble conversion and the per-group scale loads still leaves the
layer launches at 44-74%. The question here: is it how the work is cut into programs (a grid of
(tile, split) programs filling the GPU 0.7-1.6 times, a partial last wave)? The grid is a fixed
number of programs (about as many as fit at once), the units tile-major, group-minor, dealt out in
equal contiguous runs; a run is cut at tile boundaries into 1-3 segments, each the engine kernel's
own loop; a tile's runs store float32 partials that the last of them to finish adds in run order.
Every output element is the engine kernel's arithmetic (per group t = (128 + q) . x on the tensor
cores, acc += s t + (z - 128 s) sum(x) in fp32), its groups in order within a run and the runs in
order: row-invariant, a function of (N, K, programs) only; the bits differ from the engine's, whose
split points differ. Measured on one H200 (docs/BENCHMARKS.md, "Tenth wave"): as cheap per byte as
the engine on long runs, and no win on any layer launch: a grid without a partial wave does not lift
them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from q4_floor import SHAPES, gsums, row_invariant  # noqa: E402
from specfire.kernels.q4.gemv import _codes, _locks, _mm, q4_config, q4_group  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _owner(u, U, P):
    """The program whose run holds unit u (runs: program p has units [p U / P, (p + 1) U / P))."""
    return ((u + 1) * P - 1) // U


@triton.jit
def _q4_sk_seg_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, z_ptr, y_ptr, part_ptr, cnt_ptr, M, N, KH, stride_xm,
                      n_groups: tl.constexpr, U, P, MAXSEG, BLOCK_N: tl.constexpr, G: tl.constexpr,
                      TILE: tl.constexpr, ROWS_: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr,
                      STAGES: tl.constexpr):
    """Program p's run of units [p U / P, (p + 1) U / P), cut at tile boundaries into 1-3 segments,
    every segment the engine kernel's own loop (a fixed tile, groups in order, the next group's
    scales, zeros and sums prefetched into registers): no branch and no division in the pipelined
    loop (a first form, one flat loop over the units with the tile computed from the unit and the
    partials stored under a branch, was ~1.2x slower per byte: docs/BENCHMARKS.md, commit 673f50e)."""
    pid = tl.program_id(0)
    HALF: tl.constexpr = G // 2
    u_lo = (pid * U) // P
    u_hi = ((pid + 1) * U) // P
    offs_r = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS_)
    offs_c = tl.arange(0, HALF)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :]
    for tile in range(u_lo // n_groups, (u_hi - 1) // n_groups + 1):
        g_lo = tl.maximum(u_lo - tile * n_groups, 0)
        g_hi = tl.minimum(u_hi - tile * n_groups, n_groups)
        offs_n = tile * BLOCK_N + offs_r
        n_mask = offs_n < N
        q_rows = q_ptr + tile * (KH * TILE) + offs_r[:, None] * HALF + offs_c[None, :]
        acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
        s0 = tl.load(s_ptr + g_lo * N + offs_n, mask=n_mask, other=0.0)
        z0 = tl.load(z_ptr + g_lo * N + offs_n, mask=n_mask, other=0.0)
        xs0 = tl.load(xs_ptr + offs_m * n_groups + g_lo, mask=m_mask, other=0.0)
        for g in tl.range(g_lo, g_hi, num_stages=STAGES):
            okn = (g + 1 + offs_n * 0) < g_hi          # the prefetch past the segment's last group: nothing
            okm = (g + 1 + offs_m * 0) < g_hi
            s1 = tl.load(s_ptr + (g + 1) * N + offs_n, mask=n_mask & okn, other=0.0)
            z1 = tl.load(z_ptr + (g + 1) * N + offs_n, mask=n_mask & okn, other=0.0)
            xs1 = tl.load(xs_ptr + offs_m * n_groups + g + 1, mask=m_mask & okm, other=0.0)
            qb = tl.load(q_rows + g * (TILE * HALF), mask=n_mask[:, None], other=0)
            xe = tl.load(x_rows + g * G, mask=m_mask[:, None], other=0.0)
            xo = tl.load(x_rows + g * G + HALF, mask=m_mask[:, None], other=0.0)
            if IEEE:
                xe = xe.to(tl.float32)
                xo = xo.to(tl.float32)
            lo, hi = _codes(qb, xe.dtype, ASM)
            sf = s0.to(tl.float32)
            zf = z0.to(tl.float32) - 128.0 * sf
            t = _mm(hi, tl.trans(xo), _mm(lo, tl.trans(xe), tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32), IEEE),
                    IEEE)
            acc = tl.fma(t, sf[:, None], acc)
            acc = tl.fma(zf[:, None], xs0[None, :], acc)
            s0, z0, xs0 = s1, z1, xs1
        first = _owner(tile * n_groups, U, P)
        nseg = _owner(tile * n_groups + n_groups - 1, U, P) - first + 1
        out_msk = n_mask[:, None] & m_mask[None, :]
        y_off = offs_m[None, :] * N + offs_n[:, None]
        if nseg == 1:
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=out_msk)
        else:
            p_off = (tile * MAXSEG) * (ROWS_ * BLOCK_N) + offs_m[None, :] * BLOCK_N + offs_r[:, None]
            tl.store(part_ptr + p_off + (pid - first) * (ROWS_ * BLOCK_N), acc, mask=out_msk)
            tl.debug_barrier()
            cnt = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if cnt == nseg - 1:
                tot = tl.load(part_ptr + p_off, mask=out_msk, other=0.0, cache_modifier=".cg")
                for sg in range(1, nseg):
                    tot += tl.load(part_ptr + p_off + sg * (ROWS_ * BLOCK_N), mask=out_msk, other=0.0,
                                   cache_modifier=".cg")
                tl.store(y_ptr + y_off, tot.to(y_ptr.dtype.element_ty), mask=out_msk)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def q4_streamk(x: torch.Tensor, qw, xs: torch.Tensor, progs: int, warps: int = 2, stages: int = 3) -> torch.Tensor:
    """x [M <= 8, K] @ dequant(qw)^T -> [M, N] (x's dtype); xs: x's group sums float32 [M, K / G]."""
    m, k = x.shape
    n = qw.shape[0]
    g = qw.group_size
    assert qw.tile > 0 and m <= 8
    n_groups = k // g
    tiles = triton.cdiv(n, qw.tile)
    units = tiles * n_groups
    progs = min(progs, units)
    maxseg = triton.cdiv(n_groups, units // progs) + 1
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(tiles * maxseg * 8 * qw.tile, device=x.device, dtype=torch.float32)
    cnt = _locks(x.device, tiles)
    _q4_sk_seg_kernel[(progs,)](x, xs, qw.qtiled, qw.scales_t, qw.zeros_t, y, part, cnt, m, n, k // 2, x.stride(0),
                            n_groups, units, progs, maxseg, BLOCK_N=qw.tile, G=g, TILE=qw.tile, ROWS_=8,
                            ASM=x.dtype == torch.bfloat16 and not INTERPRET, IEEE=x.dtype == torch.float32,
                            STAGES=stages, num_warps=warps, num_stages=stages)
    return y


def smoke() -> None:
    """CPU (interpreter, float32): against the dequantized reference, row-invariant, several grids."""
    from specfire.kernels.q4 import QuantWeight, quantize_tensor
    torch.manual_seed(0)
    for n, k, g, progs in ((192, 512, 64, 5), (130, 384, 64, 7), (64, 256, 64, 3), (192, 512, 64, 1)):
        w = torch.randn(n, k)
        q, s, z = quantize_tensor(w, g)
        qw = QuantWeight.from_stored(q, s, z, False, torch.float32, "cpu")
        x = torch.randn(5, k)
        ref = x @ qw.dequantize().float().T
        y = q4_streamk(x, qw, gsums(x, g), progs)
        err = float((y - ref).abs().max() / ref.abs().max())
        inv = row_invariant(lambda xx: q4_streamk(xx, qw, gsums(xx, g), progs), x)
        print(json.dumps({"shape": [n, k], "g": g, "progs": progs, "rel_err": err, "row_invariant": inv}))
        assert err < 1e-5 and inv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--progs", default="8,10,12", help="programs per SM to try")
    ap.add_argument("--warps-stages", default="2,3;2,4", help="num_warps,num_stages ; ...")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    from linear import PEAK, graph_time, rotated_q4
    from tp import Log
    log = Log(args.out, name="q4_streamk.jsonl")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log("start", commit=args.commit, torch=torch.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name(), sms=sms)
    t0 = time.monotonic()
    for n, k, label in SHAPES:
        qws = rotated_q4(n, k, 128, "cuda")
        qw0, nbytes = qws[0], qws[0].nbytes()
        x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        base = q4_config(n, k, 128)
        ref = q4_group(x8, [qw0], base, gsums(x8, 128))[0]
        rec = {"shape": [n, k], "name": label, "mb": round(nbytes / 1e6, 1), "engine": {}, "streamk": {}}
        for m in (1, 4):
            xm, sm = x8[:m].contiguous(), gsums(x8[:m], 128)
            rec["engine"][f"m{m}_us"] = round(graph_time([lambda w=w: q4_group(xm, [w], base, sm) for w in qws]) * 1e6, 2)
        rec["engine"]["m1_frac"] = round(nbytes / (rec["engine"]["m1_us"] * 1e-6) / PEAK, 4)
        for pps, ws in [(p_, w_) for p_ in (int(v) for v in args.progs.split(",")) for w_ in args.warps_stages.split(";")]:
            nw, ns = (int(v) for v in ws.split(","))
            key = f"progs {pps}x{sms} w{nw} s{ns}"
            try:
                got = q4_streamk(x8, qw0, gsums(x8, 128), pps * sms, nw, ns)
                r = {"rel_err_vs_engine": float((got.float() - ref.float()).abs().max() / ref.float().abs().max()),
                     "row_invariant": row_invariant(
                         lambda xx: q4_streamk(xx, qw0, gsums(xx, 128), pps * sms, nw, ns), x8)}
                for m in (1, 4):
                    xm, sm = x8[:m].contiguous(), gsums(x8[:m], 128)
                    t = graph_time([lambda w=w: q4_streamk(xm, w, sm, pps * sms, nw, ns) for w in qws]) * 1e6
                    r[f"m{m}_us"] = round(t, 2)
                    r[f"m{m}_frac"] = round(nbytes / (t * 1e-6) / PEAK, 4)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or launch
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rec["streamk"][key] = r
        log("shape", **rec)
        qws = qw0 = None
        torch.cuda.empty_cache()
    log("done", seconds=round(time.monotonic() - t0, 1))


if __name__ == "__main__":
    main()
