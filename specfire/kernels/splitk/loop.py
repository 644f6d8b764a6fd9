"""The canonical split-K tree in one K loop on CUDA, in Triton (kernels/splitk says why the tree:
tp = 1, 2, 4, 8 add the same float32 chunk partials in the same order).

`gemv_tree_loop` walks K once like the plain GEMV and folds the chunk sums into the tree in
registers, no partials in memory: the default where chunks are equal multiples of 128 columns,
the same bits as kernels/splitk/fused.py's two-launch and one-launch chunk forms. On a tp mesh its
epilogue can also push each finished tile to the peers' slots (`_push_tile`, `_push_tile_ll`) for
kernels/splitk/tree_norm.py's fused sum + residual + norm. Row-invariant: the 16-row tile of kernels/gemv/kernel.py.
"""
from __future__ import annotations

import os

import torch
from .._triton import triton, tl

from ..gemv.kernel import ROWS, GemvConfig, fit_stages, gemv_config
from .fused import tile_counters


@triton.jit
def _push_tile(val, off, mask, bufs_ptr, sigs_ptr, R, MN, PUSH_W: tl.constexpr):
    """A finished output tile into slot R of every peer's buffer, then one release-add on each
    peer's arrival word after every thread's stores (kernels/splitk/tree_norm.py waits for them)."""
    for j in tl.static_range(1, PUSH_W):
        dst = tl.load(bufs_ptr + (R + j) % PUSH_W).to(tl.pointer_type(tl.float32))
        tl.store(dst + R * MN + off, val, mask=mask)
    tl.debug_barrier()
    for j in tl.static_range(1, PUSH_W):
        sig = tl.load(sigs_ptr + (R + j) % PUSH_W).to(tl.pointer_type(tl.int32))
        tl.atomic_add(sig, 1, sem="release", scope="sys")


@triton.jit
def _push_tile_ll(val, off, mask, bufs_ptr, epoch_ptr, R, MN, PUSH_W: tl.constexpr):
    """The low-latency form: each float32 value travels with its flag (this use's epoch) in one
    8-byte word into slot R of every rank's buffer, this rank's included: no barrier, no fence, no
    counter; the consumer polls the flags (kernels/splitk/tree_norm.py, LL)."""
    e = (tl.load(epoch_ptr, volatile=True) + 1).to(tl.int64)
    word = (e << 32) | (val.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    for j in tl.static_range(0, PUSH_W):
        dst = tl.load(bufs_ptr + (R + j) % PUSH_W).to(tl.pointer_type(tl.int64))
        tl.store(dst + R * MN + off, word, mask=mask)


@triton.jit(do_not_specialize=["M", "R"])
def _tree_loop_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, bufs_ptr, sigs_ptr, R, M, N, K, KC, stride_xm, stride_wn,
                      C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr,
                      IEEE: tl.constexpr, SELECT: tl.constexpr, SPLIT: tl.constexpr, PUSH_W: tl.constexpr,
                      LL: tl.constexpr = False):
    """The canonical tree in one K loop, as the plain GEMV walks K: the accumulator restarts at
    every chunk bound (KC columns, a multiple of BLOCK_K) and each finished chunk is folded into
    the tree like a binary counter (chunk c merges with the held subtrees for every trailing 1
    bit of c). Each chunk's sum and every add are those of chunk_partials + tree_combine.
    SELECT: the fold without branches (every candidate sum computed, the right one selected), so
    the loop body has no control flow for the compiler's software pipelining to trip on; the
    same adds of the same values, so the same bits.
    SPLIT (1, 2, 4; dividing C): program_id(2) walks 1/SPLIT of the chunks, folds them into their
    subtree and stores it; the last of a tile's SPLIT programs adds the SPLIT subtrees, which are
    the canonical tree's upper levels: the same bits with SPLIT times the programs (a row-parallel
    N of 5120 is 80 tiles, too few for 132 SMs).
    PUSH_W > 1: y is this rank's slot of a tp mesh's buffers; each finished tile is also sent to
    slot R of the PUSH_W - 1 peers' buffers (_push_tile). Elementwise stores: the same bits."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROWS_ + tl.arange(0, ROWS_)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    zero = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
    acc = zero
    s0 = zero
    s1 = zero
    s2 = zero
    s3 = zero
    ks = K // SPLIT
    k_begin = pid_s * ks
    for k0 in range(k_begin, k_begin + ks, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        if SELECT:
            end = (k0 + BLOCK_K) % KC == 0
            c = (k0 - k_begin) // KC            # the chunk's index within this program's subtree
            v1 = s0 + acc                       # the subtree chunk c closes, at each tree level
            v2 = s1 + v1
            v3 = s2 + v2
            s0 = tl.where(end & (c % 2 == 0), acc, s0)
            s1 = tl.where(end & (c % 4 == 1), v1, s1)
            s2 = tl.where(end & (c % 8 == 3), v2, s2)
            s3 = tl.where(end & (c % 8 == 7), v3, s3)
            acc = tl.where(end, zero, acc)
        elif (k0 + BLOCK_K) % KC == 0:
            c = (k0 - k_begin) // KC
            v = acc
            if c % 2 == 1:
                v = s0 + v
                if c % 4 == 3:
                    v = s1 + v
                    if c % 8 == 7:
                        s3 = s2 + v
                    else:
                        s2 = v
                else:
                    s1 = v
            else:
                s0 = v
            acc = zero
    CS: tl.constexpr = C // SPLIT
    if CS == 1:
        out = s0
    elif CS == 2:
        out = s1
    elif CS == 4:
        out = s2
    else:
        out = s3
    mask = n_mask[:, None] & m_mask[None, :]
    off = offs_m[None, :] * N + offs_n[:, None]
    if SPLIT == 1:
        if LL:
            _push_tile_ll(out, off, mask, bufs_ptr, sigs_ptr, R, M * N, PUSH_W)
        else:
            tl.store(y_ptr + off, out.to(y_ptr.dtype.element_ty), mask=mask)
        if PUSH_W > 1 and not LL:
            _push_tile(out, off, mask, bufs_ptr, sigs_ptr, R, M * N, PUSH_W)
    else:
        MN = M * N
        tl.store(p_ptr + pid_s * MN + off, out, mask=mask)
        tile = pid_n * tl.num_programs(0) + pid_m
        tl.debug_barrier()                                          # every thread's subtree stored first
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")     # releases it, acquires the others'
        if done == SPLIT - 1:
            q0 = tl.load(p_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
            q1 = tl.load(p_ptr + MN + off, mask=mask, other=0.0, cache_modifier=".cg")
            if SPLIT == 2:
                r = q0 + q1
            else:
                q2 = tl.load(p_ptr + 2 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                q3 = tl.load(p_ptr + 3 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                r = (q0 + q1) + (q2 + q3)
            if LL:
                _push_tile_ll(r, off, mask, bufs_ptr, sigs_ptr, R, MN, PUSH_W)
            else:
                tl.store(y_ptr + off, r.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)                       # ready for the next launch
            if PUSH_W > 1 and not LL:
                _push_tile(r, off, mask, bufs_ptr, sigs_ptr, R, MN, PUSH_W)


def _loop_override() -> tuple[GemvConfig | None, bool]:
    """SPECFIRE_SPLITK_LOOP="block_n,num_warps,num_stages,select" (bench/tp.py's sweep): launch
    settings of the tree loop for every shape. They change no bits: BLOCK_K (the order of the
    adds) stays 128, and the sweep checks each setting bitwise against the two-launch form."""
    raw = os.environ.get("SPECFIRE_SPLITK_LOOP")
    if not raw:
        return None, False
    try:
        bn, nw, ns, sel = (int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError(f"SPECFIRE_SPLITK_LOOP must be 'block_n,num_warps,num_stages,select' integers, got {raw!r}") from None
    return GemvConfig(block_n=bn, block_k=128, num_warps=nw, num_stages=ns), bool(sel)


LOOP_CONFIG, LOOP_SELECT = _loop_override()
TREE_SPLIT = os.environ.get("SPECFIRE_SPLITK_SPLIT", "auto")
if TREE_SPLIT not in ("1", "2", "4", "auto"):
    raise ValueError(f"SPECFIRE_SPLITK_SPLIT must be 1, 2, 4 or auto, got {TREE_SPLIT!r}")
SPLIT_FILL = 132          # "auto" splits launches of fewer tiles than this (the H200's SMs)


def tree_loop_config(n: int, k: int) -> GemvConfig:
    """The plain GEMV's settings for the shape, with BLOCK_K dividing the chunk width."""
    if LOOP_CONFIG is not None:
        return LOOP_CONFIG
    cfg = gemv_config(n, k)
    return GemvConfig(block_n=cfg.block_n, block_k=128, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def tree_loop_fits(k: int, c: int, block_k: int = 128) -> bool:
    """Equal chunks whose width is a multiple of BLOCK_K (true of every real Qwen3.5 shape)."""
    return c in (1, 2, 4, 8) and k % c == 0 and (k // c) % block_k == 0


def gemv_tree_loop(x: torch.Tensor, w: torch.Tensor, c: int, out_dtype: torch.dtype, tile: int = ROWS,
                   launch_n: int | None = None, cfg: GemvConfig | None = None, select: bool | None = None,
                   out: torch.Tensor | None = None, split: int | None = None, push=None) -> torch.Tensor:
    """[M, N] `out_dtype`: the canonical tree over c equal chunks of K, one launch, no partials in
    memory (the same bits as tree_combine(chunk_partials(...)) for equal chunks). `out`: a
    contiguous [M, N] tensor to write (e.g. a collective's buffer), instead of a new one.
    `push` (kernels/splitk/tree_norm.py Push, with `out` float32 this rank's slot): each finished tile also
    goes to the peers' slots; sets push.target."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not tree_loop_fits(k, c):
        raise ValueError(f"gemv_tree_loop: K={k} in {c} chunks needs chunk widths that are multiples of 128")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = cfg or tree_loop_config(launch_n or n, k * (8 // c))
    if cfg.block_k != 128:
        raise ValueError("gemv_tree_loop: BLOCK_K is the canonical 128 (it orders the adds)")
    y = out if out is not None else torch.empty(m, n, device=x.device, dtype=out_dtype)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, cfg.block_n))
    split = tree_split(c, grid[0] * grid[1]) if split is None else split
    if split not in (1, 2, 4) or c % split:
        raise ValueError(f"gemv_tree_loop: split {split} must be 1, 2 or 4 and divide the {c} chunks")
    if split > 1:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        cnt = tile_counters(x.device, grid[0] * grid[1])
    else:
        part = cnt = y
    push_w, ll = 0, push is not None and push.ll
    if push is not None and (push.world > 1 or ll):
        if out is None or y.dtype != (torch.int64 if ll else torch.float32):
            raise ValueError("gemv_tree_loop: a push writes into the given slot `out` (float32; int64 words for LL)")
        push_w = push.world
        push.target = grid[0] * grid[1] * (push.world - 1)
    bufs, sigs, r = (push.bufs, push.sigs, push.rank) if push_w else (cnt, cnt, 0)
    _tree_loop_kernel[grid + (split,)](x, w, y, part, cnt, bufs, sigs, r, m, n, k, k // c, x.stride(0), w.stride(0),
                                       C=c, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile,
                                       IEEE=x.dtype == torch.float32, SELECT=LOOP_SELECT if select is None else select,
                                       SPLIT=split, PUSH_W=push_w, LL=ll, num_warps=cfg.num_warps,
                                       num_stages=fit_stages(cfg, tile, x.element_size()))
    return y


def tree_split(c: int, tiles: int) -> int:
    """How many programs share an output tile's chunks in the tree loop (the bits do not depend on
    it). "auto" (default): 2 where the tiles alone leave SMs idle (decode / verify rows: a hidden
    size of 5120 is 80 tiles), else 1. Measured on the H200 (27B shapes, docs/BENCHMARKS.md, fourth
    session): 2 programs cut a tp2 step's tree loops from 2.55 to 2.35 ms; 4 raised them to 3.76.
    SPECFIRE_SPLITK_SPLIT=1, 2 or 4 forces a value."""
    if TREE_SPLIT == "auto":
        return 2 if c % 2 == 0 and tiles < SPLIT_FILL else 1
    s = min(int(TREE_SPLIT), c)
    return s if c % s == 0 else 1
