"""The canonical split-K product (ref.py): the CPU reference on the CPU, Triton on CUDA."""
from __future__ import annotations

import os

import torch

from .ref import (ALIGN, CHUNKS, ChunkCache, KSplit, _stacked_cpu, chunk_bounds, degree_problem, head_block,
                  partials_cpu, tree_stack, tree_sum)

__all__ = ["ALIGN", "CHUNKS", "ChunkCache", "KSplit", "chunk_bounds", "degree_problem", "head_block",
           "partials_cpu", "subtree", "tree_stack", "tree_sum"]

FUSED = True        # CUDA: partials and tree in one launch (kernels/splitk/fused.py gemv_chunks_fused)
# CUDA kernel of the canonical product: "loop" (one K loop like the plain GEMV, the tree folded in
# registers; measured on the H200, 4B shapes: bitwise equal to the two-launch form, 1.38-1.48x the
# plain GEMV's time) where the chunks are equal multiples of 128 columns (every real Qwen3.5
# shape), else "fused" (split-K programs, the last one of a tile adds the tree: 1.8x). Read at import.
KERNEL = os.environ.get("SPECFIRE_SPLITK_KERNEL", "loop")


def subtree(x: torch.Tensor, w, split: KSplit, rows: bool, cache: ChunkCache,
            out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None, push=None) -> torch.Tensor:
    """[M, N] `out_dtype`: the canonical tree over this weight's chunks, summed in float32 (the
    whole sum when the weight holds every chunk; a rank's subtree otherwise). `out`: a
    contiguous [M, N] float32 tensor to hold it (a collective's buffer: no copy before sending).
    `push` (kernels/splitk/tree_norm.py Push): `out` is this rank's slot, also sent to the peers' slots."""
    if out is not None:
        if x.is_cuda and isinstance(w, torch.Tensor) and KERNEL == "loop" and tree_loop_ok(split):
            from ..gemv.kernel import row_tile
            from .loop import gemv_tree_loop
            return gemv_tree_loop(x, w, split.c1 - split.c0, torch.float32, row_tile(x.shape[0], rows), out=out,
                                  push=push)
        from .tree_norm import push_rows
        if push is not None and push.ll:              # LL words: the push kernel packs and writes every slot
            push_rows(subtree(x, w, split, rows, cache).contiguous(), push)
            return out
        out.copy_(subtree(x, w, split, rows, cache))
        if push is not None:
            push_rows(out, push)
        return out
    if x.is_cuda and isinstance(w, torch.Tensor):
        from ..gemv.kernel import row_tile
        from .fused import chunk_partials, gemv_chunks_fused, tree_combine
        from .loop import gemv_tree_loop
        cache.get(w, split, x.dtype)
        if cache.bounds_dev is None:
            cache.bounds_dev = torch.tensor(split.bounds, dtype=torch.int32, device=x.device)
        tile = row_tile(x.shape[0], rows)
        c = split.c1 - split.c0
        if KERNEL == "loop" and tree_loop_ok(split):
            return gemv_tree_loop(x, w, c, out_dtype, tile)
        if FUSED:
            return gemv_chunks_fused(x, w, cache.bounds_dev, out_dtype, tile)
        return tree_combine(chunk_partials(x, w, cache.bounds_dev, tile), out_dtype)
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
