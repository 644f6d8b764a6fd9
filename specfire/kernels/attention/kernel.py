"""Triton attention for a few query rows (decode, verify) over the KV cache, 16-bit or Q8: a program
scans one fixed span of SPLIT keys of one KV head for a tile of (row, query head) pairs, so a KV
block serves the whole group; fixed spans, tiles and combine order make a row's result independent
of the row count and of pos0."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from .._triton import triton, tl

from .. import pdl
from ..pdl import wait as pdl_wait
from .device import _codes16, _dequant, _dequant16, _online_softmax_step, _page_rows, _seq, _seq_split
from .paged import BLOCK as PAGE

if TYPE_CHECKING:
    from .multi import Launch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX in the interpreter

# Measured on the H200. None may depend on R or pos0.
SPLIT = 512      # keys per span (fixed: part of the reduction order)
BLOCK_M = 32     # (row, query-head) pairs per tile: up to 5 rows of a 6-head group in one tile
BLOCK_N = 64     # keys per inner step
CHUNK = 16       # spans merged per step of the combine (fixed: part of the reduction order)
# Q8 with 16-bit queries: 0 = int8 -> float32 (I2F converts) x scale -> the query dtype;
# 1 = int8 -> fp16 exactly by the magic-number trick (bits 0x6400 | (v + 128) are 1024 + v + 128),
#     x fp16 scale, fp16 MMAs (q converted to fp16: exact for |q| in [6.1e-5, 65504]);
# 2 = as 1 with the conversion done on whole 32-bit words by inline PTX (xor, prmt, sub.f16x2)
Q8_MODE = 2
# the Q8 fp16 path's own tile: 32 keys a step, 3 stages (measured faster than mode 0 at 64 keys;
# 64-key steps with the prefetch and the PTX conversion together measured far slower)
Q8_BLOCK_N = 32
Q8_STAGES = 3
# Q8 with one scale per (position, KV head), the cache's default (kernels/attention): the key scale
# multiplies the scores after an fp16 dot on the exact codes, the value scale multiplies p before
# p.V, so no element is dequantized; values stored key-minor (kernels/attention q8_value_cache).
# Tile measured on the H200: 64 keys a step, 3 stages, 4 warps (faster than the bf16 cache's kernel).
Q8T_BLOCK_N = 64
Q8T_STAGES = 3
Q8T_WARPS = 4


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, acc_ptr, ml_ptr,
                       pos0, pos_ptr, n_rows, n_split, qk_scale,
                       sq_r, sq_h, sk_n, sk_h, sv_n, sv_h, sks_n, sks_h, svs_n, svs_h,
                       REP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, Q8: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       PREC: tl.constexpr, POS_PTR: tl.constexpr,
                       QMODE: tl.constexpr, PDL: tl.constexpr = False,
                       seq_ptr=None, spos_ptr=None, tab_ptr=None, n_kvh=1,
                       MULTI: tl.constexpr = False, ALIGN: tl.constexpr = False,
                       blk_ptr=None, PAGED: tl.constexpr = False):
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    if POS_PTR:  # position read on the device (CUDA-graph replay with a new position)
        pos0 = tl.load(pos_ptr).to(tl.int32)
    mt = tl.program_id(0)        # tiles of one span run side by side, so later tiles read the span from L2
    sid = tl.program_id(1)
    kvh = tl.program_id(2)
    hq = tl.num_programs(2) * REP
    row0 = 0
    if MULTI:    # one of several sequences (multi.py): its rows, position and cache
        hq = n_kvh * REP
        kvh, row0, n_rows, pos0, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr = _seq_split(
            seq_ptr, spos_ptr, tab_ptr, kvh, n_kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr, Q8, ALIGN, PAGED)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)        # pair = row * REP + head-in-group
    row = offs_m // REP
    head = kvh * REP + offs_m % REP
    m_ok = row < n_rows
    pos = pos0 + row                                     # each row's own position
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, D // G)
    offs_b = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (row0 + row)[:, None] * sq_r + head[:, None] * sq_h + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    if PREC == "ieee":
        q = q.to(tl.float32)
    if Q8 and QMODE > 0:
        q = q.to(tl.float16)
    start = sid * SPLIT
    hi = tl.minimum(start + SPLIT, pos0 + n_rows)
    if MULTI:    # a tile past this sequence's rows (the grid covers the longest) reads nothing
        hi = tl.where(mt * BLOCK_M < n_rows * REP, hi, start)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = k_ptr + kvh * sk_h + offs_d[None, :]
    v_base = v_ptr + kvh * sv_h + offs_d[None, :]
    ks_base = ks_ptr + kvh * sks_h + offs_g[None, :]
    vs_base = vs_ptr + kvh * svs_h + offs_g[None, :]
    if Q8:
        # registers hold the next block's int8 tiles while this one is dequantized and multiplied
        nxt = start + offs_b
        ok = (nxt < hi)[:, None]
        rn = _page_rows(blk_ptr, start, nxt, hi, PAGED)[:, None]
        kq = tl.load(k_base + rn * sk_n, mask=ok, other=0)
        vq = tl.load(v_base + rn * sv_n, mask=ok, other=0)
        ksc = tl.load(ks_base + rn * sks_n, mask=ok, other=0.0)
        vsc = tl.load(vs_base + rn * svs_n, mask=ok, other=0.0)
        for n0 in range(start, hi, BLOCK_N):
            offs_n = n0 + offs_b
            if QMODE > 0:
                k = _dequant16(kq, ksc, BLOCK_N, D, G, QMODE == 2)
                v = _dequant16(vq, vsc, BLOCK_N, D, G, QMODE == 2)
            else:
                k = _dequant(kq, ksc, BLOCK_N, D, G, q.dtype)
                v = _dequant(vq, vsc, BLOCK_N, D, G, q.dtype)
            nxt = offs_n + BLOCK_N
            ok = (nxt < hi)[:, None]
            rn = _page_rows(blk_ptr, n0 + BLOCK_N, nxt, hi, PAGED)[:, None]
            kq = tl.load(k_base + rn * sk_n, mask=ok, other=0)
            vq = tl.load(v_base + rn * sv_n, mask=ok, other=0)
            ksc = tl.load(ks_base + rn * sks_n, mask=ok, other=0.0)
            vsc = tl.load(vs_base + rn * svs_n, mask=ok, other=0.0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, offs_n, pos, m_i, l_i, acc, qk_scale, PREC)
    else:
        for n0 in range(start, hi, BLOCK_N):
            offs_n = n0 + offs_b
            ok = (offs_n < hi)[:, None]
            rn = _page_rows(blk_ptr, n0, offs_n, hi, PAGED)[:, None]
            k = tl.load(k_base + rn * sk_n, mask=ok, other=0.0).to(q.dtype)
            v = tl.load(v_base + rn * sv_n, mask=ok, other=0.0).to(q.dtype)
            m_i, l_i, acc = _online_softmax_step(q, k, v, offs_n, pos, m_i, l_i, acc, qk_scale, PREC)
    # partials: acc [R, Hq, n_split, D], ml [R, Hq, n_split, 2] (R: every sequence's rows)
    base = ((row0 + row) * hq + head) * n_split + sid
    tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=m_ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=m_ok)


@triton.jit(do_not_specialize=["pos0", "n_rows", "n_split"])   # one binary for every R and position
def _attn_q8t_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, acc_ptr, ml_ptr,
                     pos0, pos_ptr, n_rows, n_split, qk_scale,
                     sq_r, sq_h, sk_n, sk_h, sv_n, sv_h, sv_d, sks_n, sks_h, svs_n, svs_h,
                     REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT: tl.constexpr, POS_PTR: tl.constexpr, ASM: tl.constexpr,
                     VT: tl.constexpr, VPAD: tl.constexpr, PDL: tl.constexpr = False,
                     seq_ptr=None, spos_ptr=None, tab_ptr=None, n_kvh=1,
                     MULTI: tl.constexpr = False, ALIGN: tl.constexpr = False,
                     blk_ptr=None, PAGED: tl.constexpr = False):
    """The split kernel's contract for a Q8 cache with one scale per (position, KV head). VT: values
    key-minor (sv_n == 1); VPAD: the value storage covers every whole BLOCK_N block, so value loads
    need no mask (keys past a row's position get p = 0 exactly, and a finite code times 0 is 0)."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    if POS_PTR:
        pos0 = tl.load(pos_ptr).to(tl.int32)
    mt = tl.program_id(0)
    sid = tl.program_id(1)
    kvh = tl.program_id(2)
    hq = tl.num_programs(2) * REP
    row0 = 0
    if MULTI:    # one of several sequences (multi.py): its rows, position and cache
        hq = n_kvh * REP
        kvh, row0, n_rows, pos0, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr = _seq_split(
            seq_ptr, spos_ptr, tab_ptr, kvh, n_kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, blk_ptr, True, ALIGN, PAGED)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // REP
    head = kvh * REP + offs_m % REP
    m_ok = row < n_rows
    pos = pos0 + row
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (row0 + row)[:, None] * sq_r + head[:, None] * sq_h + offs_d[None, :],
                mask=m_ok[:, None], other=0.0).to(tl.float16)
    start = sid * SPLIT
    hi = tl.minimum(start + SPLIT, pos0 + n_rows)
    if MULTI:    # a tile past this sequence's rows (the grid covers the longest) reads nothing
        hi = tl.where(mt * BLOCK_M < n_rows * REP, hi, start)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, hi, BLOCK_N):
        offs_n = n0 + offs_b
        ok = offs_n < hi
        rn = _page_rows(blk_ptr, n0, offs_n, hi, PAGED)
        kq = tl.load(k_ptr + kvh * sk_h + rn[:, None] * sk_n + offs_d[None, :], mask=ok[:, None], other=0)
        ksc = tl.load(ks_ptr + kvh * sks_h + rn * sks_n, mask=ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(_codes16(kq, ASM))) * (ksc * qk_scale)[None, :]   # log2 units
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vsc = tl.load(vs_ptr + kvh * svs_h + rn * svs_n, mask=ok, other=0.0).to(tl.float32)
        pv = (p * vsc[None, :]).to(tl.float16)       # <= the fp16 scale: no overflow
        if VT:
            v_ptrs = v_ptr + kvh * sv_h + offs_d[:, None] * sv_d + rn[None, :]
            if VPAD:
                vq = tl.load(v_ptrs)
            else:
                vq = tl.load(v_ptrs, mask=ok[None, :], other=0)
            v = tl.trans(_codes16(vq, ASM))
        else:
            vq = tl.load(v_ptr + kvh * sv_h + rn[:, None] * sv_n + offs_d[None, :] * sv_d, mask=ok[:, None],
                         other=0)
            v = _codes16(vq, ASM)
        acc = acc * alpha[:, None] + tl.dot(pv, v)
        m_i = m_new
    base = ((row0 + row) * hq + head) * n_split + sid
    tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=m_ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _attn_combine_kernel(acc_ptr, ml_ptr, out_ptr, pos0, pos_ptr, n_split, hq,
                         D: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, POS_PTR: tl.constexpr,
                         PDL: tl.constexpr = False, seq_ptr=None, spos_ptr=None, rseq_ptr=None,
                         MULTI: tl.constexpr = False):
    """One (row, query head): merge the row's own spans 0..pos//SPLIT. Spans are taken CHUNK at a
    time from fixed boundaries (a fixed-shape tree within a chunk, chunks in order); spans past the
    row's own are masked to exact zeros, so the sum depends on the row's position only.
    MULTI: rows of several sequences, each row's sequence from rseq_ptr [R]."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    if POS_PTR:
        pos0 = tl.load(pos_ptr).to(tl.int32)
    pid = tl.program_id(0)
    row = pid // hq
    if MULTI:
        row0, n_rows, pos0 = _seq(seq_ptr, spos_ptr, tl.load(rseq_ptr + row))
        row -= row0
    n_own = (pos0 + row) // SPLIT + 1
    base = pid * n_split
    offs_j = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    m = tl.full([CHUNK], -1.0e30, tl.float32)
    for j0 in range(0, n_own, CHUNK):
        mj = tl.load(ml_ptr + (base + j0 + offs_j) * 2, mask=j0 + offs_j < n_own, other=-1.0e30)
        m = tl.maximum(m, mj)
    m_all = tl.max(m, 0)
    l_sum = tl.zeros([CHUNK], tl.float32)
    o = tl.zeros([D], tl.float32)
    for j0 in range(0, n_own, CHUNK):
        ok = j0 + offs_j < n_own
        w = tl.where(ok, tl.exp2(tl.load(ml_ptr + (base + j0 + offs_j) * 2, mask=ok, other=0.0) - m_all), 0.0)
        l_sum += tl.load(ml_ptr + (base + j0 + offs_j) * 2 + 1, mask=ok, other=0.0) * w
        a = tl.load(acc_ptr + (base + j0 + offs_j)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        o += tl.sum(a * w[:, None], 0)
    tl.store(out_ptr + pid * D + offs_d, o / tl.sum(l_sum, 0))


def attention_rows_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0, scale: float,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          block_m: int = BLOCK_M, split: int = SPLIT, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          chunk: int = CHUNK, multi: Launch | None = None,
                          blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Contract of attention_rows_ref (q [R, Hq, D] -> float32 [R, Hq, D]); Q8 when scales are given.
    `pos0` may be a one-element int tensor on the device: the kernels then read it there and the
    launch covers every span of the cache (spans past the rows' positions contribute nothing), so
    the call can be captured in a CUDA graph and replayed at any position. The tile arguments
    (default: the module's measured settings) change no row's dependence on the others.
    `multi` (kernels/attention/multi.py): q holds several sequences' rows, each over its own cache
    (k_cache, ... are the first's: every cache is laid out alike) at its own position (pos0 unused);
    each program does what it does when its sequence runs alone, so each one's rows get those bits.
    `blocks` (kernels/attention/paged.py): the caches are a pool's rows and position p of the
    sequence is at blocks[p // BLOCK] (with `multi`: the first's table, each sequence's in its
    table row); the spans and tiles are those of the contiguous cache, so are the bits."""
    r_rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    q8 = k_scale is not None
    if q.stride(-1) != 1:
        q = q.contiguous()
    pos_ptr = pos0 if isinstance(pos0, torch.Tensor) and multi is None else None
    whole = k_cache.shape[0] if blocks is None else blocks.shape[0] * PAGE     # positions the cache addresses
    if blocks is not None:
        _check_paged(split, block_n, q8 and k_scale.shape[-1] == 1 and (q.dtype != torch.float32 or v_cache.stride(-1) != 1))
        skw0 = dict(blk_ptr=blocks, PAGED=True)
    else:
        skw0 = dict(blk_ptr=k_cache)       # (unread)
    if multi is None:
        n_keys = whole if pos_ptr is not None else pos0 + r_rows
        tile_rows, n_seq, skw, ckw = r_rows, 1, {}, {}
    else:
        n_keys = whole if multi.n_keys is None else multi.n_keys
        tile_rows, n_seq = multi.rows_max, multi.n
        skw = dict(seq_ptr=multi.seqs, spos_ptr=multi.pos, tab_ptr=multi.table, n_kvh=hkv, MULTI=True,
                   ALIGN=multi.align)
        ckw = dict(seq_ptr=multi.seqs, spos_ptr=multi.pos, rseq_ptr=multi.row_seq, MULTI=True)
    skw.update(skw0)
    n_split = triton.cdiv(n_keys, split)
    pos_int = pos0 if multi is None and pos_ptr is None else 0
    grid = (triton.cdiv(tile_rows * rep, block_m), n_split, hkv * n_seq)
    acc = torch.empty(r_rows, hq, n_split, d, device=q.device, dtype=torch.float32)
    pos_arg = pos_ptr if pos_ptr is not None else acc   # unused by the kernels when the position is an int
    ml = torch.empty(r_rows, hq, n_split, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(r_rows, hq, d, device=q.device, dtype=torch.float32)
    combine = lambda: _attn_combine_kernel[(r_rows * hq,)](   # noqa: E731
        acc, ml, out, pos_int, pos_arg, n_split, hq, D=d, SPLIT=split, CHUNK=chunk, POS_PTR=pos_ptr is not None,
        num_warps=4, **pdl.kw(q), **ckw)
    # per-token scales take the q8t kernel, except float32 queries on head_dim-contiguous values
    # (the float32 dequantizing path below, exact to the reference)
    if q8 and k_scale.shape[-1] == 1 and (q.dtype != torch.float32 or v_cache.stride(-1) != 1):
        _q8t_launch(q, k_cache, v_cache, k_scale, v_scale, acc, ml, pos_int, pos_arg, pos_ptr is not None,
                    r_rows, n_keys, n_split, scale, grid, block_m, split, block_n, num_warps, num_stages, skw)
        combine()
        return out
    if v_cache.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("attention rows: a bf16 / fp32 cache or grouped Q8 scales need head_dim contiguous "
                         f"k and v, got strides {tuple(k_cache.stride())} / {tuple(v_cache.stride())}")
    ks = k_scale if q8 else k_cache
    vs = v_scale if q8 else v_cache
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qmode = 0  # float32 queries (the CPU tests' default) keep the float32 dequantisation
    if q8 and q.dtype in (torch.float16, torch.bfloat16):
        qmode = 1 if INTERPRET else Q8_MODE      # no inline PTX in the interpreter
    fp16_q8 = qmode > 0
    block_n = block_n or (Q8_BLOCK_N if fp16_q8 else BLOCK_N)
    num_stages = num_stages or (Q8_STAGES if fp16_q8 else 2)
    _attn_split_kernel[grid](
        q, k_cache, v_cache, ks, vs, acc, ml, pos_int, pos_arg, r_rows, n_split, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        REP=rep, D=d, G=(d // k_scale.shape[-1]) if q8 else 1, Q8=q8, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split, PREC=prec, POS_PTR=pos_ptr is not None, QMODE=qmode,
        num_warps=num_warps or 4, num_stages=num_stages, **pdl.kw(q), **skw)
    combine()
    return out


def _q8t_launch(q, k_cache, v_cache, k_scale, v_scale, acc, ml, pos_int, pos_arg, pos_on_device, r_rows, n_keys,
                n_split, scale, grid, block_m, split, block_n, num_warps, num_stages, skw):
    """Launch _attn_q8t_kernel: values key-minor when v_cache's position stride is 1 (the cache's
    layout), mask-free value loads when the storage covers every whole key block."""
    d = q.shape[-1]
    block_n = block_n or Q8T_BLOCK_N
    vt = v_cache.stride(0) == 1 and v_cache.stride(2) != 1
    if not vt and v_cache.stride(2) != 1:
        raise ValueError(f"Q8 values need positions or head_dim contiguous, got strides {tuple(v_cache.stride())}")
    if k_cache.stride(2) != 1:
        raise ValueError(f"Q8 keys need head_dim contiguous, got strides {tuple(k_cache.stride())}")
    last = (v_cache.storage_offset() + (v_cache.shape[1] - 1) * v_cache.stride(1) + (d - 1) * v_cache.stride(2)
            + triton.cdiv(n_keys, block_n) * block_n - 1)
    # a pool's storage holds every row of every block a tile can name
    vpad = vt and (skw.get("PAGED", False) or last < v_cache.untyped_storage().nbytes() // v_cache.element_size())
    asm = Q8_MODE == 2 and not INTERPRET
    _attn_q8t_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, acc, ml, pos_int, pos_arg, r_rows, n_split, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        REP=q.shape[1] // k_cache.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
        POS_PTR=pos_on_device, ASM=asm, VT=vt, VPAD=vpad,
        num_warps=num_warps or Q8T_WARPS, num_stages=num_stages or Q8T_STAGES, **pdl.kw(q), **skw)


def _check_paged(split: int, block_n: int | None, q8t: bool) -> None:
    """A paged cache's key tiles must lie inside one block and its spans start on one."""
    tiles = (block_n or Q8T_BLOCK_N,) if q8t else ((block_n,) if block_n else (BLOCK_N, Q8_BLOCK_N))
    if split % PAGE or any(PAGE % b for b in tiles):
        raise ValueError(f"attention rows over a paged cache: split {split} must be a multiple of the block "
                         f"({PAGE} positions) and key tiles {tiles} divide it")
