"""The canonical split-K product on CUDA in one launch for any chunk bounds: each program a chunk's
partial, the last chunk program of an output tile adds the tree (loop.py serves equal chunks that
are multiples of 128 columns, with the same bits)."""
from __future__ import annotations

import torch
from .._triton import triton, tl

from .. import pdl
from ..pdl import wait as pdl_wait

from ..gemv.kernel import ROWS, GemvConfig, fit_stages


def chunk_config(n: int, k_chunk: int) -> GemvConfig:
    """Launch settings of one canonical chunk; a function of the chunk's shape only, which is the
    same on every tensor-parallel degree (N is the full hidden size, k_chunk = K / 8)."""
    return GemvConfig(block_n=64, block_k=128 if k_chunk >= 128 else 64, num_warps=4, num_stages=4)


@triton.jit
def _chunk_acc(x_ptr, w_ptr, b_ptr, M, N, stride_xm, stride_wn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr, IEEE: tl.constexpr):
    """The float32 [BLOCK_N, ROWS_] product of this program's tile over chunk program_id(2)'s
    columns [b[c], b[c+1]), with its offsets and masks (shared by both chunk kernels)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_c = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROWS_ + tl.arange(0, ROWS_)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = tl.load(b_ptr + pid_c)
    k_hi = tl.load(b_ptr + pid_c + 1)
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    return acc, offs_n, offs_m, n_mask, m_mask, pid_c


@triton.jit(do_not_specialize=["M"])
def _chunk_tree_kernel(x_ptr, w_ptr, p_ptr, y_ptr, b_ptr, cnt_ptr, M, N, stride_xm, stride_wn,
                       C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """_chunk_kernel, then the last of the C chunk programs of a (row tile, column tile) to finish
    adds the C partials in the canonical tree and writes y: one launch, the same bits as
    chunk_partials + tree_combine (the order of the adds is fixed, not who does them)."""
    pdl_wait(PDL)  # launched with PDL: every earlier kernel done first (kernels/pdl.py)
    acc, offs_n, offs_m, n_mask, m_mask, pid_c = _chunk_acc(x_ptr, w_ptr, b_ptr, M, N, stride_xm, stride_wn,
                                                            BLOCK_N, BLOCK_K, ROWS_, IEEE)
    mask = n_mask[:, None] & m_mask[None, :]
    off = offs_m[None, :] * N + offs_n[:, None]
    tl.store(p_ptr + pid_c * M * N + off, acc, mask=mask)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.debug_barrier()                                          # every thread's partial stored first
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")     # releases this partial, acquires the others'
    if done == C - 1:
        MN = M * N
        p0 = tl.load(p_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
        if C == 1:
            out = p0
        else:
            p1 = tl.load(p_ptr + MN + off, mask=mask, other=0.0, cache_modifier=".cg")
            if C == 2:
                out = p0 + p1
            else:
                p2 = tl.load(p_ptr + 2 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                p3 = tl.load(p_ptr + 3 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                if C == 4:
                    out = (p0 + p1) + (p2 + p3)
                else:
                    p4 = tl.load(p_ptr + 4 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                    p5 = tl.load(p_ptr + 5 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                    p6 = tl.load(p_ptr + 6 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                    p7 = tl.load(p_ptr + 7 * MN + off, mask=mask, other=0.0, cache_modifier=".cg")
                    out = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
        tl.store(y_ptr + off, out.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)                       # ready for the next launch


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTER_SLOTS = 1 << 16


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed tile counters shared by every fused launch on a device, here and in
    kernels/splitk/loop.py (launches on one stream run one after another, and each leaves its
    counters at zero). Allocated by the first (eager) call,
    never inside a CUDA-graph capture (the rows forward is run eagerly before it is captured)."""
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    if n > c.numel():
        raise ValueError(f"a fused split-K launch needs {n} tile counters, more than {c.numel()}")
    return c


def gemv_chunks_fused(x: torch.Tensor, w: torch.Tensor, bounds: torch.Tensor, out_dtype: torch.dtype,
                      tile: int = ROWS) -> torch.Tensor:
    """[M, N] `out_dtype`: the canonical tree over the chunk partials of x @ w^T, in one launch
    (the same bits as tree_combine(chunk_partials(...)))."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemv_chunks_fused: x has K={k} but w is {list(w.shape)}")
    c = bounds.shape[0] - 1
    if c not in (1, 2, 4, 8):
        raise ValueError(f"gemv_chunks_fused takes 1, 2, 4 or 8 chunks, got {c}")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = chunk_config(n, k // c)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, cfg.block_n), c)
    part = torch.empty(c, m, n, device=x.device, dtype=torch.float32)
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    cnt = tile_counters(x.device, grid[0] * grid[1])
    _chunk_tree_kernel[grid](x, w, part, y, bounds, cnt, m, n, x.stride(0), w.stride(0),
                             C=c, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile,
                             IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
                             num_stages=fit_stages(cfg, tile, x.element_size()), **pdl.kw(x))
    return y
