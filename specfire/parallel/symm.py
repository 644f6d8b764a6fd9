"""Collectives that can live inside a CUDA graph: torch symmetric memory, one-shot kernels.

NCCL collectives could not be captured into a CUDA graph on our 2 x H200 machine (capture hung);
torch's `symm_mem.one_shot_all_reduce` captured 64 times in one graph replayed correctly at
6.2 us per call (docs/PERFORMANCE.md). The mesh's graph-captured rows forward therefore routes its
three collectives here: the cross-rank tree of row-parallel partials, the vocab-parallel
embedding's sum, the logits gather. All three are exact: two float32 partials are added once
(a + b is the tree at tp = 2, whatever the order), and a gather is a sum of one rank's values
with zeros; for tp > 2 the partials are gathered that way and added in the canonical tree here.

Buffers: per dtype, two symmetric buffers used alternately. Reuse is safe without them: torch's
one-shot kernel ends with a barrier among the ranks, so a call completes only after every peer has
read this rank's buffer for it (`_slot` says why). NVLink multicast stays off (comm.NO_MULTICAST).
"""
from __future__ import annotations

import warnings

import torch

from ..errors import MeshError
from ..kernels.splitk import tree_sum


IDS_EXACT = 1 << 24     # token ids below this are exact in float32


def share_ids(coll, ids: torch.Tensor) -> torch.Tensor:
    """Rank 0's int64 ids on every rank: a float32 sum of rank 0's ids and the others' zeros (exact
    below IDS_EXACT), so the ids of a step travel inside the graph with no host in the way."""
    v = ids.to(torch.float32) if coll.rank == 0 else torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    return coll.sum(v).to(torch.int64)


class SymmCollectives:
    """Symmetric-memory collectives of one rank over the forward group."""

    def __init__(self, group, rank: int, world: int, device: torch.device, capacity_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        self.name = group.group_name
        self.rank, self.world, self.device = rank, world, device
        self.capacity_bytes = capacity_bytes
        try:  # required by older torch releases, deprecated (a warning) in 2.11
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.name)
        except Exception:  # noqa: BLE001 - the rendezvous below reports a real problem
            pass
        self._bufs: dict[torch.dtype, list[torch.Tensor]] = {}
        self._turn: dict[torch.dtype, int] = {}
        self._reserved: torch.Tensor | None = None

    def _slot(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next buffer of `dtype` (allocated and rendezvoused on first use: every rank reaches
        it in the same order, outside any capture, since warm-up runs each forward first)."""
        # The turn is never reset, so a captured graph's first buffer depends on the calls made
        # before its capture. A rows forward makes one call in the model's dtype (the embedding) and two float32
        # calls (ids, logits), and two more float32 calls a layer (the trees). So two graphs replayed back to back can use one such buffer twice
        # in a row. That is safe, and no buffer needs to alternate. Every slot is read only by
        # torch's one_shot_all_reduce. Its kernel (torch/csrc/distributed/c10d/symm_mem/
        # CUDASymmetricMemoryOps.cu: the early, a middle and the current version read) ends with
        # `__syncthreads(); sync_remote_blocks(...)`. Torch's header documents this as the pattern
        # that makes "buffers read by the current kernel safe for writing by subsequent kernels
        # across all devices". Block b of each rank waits there for block b of every peer. Every
        # rank launches the same grid (the grid depends only on numel, dtype, alignment and world).
        # So a call completes on this rank only after every peer has finished reading this rank's
        # buffer. The next write to any slot (a copy_ or a producer writing a reserved slot) comes
        # after that call in stream order.
        bufs = self._bufs.get(dtype)
        if bufs is None:
            n = self.capacity_bytes // torch.empty((), dtype=dtype).element_size()
            bufs = []
            for _ in range(2):
                b = self._symm.empty(n, dtype=dtype, device=self.device)
                self._symm.rendezvous(b, self.name)
                bufs.append(b)
            self._bufs[dtype], self._turn[dtype] = bufs, 0
        if numel > bufs[0].numel():
            raise MeshError(f"a symmetric-memory collective of {numel} elements exceeds the "
                            f"{bufs[0].numel()}-element buffer")
        i = self._turn[dtype]
        self._turn[dtype] = 1 - i
        return bufs[i][:numel]

    def prepare(self, dtype: torch.dtype) -> None:
        """Allocate (and rendezvous) the buffers of `dtype` now, leaving the turn as it was."""
        self._slot(dtype, 0)
        self._turn[dtype] = 0

    def reserve(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The buffer the next `tree` of this shape will send, for its producer to write into
        (tp = 2, where the tree is one sum); None where the tree gathers first."""
        if self.world != 2:
            return None
        n = 1
        for d in shape:
            n *= d
        self._reserved = self._slot(dtype, n).view(shape)
        return self._reserved

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (one one-shot kernel: every rank reads every peer's buffer)."""
        r, self._reserved = self._reserved, None
        if r is not None and x.data_ptr() == r.data_ptr() and x.shape == r.shape and x.dtype == r.dtype:
            view = x                                   # written in place by its producer
        else:
            x = x.contiguous()
            view = self._slot(x.dtype, x.numel()).view_as(x)
            view.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.name)

    def share_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return share_ids(self, ids)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x, exactly (each slot is one rank's values plus zeros)."""
        z = torch.zeros((self.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        z[self.rank] = x
        return self.sum(z)

    def tree(self, x: torch.Tensor) -> torch.Tensor:
        """The canonical tree over the ranks' float32 subtrees (kernels/splitk)."""
        if self.world == 2:
            return self.sum(x)
        parts = self.all_gather(x)
        return tree_sum(list(parts.unbind(0)))


class GlooCollectives:
    """The same three collectives over the forward group with plain all-gathers (CPU, gloo): the
    CPU mesh runs its rows forward through this, so CI exercises the code the GPU's captured
    forward runs, with only the transport different."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.reserved = 0                  # subtrees written straight into a reserved buffer (tests)

    def reserve(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A buffer for the producer to write the next tree's input into (as on the GPU)."""
        self.reserved += 1
        return torch.empty(shape, dtype=dtype)

    def _parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return parts

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._parts(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def share_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return share_ids(self, ids)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._parts(x))

    def tree(self, x: torch.Tensor) -> torch.Tensor:
        return tree_sum(self._parts(x))
