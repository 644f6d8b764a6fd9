"""An experiment (issue 12): the 4-bit GEMV with explicit register layouts (Triton's Gluon dialect),
against the engine's Triton kernel, on the 27B launch shapes. Not on the engine's path.

    PYTHONPATH=$PWD python bench/q4_gluon.py --out $OUT          # GPU (Gluon has no CPU interpreter)

Why: the engine's kernel (kernels/q4/gemv.py) streams the codes through shared memory (cp.async,
then ldmatrix), and Triton brings each group's scales, zeros and sum(x) into the MMA's register
layout through shared memory too: an offline sm_90 compile of its loop shows 301 instructions and
4 barriers a warp per 64 x 128 group, of which 135 are the nibble conversion. bench/q4_floor.py
measured the kernel at 1.36-1.66x the time of a plain read of the same bytes on the big launches.
Here every tensor is loaded straight into the register layout its use needs, so nothing goes
through shared memory and the loop has no barrier: the codes in the MMA's A-operand layout with
8 consecutive k a thread (k_width 8: one 8-byte load gives 8 low and 8 high nibbles), x in the
B-operand layout (16-byte loads from L2), scales / zeros / sum(x) in the accumulator's slices;
the next group's loads are issued before this group's arithmetic (registers as the pipeline).
The arithmetic per output element is the engine kernel's: per group t = (128 + q) . x on the
tensor cores (fp32 accumulation), then acc += s t + (z - 128 s) sum(x) in fp32, split-K partials
added in split order by the last program of a tile. Within one MMA the k order differs from the
engine kernel's (k_width 8 against 2), so the bits may differ from it; each kernel is row-invariant
by itself (checked here bitwise, every prefix and every row of an 8-row call).

Per shape: max |gluon - engine| relative to max |engine|, row invariance, then t(M = 1, 4, 8) of
both (CUDA-graph replay over copies rotated past L2, as bench/q4_floor.py), one JSON line each.

Measured on one H200 (docs/BENCHMARKS.md, "Tenth wave"): it works (every output within one bf16
step of the engine kernel's, row-invariant on every shape and setting) and runs at the engine
kernel's speed, 0.94-1.12x its time on the big launches at M = 1 and the same on the small one;
two groups of loads in flight instead of one is 1.1-1.4x slower (168 registers: fewer warps). So
the shared-memory staging and the barriers are not what holds the engine kernel under a plain
read: both loops issue ~300 instructions a warp per 64 x 128 group, 128 of them the nibble
conversion, which no layout choice removes. Gluon kernels do not run in Triton's CPU interpreter,
so this kernel has no CPU test: one more reason it stays a bench experiment.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from linear import PEAK, graph_time, rotated_q4  # noqa: E402
from q4_floor import SHAPES, gsums, row_invariant  # noqa: E402
from tp import Log  # noqa: E402

from specfire.kernels.q4.gemv import _ASM_Q4, _locks, q4_config, q4_group  # noqa: E402

G = 128
ASM = gl.constexpr(_ASM_Q4)
# one code word (bytes b0..b3) -> bf16 128 + low nibble of b0..b3 ($0..$3), of the high nibbles ($4..$7)
ASM_W = gl.constexpr("""{
.reg .b32 t0, t1, u0, u1, v0, v1;
prmt.b32 t0, $8, 0, 0x4140;
prmt.b32 t1, $8, 0, 0x4342;
lop3.b32 u0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 v0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 v1, t1, 0x000F000F, 0x43004300, 0xEA;
mov.b32 {$0, $1}, u0;
mov.b32 {$2, $3}, u1;
mov.b32 {$4, $5}, v0;
mov.b32 {$6, $7}, v1;
}""")

# diagnostic only (wrong outputs): the code word's halves passed on as they are, no conversion; the
# loop then issues everything but the nibble conversion, to price it (--diag)
ASM_RAW = gl.constexpr("""{
mov.b32 {$0, $1}, $8;
mov.b32 {$2, $3}, $8;
mov.b32 {$4, $5}, $8;
mov.b32 {$6, $7}, $8;
}""")


@gluon.jit
def _words_to_k(o0, o1, o2, o3):
    """Four [R, C] tensors (element i of each word) -> [R, 4C], k = 4 c + i."""
    a = gl.join(o0, o2)
    b = gl.join(o1, o3)
    j = gl.join(a, b)
    return gl.reshape(j, [j.shape[0], j.shape[1] * 4])


@gluon.jit
def _loads(q_ptr, x_ptr, s_ptr, z_ptr, xs_ptr, q_off, q_msk, x_off, x_msk, rn_c, n_ok, rm_c, m_ok, g, N, n_groups,
           G: gl.constexpr, TILE: gl.constexpr, EVEN_N: gl.constexpr, SZ: gl.constexpr = 0):
    """Group g's codes (words), x halves, scales, zeros and sum(x), each in its use's layout.
    SZ (diagnostics, wrong outputs): 1 the scales / zeros / sum(x) of group 0 for every group (their
    loads hit L2 after the first), 2 those of group 0 and x of group 0 too."""
    HALF: gl.constexpr = G // 2
    gq = g
    if SZ > 0:
        g = g * 0
    gx = g if SZ == 2 else gq
    if EVEN_N:
        qb = gl.load(q_ptr + q_off + gq * (TILE * HALF // 4))
    else:
        qb = gl.load(q_ptr + q_off + gq * (TILE * HALF // 4), mask=q_msk, other=0)
    xe = gl.load(x_ptr + x_off + gx * G, mask=x_msk, other=0.0)
    xo = gl.load(x_ptr + x_off + gx * G + HALF, mask=x_msk, other=0.0)
    s = gl.load(s_ptr + g * N + rn_c, mask=n_ok, other=0.0)
    z = gl.load(z_ptr + g * N + rn_c, mask=n_ok, other=0.0)
    xs = gl.load(xs_ptr + rm_c * n_groups + g, mask=m_ok, other=0.0)
    return qb, xe, xo, s, z, xs


@gluon.jit
def _q4_gl_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, z_ptr, y_ptr, part_ptr, lock_ptr, M, N, KH, stride_xm,
                  n_groups, per, split, BLOCK_N: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr,
                  W: gl.constexpr, KW: gl.constexpr, EVEN_N: gl.constexpr,
                  DEPTH: gl.constexpr = 1, RAW: gl.constexpr = False, SZ: gl.constexpr = 0):
    HALF: gl.constexpr = G // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    # codes [BLOCK_N, HALF] of one group in the A operand's layout (tiles of TILE rows: a group of
    # a tile is TILE * HALF contiguous bytes)
    # the codes as int32 words [BLOCK_N, HALF / 4], in the layout that four word-element tensors
    # joined back along k give la: derived from an index tensor in la split the other way
    rn_a = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la))
    rc_a = gl.arange(0, HALF, layout=gl.SliceLayout(0, la))
    byte_off = gl.expand_dims((rn_a // TILE) * (KH * TILE) + (rn_a % TILE) * HALF, 1) + gl.expand_dims(rc_a, 0)
    row_ok = gl.expand_dims(rn_a < N, 1) & gl.expand_dims(rc_a >= 0, 0)
    w4 = gl.reshape(byte_off, [BLOCK_N, HALF // 4, 2, 2])
    w2, _u = gl.split(w4)
    q_off, _v = gl.split(w2)
    q_off = q_off // 4                                                        # word index of bytes 4c..4c+3
    if KW == 8:     # a thread's 8 consecutive k are bytes 8j..8j+7: two consecutive words, 8-byte aligned
        q_off = gl.max_contiguous(gl.multiple_of(q_off, [1, 2]), [1, 2])
    m4 = gl.reshape(row_ok, [BLOCK_N, HALF // 4, 2, 2])
    m2, _mu = gl.split(m4)
    q_msk, _mv = gl.split(m2)
    # x^T [HALF, 8] of one half group in the B operand's layout: element (c, m) is x[m, c]
    rc_b = gl.arange(0, HALF, layout=gl.SliceLayout(1, lb))
    rm_b = gl.arange(0, 8, layout=gl.SliceLayout(0, lb))
    x_off = gl.expand_dims(rm_b, 0) * stride_xm + gl.expand_dims(rc_b, 1)
    x_msk = gl.expand_dims(rm_b < M, 0) & gl.expand_dims(rc_b >= 0, 1)
    # the accumulator's rows (code rows) and columns (x rows)
    rn_c = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    rm_c = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    n_ok = rn_c < N
    m_ok = rm_c < M
    g_lo = pid_s * per
    g_hi = gl.minimum(g_lo + per, n_groups)
    acc = gl.zeros([BLOCK_N, 8], gl.float32, layout=mma)
    # group g_lo's loads (and g_lo + 1's with DEPTH 2), then in each step the loads DEPTH groups
    # ahead before this group's arithmetic; past the split's last group the last one again (unused)
    qb, xe, xo, s, z, xs = _loads(q_ptr, x_ptr, s_ptr, z_ptr, xs_ptr, q_off, q_msk, x_off, x_msk, rn_c, n_ok, rm_c,
                                  m_ok, g_lo, N, n_groups, G, TILE, EVEN_N, SZ)
    if DEPTH == 2:
        qb2, xe2, xo2, s2, z2, xs2 = _loads(q_ptr, x_ptr, s_ptr, z_ptr, xs_ptr, q_off, q_msk, x_off, x_msk, rn_c, n_ok,
                                            rm_c, m_ok, gl.minimum(g_lo + 1, g_hi - 1), N, n_groups, G, TILE, EVEN_N, SZ)
    for g in range(g_lo, g_hi):
        gn = gl.minimum(g + DEPTH, g_hi - 1)
        qb1, xe1, xo1, s1, z1, xs1 = _loads(q_ptr, x_ptr, s_ptr, z_ptr, xs_ptr, q_off, q_msk, x_off, x_msk, rn_c, n_ok,
                                            rm_c, m_ok, gn, N, n_groups, G, TILE, EVEN_N, SZ)
        if RAW:
            l0, l1, l2, l3, h0, h1, h2, h3 = gl.inline_asm_elementwise(
                ASM_RAW, "=h,=h,=h,=h,=h,=h,=h,=h,r", [qb], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            l0, l1, l2, l3, h0, h1, h2, h3 = gl.inline_asm_elementwise(
                ASM_W, "=h,=h,=h,=h,=h,=h,=h,=h,r", [qb], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        lo = gl.convert_layout(_words_to_k(l0, l1, l2, l3), la, assert_trivial=True)
        hi = gl.convert_layout(_words_to_k(h0, h1, h2, h3), la, assert_trivial=True)
        t = mma_v2(lo, xe, gl.zeros([BLOCK_N, 8], gl.float32, layout=mma))
        t = mma_v2(hi, xo, t)
        sf = s.to(gl.float32)
        zf = z.to(gl.float32) - 128.0 * sf
        acc = gl.fma(t, gl.expand_dims(sf, 1), acc)
        acc = gl.fma(gl.expand_dims(zf, 1), gl.expand_dims(xs, 0), acc)
        if DEPTH == 2:
            qb, xe, xo, s, z, xs = qb2, xe2, xo2, s2, z2, xs2
            qb2, xe2, xo2, s2, z2, xs2 = qb1, xe1, xo1, s1, z1, xs1
        else:
            qb, xe, xo, s, z, xs = qb1, xe1, xo1, s1, z1, xs1
    out_off = gl.expand_dims(rm_c, 0) * N + gl.expand_dims(rn_c, 1)          # y [M, N]: element (n, m)
    out_msk = gl.expand_dims(n_ok, 1) & gl.expand_dims(m_ok, 0)
    if split == 1:
        gl.store(y_ptr + out_off, acc.to(gl.bfloat16), mask=out_msk)
    else:
        gl.store(part_ptr + pid_s * M * N + out_off, acc, mask=out_msk)
        gl.thread_barrier()
        cnt = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if cnt == split - 1:
            tot = gl.load(part_ptr + out_off, mask=out_msk, other=0.0, cache_modifier=".cg")
            for sp in range(1, split):
                tot += gl.load(part_ptr + sp * M * N + out_off, mask=out_msk, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + out_off, tot.to(gl.bfloat16), mask=out_msk)
            gl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def q4_gluon(x: torch.Tensor, qw, xs: torch.Tensor, block_n: int = 64, split_k: int = 1, warps: int = 2,
             kw: int = 8, depth: int = 1, raw: bool = False, sz: int = 0) -> torch.Tensor:
    """x [M <= 8, K] bf16 @ dequant(qw)^T -> [M, N] bf16; xs: x's group sums float32 [M, K / G]."""
    m, k = x.shape
    n = qw.shape[0]
    n_groups = k // G
    per = triton.cdiv(n_groups, split_k)
    split = triton.cdiv(n_groups, per)
    y = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    part = torch.empty(split * m * n, device=x.device, dtype=torch.float32) if split > 1 else y
    tiles = triton.cdiv(n, block_n)
    locks = _locks(x.device, tiles)
    _q4_gl_kernel[(tiles, split)](x, xs, qw.qtiled.view(torch.int32), qw.scales_t, qw.zeros_t, y, part, locks, m, n, k // 2,
                                  x.stride(0), n_groups, per, split, BLOCK_N=block_n, G=G, TILE=qw.tile,
                                  W=warps, KW=kw, EVEN_N=n % block_n == 0, DEPTH=depth, RAW=raw, SZ=sz, num_warps=warps)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--configs", default="64,2,1,1;64,2,2,1;64,4,1,1;32,1,1,1;128,4,1,1;64,2,1,2",
                    help="block_n,warps,factor on q4_config's split-K,prefetch depth (groups) ; ...")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--diag", action="store_true", help="also time the loop without the nibble conversion")
    args = ap.parse_args()
    t0 = time.monotonic()
    log = Log(args.out, name="q4_gluon.jsonl")
    log("start", commit=args.commit, torch=torch.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name())
    cfgs = [tuple(float(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    for n, k, label in SHAPES:
        if time.monotonic() > t0 + args.budget_s:
            log("skipped", shape=[n, k], why="budget")
            continue
        qws = rotated_q4(n, k, G, "cuda")
        qw0, nbytes = qws[0], qws[0].nbytes()
        x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        base = q4_config(n, k, G)
        ref = q4_group(x8, [qw0], base, gsums(x8))[0]
        rec = {"shape": [n, k], "name": label, "mb": round(nbytes / 1e6, 1), "engine": str(base), "t_us": {}}
        for m in (1, 4, 8):
            xm = x8[:m].contiguous()
            sm = gsums(xm)
            rec["t_us"][f"engine_m{m}"] = round(graph_time([lambda w=w: q4_group(xm, [w], base, sm) for w in qws]) * 1e6, 2)
        rec["gluon"] = {}
        for c in cfgs:
            bn, nw, fsk = int(c[0]), int(c[1]), c[2]
            dp = int(c[3]) if len(c) > 3 else 1
            sk = max(1, round(base.split_k * fsk)) if base.split_k > 1 else 1
            key = f"bn{bn} w{nw} split{sk} depth{dp}"
            try:
                got = q4_gluon(x8, qw0, gsums(x8), bn, sk, nw, 8, dp)
                err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                inv = row_invariant(lambda xx: q4_gluon(xx, qw0, gsums(xx), bn, sk, nw, 8, dp), x8)
                r = {"rel_err_vs_engine": err, "bits_equal_engine": torch.equal(got, ref), "row_invariant": inv}
                for m in (1, 4, 8):
                    xm = x8[:m].contiguous()
                    sm = gsums(xm)
                    t = graph_time([lambda w=w: q4_gluon(xm, w, sm, bn, sk, nw, 8, dp) for w in qws]) * 1e6
                    r[f"m{m}_us"] = round(t, 2)
                    r[f"m{m}_frac"] = round(nbytes / (t * 1e-6) / PEAK, 4)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or launch
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rec["gluon"][key] = r
        if args.diag:       # the nibble conversion left out (outputs wrong): what the rest of the loop costs
            bn, nw = 64, 2
            sk = base.split_k
            xm, sm = x8[:1].contiguous(), gsums(x8[:1])
            for name, raw, sz in (("no_conversion", True, 0), ("group0_terms", False, 1),
                                  ("group0_terms_and_x", False, 2), ("no_conversion_group0_terms", True, 1)):
                t = graph_time([lambda w=w: q4_gluon(xm, w, sm, bn, sk, nw, 8, 1, raw, sz) for w in qws]) * 1e6
                rec[f"{name}_m1"] = {"cfg": f"bn{bn} w{nw} split{sk}", "us": round(t, 2),
                                     "frac": round(nbytes / (t * 1e-6) / PEAK, 4)}
        rec["engine_m1_frac"] = round(nbytes / (rec["t_us"]["engine_m1"] * 1e-6) / PEAK, 4)
        log("shape", **rec)
        qws = qw0 = None
        torch.cuda.empty_cache()
    log("done", seconds=round(time.monotonic() - t0, 1))


if __name__ == "__main__":
    main()
