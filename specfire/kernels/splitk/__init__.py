"""The canonical split-K product (ref.py): the CPU reference on the CPU, Triton on CUDA."""
from __future__ import annotations

import torch

from .ref import (ALIGN, CHUNKS, ChunkCache, KSplit, _stacked_cpu, chunk_bounds, degree_problem, head_block,
                  partials_cpu, tree_stack, tree_sum)

__all__ = ["ALIGN", "CHUNKS", "ChunkCache", "KSplit", "chunk_bounds", "degree_problem", "head_block",
           "partials_cpu", "subtree", "tree_stack", "tree_sum"]


def subtree(x: torch.Tensor, w, split: KSplit, rows: bool, cache: ChunkCache,
            out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] `out_dtype`: the canonical tree over this weight's chunks, summed in float32 (the
    whole sum when the weight holds every chunk; a rank's subtree otherwise). `out`: a
    contiguous [M, N] float32 tensor to hold it (a collective's buffer: no copy before sending).
    CUDA: the one-loop kernel where the chunks are equal multiples of 128 columns (every real
    Qwen3.5 shape), else the one-launch chunk form."""
    if out is not None:
        if x.is_cuda and isinstance(w, torch.Tensor) and tree_loop_ok(split):
            from ..gemv.kernel import row_tile
            from .loop import gemv_tree_loop
            return gemv_tree_loop(x, w, split.c1 - split.c0, torch.float32, row_tile(x.shape[0], rows), out=out)
        return out.copy_(subtree(x, w, split, rows, cache))
    if x.is_cuda and isinstance(w, torch.Tensor):
        from ..gemv.kernel import row_tile
        from .fused import gemv_chunks_fused
        from .loop import gemv_tree_loop
        tile = row_tile(x.shape[0], rows)
        if tree_loop_ok(split):
            return gemv_tree_loop(x, w, split.c1 - split.c0, out_dtype, tile)
        cache.get(w, split, x.dtype)
        if cache.bounds_dev is None:
            cache.bounds_dev = torch.tensor(split.bounds, dtype=torch.int32, device=x.device)
        return gemv_chunks_fused(x, w, cache.bounds_dev, out_dtype, tile)
    if not x.is_cuda:
        st = _stacked_cpu(x, w, split, rows)
        if st is not None:
            return tree_stack(st).to(out_dtype)
    parts = q4_partials_cuda(x, w, split, cache) if x.is_cuda else partials_cpu(x, w, split, rows, cache)
    return tree_sum(parts).to(out_dtype)


def tree_loop_ok(split: KSplit) -> bool:
    """The one-loop kernel serves equal chunks whose width is a multiple of its BLOCK_K."""
    from .loop import tree_loop_fits
    b = chunk_bounds(split.k_total)
    return b[1] * CHUNKS == split.k_total and tree_loop_fits(split.k_local, split.c1 - split.c0)


def q4_partials_cuda(x: torch.Tensor, w, split: KSplit, cache: ChunkCache) -> list[torch.Tensor]:
    """4-bit on CUDA: each chunk through the 4-bit GEMV on a K-slice of the weight (group-aligned),
    in float32 activations so the partial is float32."""
    from ..q4 import QuantWeight
    from ..q4.gemv import q4_gemv

    cache.get(w, split, x.dtype)
    b = split.bounds
    if cache.chunks is None:
        g = w.group_size
        if any(v % g for v in b):
            raise ValueError(f"4-bit group size {g} does not divide the canonical K chunks {b}")
        cache.chunks = [QuantWeight(w.qweight[:, b[i] // 2:b[i + 1] // 2].contiguous(),
                                    w.scales_t[b[i] // g:b[i + 1] // g].contiguous(),
                                    w.zeros_t[b[i] // g:b[i + 1] // g].contiguous(), w.hadamard, torch.float32)
                        for i in range(len(b) - 1)]
    xr = w.prepare_input(x).float()
    outs = []
    for i, c in enumerate(cache.chunks):
        xs = xr[:, b[i]:b[i + 1]].contiguous()
        outs.append(torch.cat([q4_gemv(xs[j:j + 16], c) for j in range(0, xs.shape[0], 16)]))
    return outs
