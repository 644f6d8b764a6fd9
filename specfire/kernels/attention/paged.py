"""The paged KV layout (model/kvpool.py): a cache tensor is a pool's flat rows [num_blocks * BLOCK,
n_kv, D] and a sequence's position p lives at row blocks[p // BLOCK] * BLOCK + p % BLOCK. The kernels
read a block id per key tile (their key tiles and split spans are whole divisors / multiples of
BLOCK, so a tile never straddles two blocks and every reduction keeps the contiguous order); the
PyTorch paths gather a sequence's rows into a contiguous tensor first."""
from __future__ import annotations

import torch

BLOCK = 64      # positions per block (a multiple of every kernel key tile, a divisor of every split span)


def rows_of(blocks: torch.Tensor, pos0, t: int) -> torch.Tensor:
    """int64 pool rows of positions pos0..pos0+t-1 (`pos0` an int or a one-element device tensor)."""
    if isinstance(pos0, torch.Tensor):
        p = pos0.reshape(1).to(torch.int64) + torch.arange(t, device=blocks.device)
    else:
        p = torch.arange(pos0, pos0 + t, device=blocks.device)
    return blocks.to(torch.int64).index_select(0, p // BLOCK) * BLOCK + p % BLOCK


def gather(cache: torch.Tensor | None, blocks: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Positions 0..n-1 of a cache as one contiguous tensor [n, ...] (the cache itself sliced when
    it is not paged)."""
    if cache is None or blocks is None:
        return None if cache is None else cache[:n]
    rows = cache.index_select(0, rows_of(blocks, 0, n))
    if cache.stride(0) == 1 and cache.stride(-1) != 1:     # values key-minor (the Q8 cache): kept so, as
        out = torch.empty(cache.shape[1], cache.shape[2], n, device=cache.device, dtype=cache.dtype)
        return out.permute(2, 0, 1).copy_(rows)           # the CPU products read them in that order
    return rows


def capacity(lc) -> int:
    """Positions a layer cache addresses (a paged one: its table's blocks)."""
    return lc.k.shape[0] if lc.blocks is None else lc.blocks.shape[0] * BLOCK
