"""The mesh's control plane: rank 0 calls a Trunk method by name, and every rank runs that same
method on its own shard.

A call is a small header (the method name and its arguments, tensors replaced by their shape and
dtype) broadcast on the command group, then each tensor argument broadcast on the forward group.

A decode / verify step costs one header and no host read of the device: its token ids stay on
rank 0's device (SharedIdsArg) and reach the other ranks inside the rows forward (the embedding's
first collective, parallel/model.py), and a `commit(n)` rides in the next call's header
(`commits`), so rank 0 can queue step t+1 before step t has finished on the device and every rank
replays its graphs back to back. Without the captured forward (an eager GPU mesh) a step's few
ids ride in the header (IdsArg). The methods a call may name are the Trunk protocol's own
(`runtime/trunk.py`); `rank_stats`, `rank_time`, `draft_argmax` (this rank's side of rank 0's
vocabulary-sharded greedy draft chain, parallel/draft.py) and `close` are control-plane words. A
replayed draft chain, like a commit, rides in the next call's header (`commits` holds both).

A mesh holds several sequences (slots, runtime/slots.py): every rank keeps its shard of each
slot's state (`RankExecutor.slots`, one LocalTrunk view each, made by `new_slot` on every rank at
once), and a call's header names the slot it acts on. `verify_packed` runs several slots' verify
rows as one packed forward on every rank (Qwen35Trunk.packed), so each collective runs once a
layer for all of them.

A rank's slots share one KV pool (model/kvpool.py): a forward takes the blocks it writes past
(LocalTrunk.grow), and a slot's request ending gives them back (`end`, a rider like a commit). Every
rank runs the same calls and riders in rank 0's order over a pool alike, so it takes and frees the
same blocks: the block tables are the same on every rank (`rank_stats` digests them). Admission
(runtime/slots.py) reserves blocks on rank 0's pool, the same as every rank's.
"""
from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MeshError
from ..runtime.trunk import LocalTrunk
from .comm import Comm

# the Trunk methods every rank runs on its shard when rank 0 calls them (the rest run on rank 0 alone)
CALLS = ("begin", "prefill", "verify", "commit", "score", "embed", "lm_logits")
PACKED = "verify_packed"    # several slots' verifies in one forward: (slots, positions, row counts, ids)
RANK_STATS, RANK_TIME, DRAFT, NEW_SLOT, CLOSE = "rank_stats", "rank_time", "draft_argmax", "new_slot", "close"
END = "end"                 # a rider: (END, slot), the slot's request ended (its KV blocks back to the pool)
# call counters, then the KV pool's blocks in use and a digest of its free list and block tables
STAT_NAMES = CALLS + (PACKED, "verify_rows", "max_verify_rows", END, "kv_used", "kv_digest")


@dataclass(frozen=True)
class TensorArg:
    """Stands for a tensor argument in a call header; the tensor itself follows on the forward group."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class IdsArg:
    """A few token ids (a decode or verify step) carried in the header itself, so a step costs one
    small broadcast on the command group and no collective on the forward group."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class SharedIdsArg:
    """n token ids left on rank 0's device; the other ranks receive them inside the rows forward
    (Comm.shared_ids), so sending the step never waits for the device."""

    n: int


class SharedIds:
    """Rank 0 wraps a verify's device ids in this to send them as a SharedIdsArg."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids


INLINE_IDS = 32
ROWS_MAX = 16     # rows of a verify the captured collectives are sized for (k + 1 <= 11; a packed call's groups)


def _plain(a: Any) -> Any:
    if isinstance(a, SharedIds):
        return SharedIdsArg(a.ids.shape[0])
    if not isinstance(a, torch.Tensor):
        return a
    if a.dtype == torch.int64 and a.dim() == 1 and a.numel() <= INLINE_IDS:
        return IdsArg(tuple(a.tolist()))
    return TensorArg(tuple(a.shape), a.dtype)


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Any, ...]
    # what rank 0 ran since the last call, run first: n = slot 0's commit(n), (slot, n) another
    # slot's, (DRAFT, *args) a draft chain's other side, (END, slot) a slot's request's end
    commits: tuple = ()
    slot: int = 0           # the sequence (slot) the call acts on

    def header(self) -> bytes:
        return pickle.dumps((self.name, self.args, self.commits, self.slot), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def of(name: str, *args: Any, commits: tuple = (), slot: int = 0) -> tuple["Call", list[torch.Tensor]]:
        """The call and its tensor arguments (rank 0)."""
        plain = tuple(_plain(a) for a in args)
        tensors = [a.ids if isinstance(a, SharedIds) else a for a, p in zip(args, plain)
                   if isinstance(p, (TensorArg, SharedIdsArg))]
        return Call(name, plain, commits, slot), tensors

    @staticmethod
    def parse(header: bytes) -> "Call":
        return Call(*pickle.loads(header))


class RankExecutor:
    """Runs one call on this rank's shard. Rank 0 passes the tensors; the other ranks receive them
    through the broadcast here, so the same code path runs everywhere."""

    def __init__(self, comm: Comm, trunk: LocalTrunk):
        self.comm, self.trunk = comm, trunk
        self.slots: list[LocalTrunk] = [trunk]      # this rank's shard of every slot's sequence state
        self.counts = dict.fromkeys(STAT_NAMES, 0)
        self._no_ids: dict[int, torch.Tensor] = {}
        self._draft = None                  # parallel/draft.py WorkerDraft, made on the first chain

    def _arg(self, a: Any, given: list[torch.Tensor] | None) -> Any:
        if isinstance(a, SharedIdsArg):     # rank 0: its device ids; elsewhere zeros the forward replaces
            if given is not None:
                return given.pop(0)
            z = self._no_ids.get(a.n)
            if z is None:
                z = self._no_ids[a.n] = torch.zeros(a.n, dtype=torch.int64, device=self.comm.device)
            return z
        if isinstance(a, IdsArg):           # every rank, rank 0 included, builds the same tensor
            return torch.tensor(a.ids, dtype=torch.int64, device=self.comm.device)
        if not isinstance(a, TensorArg):
            return a
        t = given.pop(0).contiguous() if given is not None else torch.empty(a.shape, dtype=a.dtype,
                                                                             device=self.comm.device)
        return self.comm.broadcast(t)

    @torch.inference_mode()
    def commit(self, n: int, slot: int = 0) -> None:
        """commit(n), rank 0's own or riding in a header: straight to the slot's trunk (no call to build)."""
        self.counts["commit"] += 1
        self.slots[slot].commit(n)

    def end(self, slot: int) -> None:
        """The slot's request ended: its KV blocks go back to this rank's pool."""
        self.counts[END] += 1
        self.slots[slot].end()

    def pool_stats(self) -> list[int]:
        """Blocks in use in this rank's KV pool and a digest of its free list and every slot's
        block table (equal on every rank while the ranks take and free alike)."""
        pool = self.trunk.kv_pool
        if pool is None:
            return [0, 0]
        tables = [s.state.table.blocks for s in self.slots]
        return [pool.used, zlib.crc32(repr((pool.free, tables)).encode())]

    def new_slot(self) -> list[int]:
        """Every rank allocates its shard of one more slot's state; if any rank runs out of memory
        every rank drops it (so the slots stay alike). Every rank's flag (1: allocated)."""
        try:
            view = self.trunk.view()
        except torch.OutOfMemoryError:
            view = None
        flags = self.comm.agree(int(view is not None))
        if all(flags):
            self.slots.append(view)
        elif torch.cuda.is_available():
            del view
            torch.cuda.empty_cache()
        return flags

    def packed(self, slots: tuple[int, ...], pos: tuple[int, ...], counts: tuple[int, ...],
               ids: torch.Tensor) -> list:
        """The verifies of `slots` (rows `counts` of `ids` each, at `pos`) in one forward of this
        rank's shard over their states (LocalTrunk.verify_packed)."""
        n = self.counts
        n[PACKED] += 1
        n["verify_rows"] += ids.shape[0]
        n["max_verify_rows"] = max(n["max_verify_rows"], ids.shape[0])
        trunks = [self.slots[s] for s in slots]
        with self.comm.captured():
            return trunks[0].verify_packed(trunks, list(ids.split(list(counts))), list(pos))

    @torch.inference_mode()
    def run(self, call: Call, tensors: list[torch.Tensor] | None = None) -> Any:
        given = list(tensors) if tensors is not None else None
        args = [self._arg(a, given) for a in call.args]
        if call.name == RANK_STATS:
            counts = [self.counts[k] for k in STAT_NAMES[:-2]] + self.pool_stats()
            mine = torch.tensor([counts], dtype=torch.int64, device=self.comm.device)
            return self.comm.gather(mine, dim=0)
        if call.name == RANK_TIME:
            from .probe import time_rows
            mine = torch.tensor([time_rows(self.trunk, *args, rank=self.comm.rank)], dtype=torch.float64,
                                device=self.comm.device)
            return self.comm.gather(mine.view(1, -1), dim=0)
        if call.name == DRAFT:
            if self._draft is None:
                from .draft import WorkerDraft
                self._draft = WorkerDraft(self.trunk.model, self.comm.draft_coll)
            return self._draft.run(*args)
        if call.name == NEW_SLOT:
            return self.new_slot()
        if call.name == PACKED:
            return self.packed(*args)
        if call.name not in CALLS:
            raise MeshError(f"unknown mesh call {call.name!r}")
        n = self.counts
        n[call.name] += 1
        if call.name == "verify":
            rows = args[0].shape[0]
            n["verify_rows"] += rows
            n["max_verify_rows"] = max(n["max_verify_rows"], rows)
        with self.comm.captured(call.name == "verify"):   # the rows forward: capturable collectives
            return getattr(self.slots[call.slot], call.name)(*args)


def serve(comm: Comm, trunk: LocalTrunk) -> None:
    """A worker's loop: run rank 0's calls until it says close."""
    ex = RankExecutor(comm, trunk)
    while True:
        call = Call.parse(comm.recv_command())
        if call.name == CLOSE:
            return
        _riders(ex, call.commits)
        ex.run(call)


def _riders(ex: RankExecutor, commits: tuple) -> None:
    """What rank 0 ran since the last call, in order: n = slot 0's commit(n), (slot, n) another
    slot's, (DRAFT, *args), (END, slot)."""
    for c in commits:
        if isinstance(c, int):
            ex.commit(c)
        elif isinstance(c[0], int):
            ex.commit(c[1], c[0])
        elif c[0] == END:
            ex.end(c[1])
        else:
            ex.run(Call(c[0], tuple(c[1:])))
