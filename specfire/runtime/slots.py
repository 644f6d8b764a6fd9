"""Slots: one engine per running request, over one loaded model.

A slot is an `Engine` whose trunk is a view of the model (weights shared, its own sequence state:
Gated DeltaNet states, conv windows, KV rows; its own CUDA graphs) with its own drafters (the MTP
head's weights shared, its own KV cache; its own n-gram index) and step buffers (staging,
penalties, random stream). The slots' engines share `Engine.shared` (auto's cycle costs and
acceptance, the prefix cache). A request owns a slot from its prefill to its end; `begin()` resets
the state for the next one, so a slot is reused, never rebuilt.

Slots are built on demand up to `limit` (max_num_seqs). On one device the slots' KV rows live in
one pool of blocks (model/kvpool.py) that the KV budget sizes (`pool_blocks`): a request is let in
when the pool can promise it the blocks it may reach (`request_blocks`: its prompt, max_tokens and
the drafts' reach), else it waits in arrival order; the blocks are taken as it grows and given back
when it ends. A mesh pages the same way: every rank's slots share one pool of its shard of the KV
heads, sized by the budget per rank (rank 0's blocks hold the MTP head's KV too, so its budget buys
the fewest and every rank hands out that many), and rank 0's pool, alike on every rank
(parallel/control.py), is the one admission reserves on. A topology without a fork has one slot.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..config import FULL, ModelConfig
from ..model.kvpool import SINK, KvPool, blocks_for
from ..model.state import SequenceState
from ..params import MAX_SPEC_K, check_max_num_seqs
from .engine import Engine

log = logging.getLogger("specfire")

# the device share the model and the slots may fill when no budget is given (vLLM's
# gpu_memory_utilization default): the rest is left to activations, graphs and other processes
GPU_MEMORY_SHARE = 0.9
MAX_NUM_SEQS_GPU = 8     # the first concurrency target (without a budget the pool holds 8 x max_seq)
MAX_NUM_SEQS_CPU = 4     # requests share the CPU's cores one step at a time: more slots only divide them


def default_max_num_seqs(device: torch.device) -> int:
    return MAX_NUM_SEQS_GPU if device.type == "cuda" else MAX_NUM_SEQS_CPU


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def state_bytes(cfg: ModelConfig, max_seq: int, kv_dtype: torch.dtype, mtp: bool, share=None,
                kv: bool = True) -> int:
    """Bytes of one slot's sequence state (the trunk's and, with `mtp`, the MTP head's KV cache),
    from the config, max_seq and the KV dtype: the same allocation a slot makes, laid out on the
    meta device (no memory). Step buffers, rows logs and graph pools are not counted. `share`: a
    mesh rank's heads (its `n_kv`, `n_v_heads`, `conv_dim`): that rank's shard of the trunk's state.
    `kv` False: without the KV rows (a slot whose KV is in the pool: its recurrent state only)."""
    meta = torch.device("meta")
    heads = {} if share is None else dict(n_kv=share.n_kv, n_v_heads=share.n_v_heads, conv_dim=share.conv_dim)
    states = [SequenceState.allocate(cfg, cfg.layer_types, max_seq, meta, kv_dtype, **heads)]
    if mtp:
        states.append(SequenceState.allocate(cfg, (FULL,), max_seq, meta, kv_dtype))
    total = 0
    for st in states:
        if st.book is not None:
            total += _bytes(st.book.rec) + _bytes(st.book.conv)
        if kv:
            total += st.table.pool.nbytes()
    return total


def block_bytes(heads: list[int], head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of a KV pool of these layers (every layer's K, V and scales)."""
    return KvPool(heads, head_dim, SINK + 1, torch.device("meta"), kv_dtype).nbytes() // (SINK + 1)


def pool_blocks(per_block: int, max_seq: int, max_num_seqs: int, budget: int | None, device: torch.device) -> int:
    """Blocks of a KV pool: `budget` bytes' worth (at least one whole max_seq sequence); without a
    budget max_num_seqs whole sequences, on a GPU no more than leave (1 - GPU_MEMORY_SHARE) of it free."""
    one = blocks_for(max_seq) + SINK
    if per_block == 0:              # no attention layer: the pool holds nothing
        return max_num_seqs * blocks_for(max_seq) + SINK
    if budget is not None:
        if budget < one * per_block:
            raise ValueError(f"kv_cache_memory_bytes {budget} is less than one sequence's state, {one * per_block} "
                             f"bytes of KV at max_seq_len {max_seq} (lower max_seq_len or raise the budget)")
        return budget // per_block
    n = max_num_seqs * blocks_for(max_seq) + SINK
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = int(GPU_MEMORY_SHARE * total) - (total - free)
        n = max(one, min(n, room // per_block))
    return n


def request_blocks(max_seq: int, prompt: int, max_tokens: int | None) -> int:
    """Blocks a request may reach: its prompt, its output and what drafts and the MTP head's chain
    write past them (None: a call over the whole max_seq)."""
    if max_tokens is None:
        return blocks_for(max_seq)
    return blocks_for(min(max_seq, prompt + max_tokens + 2 * MAX_SPEC_K + 2))


class SlotPool:
    """The slots of one model: `acquire` a free one (building it when under the limit and the
    budget), `release` it when its request ends. `first` is the engine LLM built; `first.fork`
    makes the others (None: the topology holds one sequence, so the pool has one slot)."""

    def __init__(self, first: Engine, max_num_seqs: int, slot_bytes: int, budget: int | None = None):
        check_max_num_seqs(max_num_seqs)
        self.kv: KvPool | None = getattr(first.trunk, "kv_pool", None)
        if self.kv is not None:         # the budget sized the pool: slots are bounded by max_num_seqs
            budget = None
        if budget is not None and budget < slot_bytes:
            raise ValueError(f"kv_cache_memory_bytes {budget} is less than one sequence's state, {slot_bytes} "
                             f"bytes at max_seq_len {first.max_seq} (lower max_seq_len or raise the budget)")
        self.first = first
        self.engines: list[Engine] = [first]
        self.free: list[Engine] = [first]
        self.slot_bytes = slot_bytes
        self.budget = budget
        self.asked = max_num_seqs
        by_budget = max_num_seqs if budget is None else budget // slot_bytes
        self.limit = 1 if first.fork is None else max(1, min(max_num_seqs, by_budget))
        self.why = ""                   # why the limit is below what was asked (one line; empty if not)
        if first.fork is None and max_num_seqs > 1:
            self.why = f"the {first.topology} topology holds one sequence"
        elif self.limit < max_num_seqs:
            self.why = f"kv_cache_memory_bytes {budget} holds {self.limit} sequence states of {slot_bytes} bytes"
        self.lock = threading.Lock()
        self.reserved: dict[int, int] = {}      # id(engine) -> blocks its request was promised

    @property
    def busy(self) -> int:
        return len(self.engines) - len(self.free)

    @property
    def usage(self) -> float:
        """The share of KV in use: the pool's blocks taken (a mesh: rank 0's pool), else the busy slots' share."""
        if self.kv is not None:
            return self.kv.used / self.kv.capacity
        return self.busy / self.limit

    def acquire(self, blocks: int = 0) -> Engine | None:
        """A free slot whose request the pool promises `blocks` KV blocks, or None when every slot
        is busy and no other fits, or the pool cannot promise them yet (the request waits)."""
        if self.kv is not None and not self.kv.reserve(blocks):
            return None
        eng = self._slot()
        if eng is None:
            if self.kv is not None:
                self.kv.unreserve(blocks)
        else:
            self.reserved[id(eng)] = blocks
        return eng

    def _slot(self) -> Engine | None:
        with self.lock:
            if self.free:
                return self.free.pop()
            if len(self.engines) >= self.limit or not self._fits():
                return None
        try:
            eng = self.first.fork()
        except torch.OutOfMemoryError:
            with self.lock:      # the device is fuller than the budget said: stay at this many slots
                self.limit = len(self.engines)
                self.why = f"the device ran out of memory building slot {self.limit + 1}"
            log.warning("no memory for another sequence slot: serving %d at a time", self.limit)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
        with self.lock:
            self.engines.append(eng)
        return eng

    def _fits(self) -> bool:
        """Without a budget, a GPU slot must leave (1 - GPU_MEMORY_SHARE) of the device free."""
        dev = self.first.trunk.device
        if self.budget is not None or dev.type != "cuda":
            return True
        free, total = torch.cuda.mem_get_info(dev)
        if total - free + self.slot_bytes <= GPU_MEMORY_SHARE * total:
            return True
        self.limit = len(self.engines)
        self.why = f"slot {self.limit + 1} would fill more than {GPU_MEMORY_SHARE:.0%} of the device's memory"
        log.warning("%s: serving %d sequences at a time", self.why, self.limit)
        return False

    def release(self, eng: Engine) -> None:
        """The slot's request ended: its KV blocks go back to the pool, its promise is dropped."""
        eng.trunk.end()
        if self.kv is not None:
            self.kv.unreserve(self.reserved.pop(id(eng), 0))
        with self.lock:
            if eng not in self.free:
                self.free.append(eng)
