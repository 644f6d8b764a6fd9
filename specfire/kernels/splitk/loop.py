"""The canonical split-K tree in one K loop on CUDA (kernels/splitk says why the tree): the
chunk sums are folded into the tree in registers, no partials in memory; the same bits as
fused.py's chunk form. Row-invariant: the 16-row tile of kernels/gemv/kernel.py."""
from __future__ import annotations

import torch
from .._triton import triton, tl

from ..gemv.kernel import ROWS, GemvConfig, fit_stages, gemv_config
from .fused import tile_counters


@triton.jit(do_not_specialize=["M"])
def _tree_loop_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KC, stride_xm, stride_wn,
                      C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr,
                      IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """The canonical tree in one K loop, as the plain GEMV walks K: the accumulator restarts at
    every chunk bound (KC columns, a multiple of BLOCK_K) and each finished chunk is folded into
    the tree like a binary counter (chunk c merges with the held subtrees for every trailing 1
    bit of c). Each chunk's sum and every add are those of fused.py's chunk kernel.
    SPLIT (1, 2, 4; dividing C): program_id(2) walks 1/SPLIT of the chunks, folds them into their
    subtree and stores it; the last of a tile's SPLIT programs adds the SPLIT subtrees, which are
    the canonical tree's upper levels: the same bits with SPLIT times the programs (a row-parallel
    N of 5120 is 80 tiles, too few for 132 SMs)."""
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
        if (k0 + BLOCK_K) % KC == 0:
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
        tl.store(y_ptr + off, out.to(y_ptr.dtype.element_ty), mask=mask)
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
            tl.store(y_ptr + off, r.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)                       # ready for the next launch


SPLIT_FILL = 132          # launches of fewer tiles than this (the H200's SMs) split their chunks


def tree_loop_config(n: int, k: int) -> GemvConfig:
    """The plain GEMV's settings for the shape, with BLOCK_K dividing the chunk width."""
    cfg = gemv_config(n, k)
    return GemvConfig(block_n=cfg.block_n, block_k=128, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def tree_loop_fits(k: int, c: int, block_k: int = 128) -> bool:
    """Equal chunks whose width is a multiple of BLOCK_K (true of every real Qwen3.5 shape)."""
    return c in (1, 2, 4, 8) and k % c == 0 and (k // c) % block_k == 0


def gemv_tree_loop(x: torch.Tensor, w: torch.Tensor, c: int, out_dtype: torch.dtype, tile: int = ROWS,
                   launch_n: int | None = None, cfg: GemvConfig | None = None,
                   out: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """[M, N] `out_dtype`: the canonical tree over c equal chunks of K, one launch, no partials in
    memory (the same bits as fused.py's gemv_chunks_fused for equal chunks). `out`: a contiguous
    [M, N] tensor to write (e.g. a collective's buffer), instead of a new one. `cfg` and `split`
    (launch settings, 1, 2 or 4 programs a tile) change no bits; None: the defaults."""
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
    _tree_loop_kernel[grid + (split,)](x, w, y, part, cnt, m, n, k, k // c, x.stride(0), w.stride(0),
                                       C=c, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile,
                                       IEEE=x.dtype == torch.float32, SPLIT=split, num_warps=cfg.num_warps,
                                       num_stages=fit_stages(cfg, tile, x.element_size()))
    return y


def tree_split(c: int, tiles: int) -> int:
    """How many programs share an output tile's chunks (the bits do not depend on it): 2 where the
    tiles alone leave SMs idle (decode / verify rows), else 1 (4 measured slower)."""
    return 2 if c % 2 == 0 and tiles < SPLIT_FILL else 1
