"""Row-invariant dequant-GEMV of the 4-bit format on CUDA: per group t = x @ (128 + q)^T on the tensor
cores, y += s t + (z - 128 s) sum(x); settings from (N, K, G) only (config.py), M never specialised,
every sum in a fixed order (split-K partials added in split order by the tile's last CTA)."""
from __future__ import annotations

from .._triton import triton, tl
from ..pdl import wait as pdl_wait

# added to a grouped launch's offsets between weights, so they are always passed as 64-bit
# integers (Triton types an int argument by its value: one kernel for any allocation distance)
_BIAS = 1 << 40
BIAS = tl.constexpr(_BIAS)


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
_ASM_Q4_TL = tl.constexpr(_ASM_Q4)


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


@triton.jit
def _codes(qb, dtype: tl.constexpr, ASM: tl.constexpr):
    """Packed bytes -> (128 + low nibble, 128 + high nibble) in `dtype` (exact)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_ASM_Q4_TL, "=r,=r,=r,=r,r", [qb], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        lo = ((qb & 15).to(tl.float32) + 128.0).to(dtype)
        hi = ((qb >> 4).to(tl.float32) + 128.0).to(dtype)
    return lo, hi


@triton.jit
def _mmt(a, bt, acc, IEEE: tl.constexpr):
    """acc + a @ bt^T. Float32 (the CPU tests, in the interpreter) takes an explicit product-sum:
    the interpreter's matmul rounds a row differently at different row positions, the tensor-core
    MMA does not (checked bit for bit on the GPU)."""
    if IEEE:
        return acc + tl.sum(a[:, None, :] * bt[None, :, :], axis=2)
    return tl.dot(a, tl.trans(bt), acc)


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (weights as the MMA's A operand); float32 as in _mmt."""
    if IEEE:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    return tl.dot(a, b, acc)


@triton.jit
def _group_terms(s_ptr, z_ptr, xs_ptr, g, g_hi, N, n_groups, offs_n, n_mask, offs_m, m_mask, ZC: tl.constexpr):
    """Scale and zero of group g for the tile's columns and sum(x) of group g per row; zeros past
    the split's last group (these are the prefetches one group ahead). ZC > 0: the scale only."""
    ok = (g + offs_n * 0) < g_hi
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask & ok, other=0.0)
    if ZC > 0:      # one return below: Triton types every return statement of a function alike
        z = s
        xs = offs_m * 0.0
    else:
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask & ok, other=0.0)
        xs = tl.load(xs_ptr + offs_m * n_groups + g, mask=m_mask & ((g + offs_m * 0) < g_hi), other=0.0)
    return s, z, xs


@triton.jit
def _zc_scales(s_ptr, z_ptr, c0, g_hi, N, offs_n, n_mask, ZC: tl.constexpr):
    """(z - 128 s) of groups c0 .. c0 + ZC - 1 (zeros past g_hi) for the tile's columns, float32
    [BLOCK_N, ZC]: the zero-point term's weights."""
    gc = c0 + tl.arange(0, ZC)
    sz_off = gc[None, :] * N + offs_n[:, None]
    sz_mask = n_mask[:, None] & (gc < g_hi)[None, :]
    s2 = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
    return tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32) - 128.0 * s2


@triton.jit
def _zc_chunk(acc, zp, x_ptr, stride_xm, c0, g_hi, M, row0, ZC: tl.constexpr, G: tl.constexpr, ROWS_: tl.constexpr,
              WA: tl.constexpr, IEEE: tl.constexpr):
    """acc + (z - 128 s) sum(x) over groups c0 .. c0 + ZC - 1. sum(x) of each real row of the tile
    is made here from x, one row at a time with the same [ZC, G] code whatever the row or the row
    tile (a loop over the real rows: unrolled over the tile, the offline sm_90 compile staged the
    rows through 78 KB of shared memory)."""
    gc = c0 + tl.arange(0, ZC)
    gm = gc < g_hi
    offs_r = tl.arange(0, ROWS_)
    xs2 = tl.zeros((ROWS_, ZC), dtype=tl.float32)                                       # [ROWS, ZC]
    for r in range(0, tl.minimum(M - row0, ROWS_)):
        xr = tl.load(x_ptr + (row0 + r) * stride_xm + gc[:, None] * G + tl.arange(0, G)[None, :],
                     mask=gm[:, None], other=0.0)                                        # [ZC, G]
        xs2 = tl.where(offs_r[:, None] == r, tl.sum(xr.to(tl.float32), axis=1)[None, :], xs2)
    if IEEE:     # the interpreter (float32 tests): an explicit product-sum, as in _mm
        if WA:
            acc += tl.sum(zp[:, :, None] * tl.trans(xs2)[None, :, :], axis=1)
        else:
            acc += tl.sum(xs2[:, :, None] * tl.trans(zp)[None, :, :], axis=1)
    elif WA:     # float32 FMA dot: each output element summed by one thread, in order
        acc = tl.dot(zp, tl.trans(xs2), acc, input_precision="ieee")
    else:
        acc = tl.dot(xs2, tl.trans(zp), acc, input_precision="ieee")
    return acc


@triton.jit
def _zero_terms(acc, zp0, x_ptr, stride_xm, s_ptr, z_ptr, g_lo, g_hi, N, offs_n, n_mask, M, row0,
                ZC: tl.constexpr, G: tl.constexpr, ROWS_: tl.constexpr, WA: tl.constexpr, IEEE: tl.constexpr):
    """acc + sum over the split's groups of (z - 128 s) sum(x), ZC groups at a time in group order;
    the first chunk's (z - 128 s) is zp0, loaded before the main loop (its latency hidden behind
    it; a split of at most ZC groups loads nothing else here). Each output element sums its own
    products: row-invariant."""
    acc = _zc_chunk(acc, zp0, x_ptr, stride_xm, g_lo, g_hi, M, row0, ZC, G, ROWS_, WA, IEEE)
    for c0 in range(g_lo + ZC, g_hi, ZC):
        zp = _zc_scales(s_ptr, z_ptr, c0, g_hi, N, offs_n, n_mask, ZC)
        acc = _zc_chunk(acc, zp, x_ptr, stride_xm, c0, g_hi, M, row0, ZC, G, ROWS_, WA, IEEE)
    return acc


# one 128-byte L2 line made dead (no write-back); $2 = 0: nothing (masked)
_ASM_DISCARD = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $2, 0;
@p discard.global.L2 [$1], 128;
mov.b32 $0, 0;
}""")


@triton.jit
def _discard_partials(part_ptr, offs_m, m_mask, n0, N, M, split, BLOCK_N: tl.constexpr):
    """Drop the L2 lines of this tile's split partials (rows offs_m < M, columns n0 .. n0 + BLOCK_N,
    every split) once they are read: each line holds 32 float32 of one row of one tile (the host
    asks for this only when N, BLOCK_N and the buffer keep whole lines inside a tile)."""
    offs_l = n0 + tl.arange(0, BLOCK_N // 32) * 32
    ok = (m_mask[:, None] & (offs_l < N)[None, :]).to(tl.int32)
    base = part_ptr + offs_m[:, None] * N + offs_l[None, :]
    for sp in range(0, split):
        tl.inline_asm_elementwise(_ASM_DISCARD, "=r,l,r", [(base + sp * M * N).to(tl.int64), ok], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "n_groups", "groups_per_split", "split"])
def _q4_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, z_ptr, y_ptr, part_ptr, lock_ptr, M, N0, KH, stride_xm,
               n_groups, groups_per_split, split, N1, N2, N3, T1, T2, T3, DQ1, DQ2, DQ3, DS1, DS2, DS3,
               DZ1, DZ2, DZ3, O1, O2, O3, SEGS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
               ROWS_: tl.constexpr, TILE: tl.constexpr, ASM: tl.constexpr,
               IEEE: tl.constexpr, WA: tl.constexpr = False, ZC: tl.constexpr = 0, PDL: tl.constexpr = False,
               DISCARD: tl.constexpr = False):
    # Kernel packing (kernels/q4): in group g, byte j of a row holds codes g*G + j (low nibble)
    # and g*G + G/2 + j (high nibble), rows stored in tiles [N/TILE, K/G, TILE, G/2] (TILE = 0: rows
    # [N, K/2]); scales / zeros are [K/G, N]; KH = K / 2 bytes per row.
    # Up to 4 weights of one input in one launch (SEGS): column tiles [0, T1) are weight 0's,
    # [T1, T2) weight 1's, ...; weight s has Ns rows, its codes / scales / zeros at DQs / DSs / DZs
    # elements past weight 0's, its output [M, Ns] at y + M * Os and its split partials at
    # part + split * M * Os. A tile runs the loop a launch of its weight alone would run. The Ds
    # come with BIAS added (always 64-bit: one compiled kernel whatever the allocations' distance).
    # Rows run in tiles of ROWS_ over grid axis 2, every tile the same code (row-invariant).
    # PDL (kernels/pdl.py): launched while the kernel before it runs; it reads and writes only after
    # its wait. Split-K: the last CTA of a tile to arrive sums the partials (DISCARD: then drops
    # their L2 lines, which need no write-back).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    HALF: tl.constexpr = G // 2
    N = N0
    t0 = 0
    if SEGS > 1:   # which weight this column tile belongs to (one weight: nothing moves)
        sel = pid_n >= T1
        N, t0, o = tl.where(sel, N1, N), tl.where(sel, T1, t0), tl.where(sel, O1, 0)
        dq, ds, dz = tl.where(sel, DQ1, BIAS), tl.where(sel, DS1, BIAS), tl.where(sel, DZ1, BIAS)
        if SEGS > 2:
            sel = pid_n >= T2
            N, t0, o = tl.where(sel, N2, N), tl.where(sel, T2, t0), tl.where(sel, O2, o)
            dq, ds, dz = tl.where(sel, DQ2, dq), tl.where(sel, DS2, ds), tl.where(sel, DZ2, dz)
        if SEGS > 3:
            sel = pid_n >= T3
            N, t0, o = tl.where(sel, N3, N), tl.where(sel, T3, t0), tl.where(sel, O3, o)
            dq, ds, dz = tl.where(sel, DQ3, dq), tl.where(sel, DS3, ds), tl.where(sel, DZ3, dz)
        # the offsets between the weights' tensors are multiples of 16 bytes (_groupable): said so,
        # the codes keep their 16-byte cp.async loads (without it an offline sm_90 compile loaded
        # them byte by byte, and a grouped launch ran slower than one weight of its size)
        q_ptr += tl.multiple_of(dq - BIAS, 16)
        s_ptr += tl.multiple_of(ds - BIAS, 8)
        z_ptr += tl.multiple_of(dz - BIAS, 8)
        y_ptr += tl.multiple_of(M * o, 64)             # Os are multiples of OUT_ALIGN
        part_ptr += tl.multiple_of(split * M * o, 64)
    offs_n = (pid_n - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_r * ROWS_ + tl.arange(0, ROWS_)
    offs_c = tl.arange(0, HALF)
    n_mask = offs_n < N
    m_mask = offs_m < M
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    if WA:
        acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)                  # [BLOCK_N, ROWS] = W x^T tile
    else:
        acc = tl.zeros((ROWS_, BLOCK_N), dtype=tl.float32)                  # [ROWS, BLOCK_N] = x W^T tile
    if TILE == 0:
        q_rows = q_ptr + offs_n[:, None] * KH + offs_c[None, :]
        q_step = HALF                                                        # bytes from one group to the next
    else:
        q_rows = q_ptr + ((offs_n // TILE) * (KH * TILE) + (offs_n % TILE) * HALF)[:, None] + offs_c[None, :]
        q_step = TILE * HALF
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :]
    pdl_wait(PDL)
    s0, z0, xs0 = _group_terms(s_ptr, z_ptr, xs_ptr, g_lo, g_hi, N, n_groups, offs_n, n_mask, offs_m, m_mask, ZC)
    if ZC > 0:      # the zero term's first chunk of scales / zeros: loaded now, used after the loop
        zp0 = _zc_scales(s_ptr, z_ptr, g_lo, g_hi, N, offs_n, n_mask, ZC)
    for g in range(g_lo, g_hi):
        s1, z1, xs1 = _group_terms(s_ptr, z_ptr, xs_ptr, g + 1, g_hi, N, n_groups, offs_n, n_mask, offs_m, m_mask, ZC)
        qb = tl.load(q_rows + g * q_step, mask=n_mask[:, None], other=0)              # [BLOCK_N, HALF] bytes
        xe = tl.load(x_rows + g * G, mask=m_mask[:, None], other=0.0)                # [ROWS, HALF] low-nibble k
        xo = tl.load(x_rows + g * G + HALF, mask=m_mask[:, None], other=0.0)         # [ROWS, HALF] high-nibble k
        if IEEE:
            xe = xe.to(tl.float32)
            xo = xo.to(tl.float32)
        lo, hi = _codes(qb, xe.dtype, ASM)
        s = s0.to(tl.float32)
        z = z0.to(tl.float32) - 128.0 * s      # t holds sum (128 + q) x: 128 s sum(x) comes out here
        if WA:
            t = _mm(hi, tl.trans(xo), _mm(lo, tl.trans(xe), tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32), IEEE), IEEE)
            acc = tl.fma(t, s[:, None], acc)
            if ZC == 0:
                acc = tl.fma(z[:, None], xs0[None, :], acc)
        else:
            t = _mmt(xo, hi, _mmt(xe, lo, tl.zeros((ROWS_, BLOCK_N), dtype=tl.float32), IEEE), IEEE)
            acc = tl.fma(t, s[None, :], acc)
            if ZC == 0:
                acc = tl.fma(xs0[:, None], z[None, :], acc)
        s0, z0, xs0 = s1, z1, xs1
    if ZC > 0:
        acc = _zero_terms(acc, zp0, x_ptr, stride_xm, s_ptr, z_ptr, g_lo, g_hi, N, offs_n, n_mask, M, pid_r * ROWS_,
                          ZC, G, ROWS_, WA, IEEE)
    if WA:
        acc = tl.trans(acc)
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    if split == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        p_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]                   # partials [split, M, N]
        tl.store(p_ptrs + pid_s * M * N, acc, mask=out_mask)
        # the last CTA of this N tile to arrive sums the partials in split order 0..split-1, four
        # loads in flight at a time (the arrival order never enters the arithmetic), then resets the counter
        tl.debug_barrier()
        lock_ptr += pid_r * tl.num_programs(0) + pid_n        # a counter per (row tile, column tile)
        cnt = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
        if cnt == split - 1:
            tot = tl.load(p_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for sp in range(1, split, 4):
                ok2 = (offs_m[:, None] * 0 + sp + 1) < split         # [ROWS, 1]: the split exists
                ok3 = (offs_m[:, None] * 0 + sp + 2) < split
                ok4 = (offs_m[:, None] * 0 + sp + 3) < split
                v1 = tl.load(p_ptrs + sp * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                v2 = tl.load(p_ptrs + (sp + 1) * M * N, mask=out_mask & ok2, other=0.0, cache_modifier=".cg")
                v3 = tl.load(p_ptrs + (sp + 2) * M * N, mask=out_mask & ok3, other=0.0, cache_modifier=".cg")
                v4 = tl.load(p_ptrs + (sp + 3) * M * N, mask=out_mask & ok4, other=0.0, cache_modifier=".cg")
                tot += v1
                tot = tl.where(ok2, tot + v2, tot)       # past the last split: tot as it was
                tot = tl.where(ok3, tot + v3, tot)
                tot = tl.where(ok4, tot + v4, tot)
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
            if DISCARD:     # every thread's loads of the partials are done (their sums stored)
                tl.debug_barrier()
                _discard_partials(part_ptr, offs_m, m_mask, (pid_n - t0) * BLOCK_N, N, M, split, BLOCK_N)
            tl.atomic_xchg(lock_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _xsum_kernel(x_ptr, xs_ptr, K, stride_xm, G: tl.constexpr, GB: tl.constexpr, PDL: tl.constexpr = False):
    """xs[m, g] = sum of row m's inputs in group g, float32 (one program per row and GB groups)."""
    pdl_wait(PDL)
    m = tl.program_id(0)
    n_groups = K // G
    offs_g = tl.program_id(1) * GB + tl.arange(0, GB)
    ok = offs_g < n_groups
    x = tl.load(x_ptr + m * stride_xm + offs_g[:, None] * G + tl.arange(0, G)[None, :], mask=ok[:, None], other=0.0)
    tl.store(xs_ptr + m * n_groups + offs_g, tl.sum(x.to(tl.float32), 1), mask=ok)
