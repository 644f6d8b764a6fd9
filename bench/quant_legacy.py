"""The previous 4-bit GEMV kernels (versions 1 and 2 of ops/triton_quant.py, as of commit b10aa50), kept
for bench/quant_gpu.py to measure beside the current kernel. Not used by the package.


Version 2 (the default) runs the factorised form (or, with `deq`, rounds w = q s + z to bf16 by
bf16x2 FMAs in the same PTX and multiplies that, needing no per-group epilogue and no sum(x)): per group, t = codes @ x^T on the tensor cores
(codes are exact in bf16, fp32 accumulation), then y += scale * t + zero * sum(x) in fp32. Codes
become bf16 by bit tricks on whole 32-bit words (inline PTX: one prmt, a shift and one lop3 per
pair of codes gives bf16 128 + q; the +128 comes back out through the zero term), groups are
unrolled GPS per loop step so several loads are in flight, sum(x) per group is precomputed once
per call (or summed in the kernel), and split-K partials are combined in a fixed order either
by a second launch or inside the kernel by the last CTA of each N tile to arrive (a counter per
tile, reset by that CTA). Version 1 (the first kernel, kept for the benchmark) is selected by
`Q4Config(version=1)`. Row invariance: a fixed 16-row tile, a config chosen from (N, K, G) only,
M never specialised, group sums and split partials reduced in a fixed order, so every M runs the
same machine code and a row's arithmetic never sees the other rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specfire.ops.triton_gemv import ROWS, _splitk_sum

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX in the interpreter


@dataclass(frozen=True)
class Q4Config:
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    gps: int = 1          # groups per K step (v2: unrolled, separate loads in flight)
    deq: bool = False     # dequantise the tile to the activation dtype (v2: bf16x2 FMAs in PTX)
    magic: bool = True    # codes to floats by bit tricks instead of int->float converts
    version: int = 2
    asm: bool = True      # v2: bf16 codes from 32-bit words by inline PTX (off in the interpreter)
    xsum: bool = True     # v2: sum(x) per group precomputed once per call (else in the kernel)
    sem: bool = True      # v2, split_k > 1: combine in the kernel (last CTA per tile) instead of a launch
    prefetch: bool = False  # v2: the next group's codes are loaded before this group's are used


def q4_config(n: int, k: int, group: int) -> Q4Config:
    """Launch configuration from the weight's shape only (never from M): the fastest row-invariant
    configuration per 27B shape in the sweep of bench/quant_gpu.py on the H200 (docs/BENCHMARKS.md).
    The kernel is bound by the loads one CTA keeps in flight, so wide-K shapes keep version 1 with
    split-K 8 (more CTAs), the rest take version 2 with factorised bit-trick codes."""
    if n >= 65536:      # lm_head: 55% (g128) at 32 rows a tile, one group a step, 4 stages
        if group >= 128:
            return Q4Config(block_n=32, num_warps=2, num_stages=4, gps=1)
        return Q4Config(block_n=64, num_warps=4, num_stages=3, gps=2)
    if k >= 12288:      # down projection (K = 17408): v1 split 8, 31.6% vs 18.4% for the best v2 tried
        return Q4Config(block_n=64, split_k=8, version=1)
    if n <= 12288:      # q / qkv / z (N = 6144..12288): split 2, combined in the kernel
        return Q4Config(block_n=32, split_k=2, num_warps=2, num_stages=3, gps=2)
    return Q4Config(block_n=32, num_warps=2, num_stages=3, gps=2)   # gate / up (N = 17408)


# inline PTX, 4 packed bytes in ($4) -> low nibbles as bf16 128+q ($0, $1) and high nibbles ($2, $3);
# element i of each output is byte i of the input, whatever the register layout
_ASM_Q4 = """{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
}"""


def asm_q4_emulate(word: int) -> tuple[list[int], list[int]]:
    """Python model of _ASM_Q4 on one 32-bit word -> (low-nibble bf16 bit patterns, high ones),
    element order 0..3; the CPU tests check it against the documented meaning."""
    def prmt(a, sel):
        src = [(a >> (8 * i)) & 255 for i in range(4)] + [0, 0, 0, 0]
        return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    def lop(t):
        return (t & 0x000F000F) | 0x43004300

    t0, t1 = prmt(word, 0x4140), prmt(word, 0x4342)
    regs = [lop(t0), lop(t1), lop(t0 >> 4), lop(t1 >> 4)]
    halves = [[r & 0xFFFF, r >> 16] for r in regs]
    return halves[0] + halves[1], halves[2] + halves[3]


_ASM_Q4_TL = tl.constexpr(_ASM_Q4)
# the dequantising form: as _ASM_Q4, then (128 + q) - 128 and q s + z by exactly rounded bf16x2 FMAs;
# in: $4 codes, $5 $6 scales, $7 $8 zeros (bf16 pairs of elements 0-1 and 2-3)
_ASM_Q4_DEQ_TL = tl.constexpr("""{
.reg .b32 t0, t1, u0, u1, u2, u3, one, off;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC300C300;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 u0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 u2, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u3, t1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 u0, u0, one, off;
fma.rn.bf16x2 u1, u1, one, off;
fma.rn.bf16x2 u2, u2, one, off;
fma.rn.bf16x2 u3, u3, one, off;
fma.rn.bf16x2 $0, u0, $5, $7;
fma.rn.bf16x2 $1, u1, $6, $8;
fma.rn.bf16x2 $2, u2, $5, $7;
fma.rn.bf16x2 $3, u3, $6, $8;
}""")

@triton.jit(do_not_specialize=["M"])
def _q4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_ym, groups_per_split,
                    BLOCK_N: tl.constexpr, G: tl.constexpr, GPS: tl.constexpr, DEQ: tl.constexpr,
                    MAGIC: tl.constexpr, ROWS_: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    # Kernel packing (ops/quant.py): in group g, byte j of a row holds codes g*G + j (low nibble)
    # and g*G + G/2 + j (high nibble); scales / zeros are [K/G, N].
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    HALF: tl.constexpr = G // 2
    TILE: tl.constexpr = GPS * HALF                                               # bytes per row per step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS_)
    offs_c = tl.arange(0, TILE)
    n_mask = offs_n < N
    m_mask = offs_m < M
    n_groups = K // G
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)                            # [BLOCK_N, ROWS]
    c_grp = offs_c // HALF                                                        # group within the step
    c_k = c_grp * G + offs_c % HALF                                               # k of the low nibble
    q_rows = q_ptr + offs_n[:, None] * (K // 2)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for g0 in range(g_lo, g_hi, GPS):
        c_ok = (g0 + c_grp) < g_hi                                                # [TILE]
        qb = tl.load(q_rows + g0 * HALF + offs_c[None, :], mask=n_mask[:, None] & c_ok[None, :], other=0)
        xm = m_mask[:, None] & c_ok[None, :]
        xe = tl.load(x_rows + g0 * G + c_k[None, :], mask=xm, other=0.0)          # [ROWS, TILE] low-nibble k
        xo = tl.load(x_rows + g0 * G + HALF + c_k[None, :], mask=xm, other=0.0)   # [ROWS, TILE] high-nibble k
        if DEQ:
            # scales / zeros of the GPS groups, broadcast over each group's G/2 columns
            gs = tl.arange(0, GPS)
            sg_ok = n_mask[:, None] & ((g0 + gs) < g_hi)[None, :]
            sg = tl.load(s_ptr + (g0 + gs)[None, :] * N + offs_n[:, None], mask=sg_ok, other=0.0)  # [BN, GPS]
            zg = tl.load(z_ptr + (g0 + gs)[None, :] * N + offs_n[:, None], mask=sg_ok, other=0.0)
            se = tl.reshape(tl.broadcast_to(sg.to(tl.float32)[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, TILE))
            ze = tl.reshape(tl.broadcast_to(zg.to(tl.float32)[:, :, None], (BLOCK_N, GPS, HALF)), (BLOCK_N, TILE))
            if MAGIC:  # float bits 0x4B000000 | q are 2^23 + q: one logic op and one add, no I2F
                cl = ((qb & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                ch = ((qb >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            else:
                cl = (qb & 15).to(tl.float32)
                ch = (qb >> 4).to(tl.float32)
            wl = (cl * se + ze).to(xe.dtype)
            wh = (ch * se + ze).to(xe.dtype)
            if IEEE:
                acc = tl.dot(wl, tl.trans(xe), acc, input_precision="ieee")
                acc = tl.dot(wh, tl.trans(xo), acc, input_precision="ieee")
            else:
                acc = tl.dot(wl, tl.trans(xe), acc)
                acc = tl.dot(wh, tl.trans(xo), acc)
        else:
            # codes are exact in the activation dtype: MMA on codes, then the affine map per group
            if MAGIC:  # bf16 bits 0x4300 | q are 128 + q: codes without int->float converts
                lo = ((qb & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
                hi = ((qb >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            else:
                lo = (qb & 15).to(xe.dtype)
                hi = (qb >> 4).to(xe.dtype)
            if IEEE:
                t = tl.dot(lo, tl.trans(xe), input_precision="ieee")
                t = tl.dot(hi, tl.trans(xo), t, input_precision="ieee")
            else:
                t = tl.dot(lo, tl.trans(xe))
                t = tl.dot(hi, tl.trans(xo), t)                                   # [BLOCK_N, ROWS]
            xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
            s = tl.load(s_ptr + g0 * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g0 * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if MAGIC:  # t holds sum (128 + q) x: take the 128 sum(x) back out through the zero term
                z = z - 128.0 * s
            acc += s[:, None] * t + z[:, None] * xs[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if not PARTIAL:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        base = y_ptr + pid_s * M * N
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _xsum_kernel(x_ptr, xs_ptr, K, stride_xm, G: tl.constexpr, GB: tl.constexpr):
    """xs[m, g] = sum of row m's inputs in group g, float32 (one program per row and GB groups)."""
    m = tl.program_id(0)
    n_groups = K // G
    offs_g = tl.program_id(1) * GB + tl.arange(0, GB)
    ok = offs_g < n_groups
    x = tl.load(x_ptr + m * stride_xm + offs_g[:, None] * G + tl.arange(0, G)[None, :], mask=ok[:, None], other=0.0)
    tl.store(xs_ptr + m * n_groups + offs_g, tl.sum(x.to(tl.float32), 1), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _q4v2_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, z_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_ym,
                 groups_per_split, BLOCK_N: tl.constexpr, G: tl.constexpr, GPS: tl.constexpr, ROWS_: tl.constexpr,
                 SPLIT: tl.constexpr, SEM: tl.constexpr, XSUM: tl.constexpr, DEQ: tl.constexpr, ASM: tl.constexpr,
                 MAGIC: tl.constexpr, BF16: tl.constexpr, IEEE: tl.constexpr, PF: tl.constexpr):
    # Kernel packing (ops/quant.py): in group g, byte j of a row holds codes g*G + j (low nibble)
    # and g*G + G/2 + j (high nibble); scales / zeros are [K/G, N].
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    HALF: tl.constexpr = G // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS_)
    offs_c = tl.arange(0, HALF)
    n_mask = offs_n < N
    m_mask = offs_m < M
    n_groups = K // G
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)                       # [BLOCK_N, ROWS]
    q_rows = q_ptr + offs_n[:, None] * (K // 2) + offs_c[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :]
    if PF:  # register double buffer: group g + 1's codes are in flight while group g is computed
        qn = tl.load(q_rows + g_lo * HALF, mask=n_mask[:, None] & ((g_lo + offs_c * 0) < g_hi)[None, :], other=0)
    for g0 in range(g_lo, g_hi, GPS):
        for gi in tl.static_range(GPS):
            g = g0 + gi
            okc = (g + offs_c * 0) < g_hi                                           # full-shape masks
            if PF:
                qb = qn
                qn = tl.load(q_rows + (g + 1) * HALF, mask=n_mask[:, None] & ((g + 1 + offs_c * 0) < g_hi)[None, :],
                             other=0)
            else:
                qb = tl.load(q_rows + g * HALF, mask=n_mask[:, None] & okc[None, :], other=0)
            xe = tl.load(x_rows + g * G, mask=m_mask[:, None] & okc[None, :], other=0.0)  # [ROWS, HALF]
            xo = tl.load(x_rows + g * G + HALF, mask=m_mask[:, None] & okc[None, :], other=0.0)
            okn = n_mask & ((g + offs_n * 0) < g_hi)
            sb = tl.load(s_ptr + g * N + offs_n, mask=okn, other=0.0)
            zb = tl.load(z_ptr + g * N + offs_n, mask=okn, other=0.0)
            if DEQ:
                # w = q s + z rounded once to the activation dtype, then MMA into the accumulator:
                # no per-group epilogue and no sum(x)
                if ASM:
                    wl, wh = tl.inline_asm_elementwise(
                        _ASM_Q4_DEQ_TL, "=r,=r,=r,=r,r,r,r,r,r",
                        [qb, tl.broadcast_to(sb[:, None], (BLOCK_N, HALF)), tl.broadcast_to(zb[:, None], (BLOCK_N, HALF))],
                        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
                else:
                    sf = sb.to(tl.float32)[:, None]
                    zf = zb.to(tl.float32)[:, None]
                    wl = ((qb & 15).to(tl.float32) * sf + zf).to(xe.dtype)
                    wh = ((qb >> 4).to(tl.float32) * sf + zf).to(xe.dtype)
                if IEEE:
                    acc = tl.dot(wl, tl.trans(xe), acc, input_precision="ieee")
                    acc = tl.dot(wh, tl.trans(xo), acc, input_precision="ieee")
                else:
                    acc = tl.dot(wl, tl.trans(xe), acc)
                    acc = tl.dot(wh, tl.trans(xo), acc)
            else:
                if ASM:
                    lo, hi = tl.inline_asm_elementwise(_ASM_Q4_TL, "=r,=r,=r,=r,r", [qb],
                                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
                elif MAGIC and BF16:  # bf16 bits 0x4300 | q are 128 + q
                    lo = ((qb & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
                    hi = ((qb >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
                elif MAGIC:           # float32 activations (the CPU tests): the same 128 + q values
                    lo = (qb & 15).to(tl.float32) + 128.0
                    hi = (qb >> 4).to(tl.float32) + 128.0
                else:
                    lo = (qb & 15).to(xe.dtype)
                    hi = (qb >> 4).to(xe.dtype)
                if IEEE:
                    t = tl.dot(lo, tl.trans(xe), input_precision="ieee")
                    t = tl.dot(hi, tl.trans(xo), t, input_precision="ieee")
                else:
                    t = tl.dot(lo, tl.trans(xe))
                    t = tl.dot(hi, tl.trans(xo), t)                                  # [BLOCK_N, ROWS]
                if XSUM:
                    xs = tl.load(xs_ptr + offs_m * n_groups + g, mask=m_mask & ((g + offs_m * 0) < g_hi), other=0.0)
                else:
                    xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
                s = sb.to(tl.float32)
                z = zb.to(tl.float32)
                if MAGIC:  # t holds sum (128 + q) x: take 128 s sum(x) back out through the zero term
                    z = z - 128.0 * s
                acc += s[:, None] * t + z[:, None] * xs[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        p_ptrs = part_ptr + offs_m[None, :] * N + offs_n[:, None]                  # partials [SPLIT, M, N]
        tl.store(p_ptrs + pid_s * M * N, acc, mask=out_mask)
        if SEM:
            # the last CTA of this N tile to arrive sums the partials in split order 0..SPLIT-1
            # (the arrival order never enters the arithmetic), then resets the counter
            tl.debug_barrier()
            cnt = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if cnt == SPLIT - 1:
                tot = tl.load(p_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                for sp in tl.static_range(1, SPLIT):
                    tot += tl.load(p_ptrs + sp * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")


_LOCKS: dict = {}


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Per-device split-K arrival counters (int32, zero between launches: the last CTA resets its
    own). Kernels on one stream run one after another, so one buffer serves every call."""
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


def q4_gemv(x: torch.Tensor, qw, cfg: Q4Config | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, already rotated if the weight is) @ dequant(qw)^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qw.shape[0]
    g = qw.group_size
    if m > ROWS:
        raise ValueError(f"q4_gemv serves at most {ROWS} rows, got M={m}")
    if qw.shape[1] != k:
        raise ValueError(f"q4_gemv: x has K={k} but the weight is {list(qw.shape)}")
    x = x.contiguous()
    cfg = cfg or q4_config(n, k, g)
    if cfg.version == 1:
        return _q4_gemv_v1(x, qw, cfg)
    n_groups = k // g
    per = triton.cdiv(triton.cdiv(n_groups, cfg.split_k), cfg.gps) * cfg.gps
    split = triton.cdiv(n_groups, per)
    bf16 = x.dtype == torch.bfloat16
    magic = cfg.magic and x.dtype in (torch.bfloat16, torch.float32)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    n_tiles = triton.cdiv(n, cfg.block_n)
    part = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    sem = cfg.sem and split > 1
    locks = _locks(x.device, n_tiles) if sem else y
    xs = y
    xsum = cfg.xsum and not cfg.deq  # the dequantising form needs no sum(x)
    if xsum:
        xs = torch.empty(m, n_groups, device=x.device, dtype=torch.float32)
        gb = 16
        _xsum_kernel[(m, triton.cdiv(n_groups, gb))](x, xs, k, x.stride(0), G=g, GB=gb)
    _q4v2_kernel[(n_tiles, split)](
        x, xs, qw.qweight, qw.scales_t, qw.zeros_t, y, part, locks, m, n, k, x.stride(0), y.stride(0), per,
        BLOCK_N=cfg.block_n, G=g, GPS=cfg.gps, ROWS_=ROWS, SPLIT=split, SEM=sem, XSUM=xsum, DEQ=cfg.deq,
        ASM=cfg.asm and bf16 and magic and not INTERPRET, MAGIC=magic, BF16=bf16, IEEE=x.dtype == torch.float32,
        PF=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not sem:
        blk = 1024
        _splitk_sum[(triton.cdiv(m * n, blk),)](part, y, m * n, SPLIT=split, BLOCK=blk)
    return y


def _q4_gemv_v1(x: torch.Tensor, qw, cfg: Q4Config) -> torch.Tensor:
    m, k = x.shape
    n = qw.shape[0]
    g = qw.group_size
    n_groups = k // g
    gps = cfg.gps if cfg.deq else 1  # the factorised form takes one group per step
    per = triton.cdiv(triton.cdiv(n_groups, cfg.split_k), gps) * gps
    split = triton.cdiv(n_groups, per)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    grid = (triton.cdiv(n, cfg.block_n), split)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _q4_gemv_kernel[grid](x, qw.qweight, qw.scales_t, qw.zeros_t, out, m, n, k, x.stride(0),
                          y.stride(0) if split == 1 else n, per,
                          BLOCK_N=cfg.block_n, G=g, GPS=gps, DEQ=cfg.deq,
                          MAGIC=cfg.magic and x.dtype == torch.bfloat16, ROWS_=ROWS, PARTIAL=split > 1,
                          IEEE=ieee,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        blk = 1024
        _splitk_sum[(triton.cdiv(m * n, blk),)](out, y, m * n, SPLIT=split, BLOCK=blk)
    return y
