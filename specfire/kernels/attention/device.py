"""Triton device functions the attention kernels share (the rows kernels in kernel.py, fused.py): the
online-softmax step, a sequence's rows and cache in a multi-sequence launch, paged rows, Q8 codes."""
from __future__ import annotations

from .._triton import triton, tl

from .paged import BLOCK as PAGE

PAGE_TL = tl.constexpr(PAGE)     # (a compiled kernel reads only constexpr globals)


@triton.jit
def _online_softmax_step(q, k, v, offs_n, pos, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """Fold one key block into (m, l, acc). Keys past a row's position get p = 0 exactly and leave
    its running max unchanged, so extra masked blocks never alter a row's result."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale          # [BLOCK_M, BLOCK_N], log2 units
    s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _seq(seq_ptr, spos_ptr, s):
    """Sequence s of a launch over several (multi.py): its first row, row count, first position."""
    return (tl.load(seq_ptr + 2 * s).to(tl.int32), tl.load(seq_ptr + 2 * s + 1).to(tl.int32),
            tl.load(spos_ptr + s).to(tl.int32))


@triton.jit
def _table_ptr(tab_ptr, s, j, like, ALIGN: tl.constexpr):
    """Address j (k, v, k_scale, v_scale, block table) of sequence s's cache in the int64 table
    [n, 5], typed as `like`; ALIGN: all 16-byte aligned (what a tensor argument's specialization
    would tell)."""
    p = tl.load(tab_ptr + 5 * s + j).to(like.dtype)
    if ALIGN:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _page_rows(blk_ptr, n0, offs_n, hi, PAGED: tl.constexpr):
    """Cache rows of the keys offs_n of the tile starting at n0 (inside one block: tiles divide the
    block): the pool rows of the block the sequence's table names, or the positions themselves."""
    rows = offs_n
    if PAGED:
        j = n0 // PAGE_TL
        b = tl.load(blk_ptr + j, mask=n0 < hi, other=0).to(tl.int64)
        rows = b * PAGE_TL + (offs_n - j * PAGE_TL)
    return rows


@triton.jit
def _page_row(blk_ptr, p, PAGED: tl.constexpr):
    """Cache row of position p (int64)."""
    row = p
    if PAGED:
        row = tl.load(blk_ptr + p // PAGE_TL).to(tl.int64) * PAGE_TL + p % PAGE_TL
    return row


@triton.jit
def _seq_split(seq_ptr, spos_ptr, tab_ptr, pid, n_kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr, SCALES: tl.constexpr,
               ALIGN: tl.constexpr, PAGED: tl.constexpr):
    """A split program of a launch over several sequences, whose axis 2 `pid` is (sequence, KV
    head): (KV head, first row, row count, position, its cache's k, v, k_scale, v_scale, blocks)."""
    s = pid // n_kvh
    row0, n_rows, pos0 = _seq(seq_ptr, spos_ptr, s)
    k_ptr = _table_ptr(tab_ptr, s, 0, k_ptr, ALIGN)
    v_ptr = _table_ptr(tab_ptr, s, 1, v_ptr, ALIGN)
    if SCALES:
        ks_ptr = _table_ptr(tab_ptr, s, 2, ks_ptr, ALIGN)
        vs_ptr = _table_ptr(tab_ptr, s, 3, vs_ptr, ALIGN)
    if PAGED:
        blk_ptr = _table_ptr(tab_ptr, s, 4, blk_ptr, False)
    return pid % n_kvh, row0, n_rows, pos0, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr


@triton.jit
def _dequant(xq, sc, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr, dtype: tl.constexpr):
    """int8 [BLOCK_N, D] x fp16 scales [BLOCK_N, D/G]: exact in float32, one rounding to `dtype`."""
    x = tl.reshape(xq.to(tl.float32), (BLOCK_N, D // G, G)) * sc.to(tl.float32)[:, :, None]
    return tl.reshape(x, (BLOCK_N, D)).to(dtype)


@triton.jit
def _dequant16(xq, sc, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):
    """int8 [BLOCK_N, D] x fp16 scales [BLOCK_N, D/G] -> fp16: the codes convert exactly (no I2F),
    one fp16 rounding in the scale product."""
    if ASM:
        c = tl.inline_asm_elementwise(_ASM_Q8_TL, "=r,=r,r", [xq], dtype=tl.float16, is_pure=True, pack=4)
    else:
        c = (((xq.to(tl.int16) + 128) | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(tl.float16)
    x = tl.reshape(c, (BLOCK_N, D // G, G)) * sc.to(tl.float16)[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))


# inline PTX, 4 packed int8 in ($2) -> 4 fp16 ($0 = elements 0, 1; $1 = elements 2, 3), exact:
# v + 128 (xor 0x80) is placed under the fp16 exponent of 1024 (0x64), then 1024 + 128 subtracted
_ASM_Q8 = """{
.reg .b32 t, c;
xor.b32 t, $2, 0x80808080;
prmt.b32 $0, t, 0x64646464, 0x5140;
prmt.b32 $1, t, 0x64646464, 0x7362;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}"""
_ASM_Q8_TL = tl.constexpr(_ASM_Q8)


def asm_q8_emulate(word: int) -> list[int]:
    """Python model of _ASM_Q8 on one 32-bit word -> the 4 fp16 bit patterns before the subtraction
    (element order 0..3); the CPU tests check 1024 + 128 + v for every int8 v."""
    t = word ^ 0x80808080
    src = [(t >> (8 * i)) & 255 for i in range(4)] + [0x64] * 4
    regs = [sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4)) for sel in (0x5140, 0x7362)]
    return [regs[0] & 0xFFFF, regs[0] >> 16, regs[1] & 0xFFFF, regs[1] >> 16]


@triton.jit
def _codes16(xq, ASM: tl.constexpr):
    """int8 codes -> fp16, exactly (the magic-number conversion; inline PTX on whole words)."""
    if ASM:
        return tl.inline_asm_elementwise(_ASM_Q8_TL, "=r,=r,r", [xq], dtype=tl.float16, is_pure=True, pack=4)
    return (((xq.to(tl.int16) + 128) | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(tl.float16)
