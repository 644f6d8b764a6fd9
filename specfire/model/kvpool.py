"""Paged KV memory: the attention layers' K / V rows of every sequence of one model in blocks of
BLOCK positions, taken from one pool as a sequence grows and given back when it ends.

A pool holds, per attention layer, flat storage of num_blocks * BLOCK rows ([rows, n_kv, D], the
Q8 cache's int8 codes with their scales, values key-minor), so block b is rows b*BLOCK.. of every
layer. A sequence's `BlockTable` maps its logical block j (positions j*BLOCK..) to a pool block:
an int32 device tensor of ceil(max_seq / BLOCK) entries whose address never changes (CUDA graphs
read it), filled as blocks are taken. Entries not yet taken hold block 0, a sink no sequence owns,
so no stray write can reach another sequence's rows. Admission reserves blocks (`reserve`) before
it lets a request in; `grow` then takes them as the forwards need them. Blocks are handed out in a
fixed order (lowest free id first, given ones back on top), so the ranks of a mesh, each running
the same grows and releases in the same order, hold the same block tables.
"""
from __future__ import annotations

import threading

import torch

from ..kernels.attention import BLOCK, Q8_KV, q8_group

SINK = 1        # blocks no sequence owns: block 0 (unallocated table entries point there)


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK)


class KvPool:
    """K / V storage of `heads` (each attention layer's n_kv) for num_blocks blocks, with the free
    list, the blocks in use and the blocks reserved by admitted requests (all counted on the host)."""

    def __init__(self, heads: list[int], head_dim: int, num_blocks: int, device: torch.device, kv_dtype: torch.dtype):
        if num_blocks <= SINK:
            raise ValueError(f"a KV pool needs more than {SINK} block(s), got {num_blocks}")
        self.num_blocks, self.device, self.kv_dtype, self.head_dim = num_blocks, torch.device(device), kv_dtype, head_dim
        rows = num_blocks * BLOCK
        self.k, self.v, self.k_scale, self.v_scale = [], [], [], []
        for n_kv in heads:
            self.k.append(torch.zeros(rows, n_kv, head_dim, device=device, dtype=kv_dtype))
            if kv_dtype == Q8_KV:
                ns = head_dim // q8_group(head_dim)
                self.v.append(torch.zeros(n_kv, head_dim, rows, device=device, dtype=Q8_KV).permute(2, 0, 1))
                self.k_scale.append(torch.zeros(rows, n_kv, ns, device=device, dtype=torch.float16))
                self.v_scale.append(torch.zeros(rows, n_kv, ns, device=device, dtype=torch.float16))
            else:
                self.v.append(torch.zeros(rows, n_kv, head_dim, device=device, dtype=kv_dtype))
                self.k_scale.append(None)
                self.v_scale.append(None)
        self.free: list[int] = list(range(num_blocks - 1, SINK - 1, -1))   # popped from the end: low ids first
        self.reserved = 0
        self.lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Blocks sequences may hold (the sink excluded)."""
        return self.num_blocks - SINK

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    def shrink(self, n: int) -> None:
        """Hand out blocks below n only (the ranks of a mesh agree on their smallest pool, so every
        rank's free list, and every block it gives, is the same); before any block is taken."""
        with self.lock:
            if not SINK < n <= self.num_blocks or self.used:
                raise ValueError(f"a KV pool of {self.num_blocks} blocks ({self.used} in use) cannot shrink to {n}")
            self.free = [b for b in self.free if b < n]
            self.num_blocks = n

    def reserve(self, n: int) -> bool:
        """Promise n blocks to a request (none taken yet); False when the promises would pass the pool."""
        with self.lock:
            if self.reserved + n > self.capacity:
                return False
            self.reserved += n
            return True

    def unreserve(self, n: int) -> None:
        with self.lock:
            self.reserved = max(0, self.reserved - n)

    def take(self, n: int) -> list[int]:
        with self.lock:
            if n > len(self.free):
                raise RuntimeError(f"KV pool exhausted: {n} block(s) asked, {len(self.free)} free of {self.capacity} "
                                   "(a request grew past its reservation)")
            got = [self.free.pop() for _ in range(n)]
        return got

    def give(self, ids: list[int]) -> None:
        with self.lock:
            self.free.extend(reversed(ids))

    def table(self, max_seq: int) -> "BlockTable":
        return BlockTable(self, blocks_for(max_seq))

    def nbytes(self) -> int:
        ts = [t for t in self.k + self.v + self.k_scale + self.v_scale if t is not None]
        return sum(t.untyped_storage().nbytes() for t in ts)


class BlockTable:
    """One sequence's blocks: `ids` int32 [cap] on the pool's device (a fixed address), `blocks`
    the same on the host; `grow(n)` takes blocks until positions 0..n-1 are covered."""

    def __init__(self, pool: KvPool, cap: int):
        self.pool, self.cap = pool, cap
        self.blocks: list[int] = []
        with torch.inference_mode(False):       # written in and out of inference mode
            self.ids = torch.zeros(cap, device=pool.device, dtype=torch.int32)

    @property
    def positions(self) -> int:
        """Positions the taken blocks cover."""
        return len(self.blocks) * BLOCK

    def grow(self, n: int) -> None:
        want = min(self.cap, blocks_for(n))
        have = len(self.blocks)
        if want <= have:
            return
        new = self.pool.take(want - have)
        self.blocks.extend(new)
        with torch.inference_mode(False):
            self.ids[have:want].copy_(torch.tensor(new, dtype=torch.int32), non_blocking=False)

    def release(self) -> None:
        """Give every block back (the entries point at the sink again)."""
        if not self.blocks:
            return
        n = len(self.blocks)
        self.pool.give(self.blocks)
        self.blocks = []
        with torch.inference_mode(False):
            self.ids[:n].zero_()
