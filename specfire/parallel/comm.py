"""Every collective the mesh uses, in one place (so a graph-capturable all-reduce can replace the
stock one without touching the model).

Two process groups: `group` carries the forward's tensors (NCCL on CUDA, gloo on the CPU) with a
bounded timeout, so a dead or hung rank surfaces as an error; `cmd_group` (gloo, CPU tensors)
carries rank 0's small commands, and a worker may wait on it for as long as the user is idle.

The all-reduce is deterministic: every rank gathers all partial sums and adds them in rank order,
so every rank holds bit-identical activations and a tp run reproduces itself. It is elementwise,
so a row's result never depends on how many rows travel with it (verify rows == decode rows).
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

CMD_BYTES = 512                   # one command header (length-prefixed), parallel/control.py
CMD_MAX = (1 << 16) - 1           # the longest header (a second broadcast carries what passes CMD_BYTES)
IDLE_TIMEOUT = datetime.timedelta(days=365)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Comm:
    """The mesh's collectives for one process (rank `rank` of `world`)."""

    def __init__(self, rank: int, world: int, group, cmd_group, start_group, device: torch.device):
        self.rank, self.world = rank, world
        self.group, self.cmd_group, self.start_group = group, cmd_group, start_group
        self.device = device
        self.symm = None                  # SymmCollectives once CUDA graphs are enabled (enable_graphs)
        self.draft_coll = None            # the sharded draft chain's collectives (parallel/draft.py)
        self.in_graph = False             # route the forward's collectives through self.symm

    def enable_graphs(self, capacity_bytes: int, draft_bytes: int = 0) -> None:
        """Route the rows forward's collectives through `captured()`: symmetric memory on CUDA
        (capturable), plain all-gathers on the CPU (the same code, another transport). The draft
        chain gets a symmetric buffer pair of its own (`draft_bytes`), allocated now on every rank:
        its graphs are captured while the other side may be mid-chain, never at a rendezvous."""
        from .symm import GlooCollectives, SymmCollectives

        if self.device.type == "cuda":
            self.symm = SymmCollectives(self.group, self.rank, self.world, self.device, capacity_bytes)
            if draft_bytes:
                self.draft_coll = SymmCollectives(self.group, self.rank, self.world, self.device, draft_bytes)
                self.draft_coll.prepare(torch.float32)
        else:
            self.symm = self.draft_coll = GlooCollectives(self.group, self.rank, self.world)

    @contextlib.contextmanager
    def captured(self, on: bool = True):
        """While active (and graphs enabled), collectives are the capturable symmetric-memory ones:
        the same results bit for bit, only the transport differs."""
        before = self.in_graph
        self.in_graph = on and self.symm is not None
        try:
            yield
        finally:
            self.in_graph = before

    # ---- forward collectives (on the device) ---------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over ranks, added in rank order in float32; identical on every rank."""
        if self.in_graph:
            return self.symm.sum(x)         # exact where it is used: one rank's rows plus zeros
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        out = parts[0].float()                       # a copy for bf16 / fp16, parts[0] itself for fp32
        if out.data_ptr() == parts[0].data_ptr():
            out = out.clone()
        for p in parts[1:]:
            out += p
        return out.to(x.dtype)

    def shared_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's token ids on every rank, inside the captured rows forward (the other ranks hold
        zeros there: control.SharedIdsArg); elsewhere every rank already has them."""
        if not self.in_graph:
            return ids
        return self.symm.share_ids(ids)

    def tree_buffer(self, m: int, n: int) -> torch.Tensor | None:
        """Where the next tree_all_reduce wants its [m, n] float32 subtree written (the collective's
        own buffer inside the captured forward, so no copy precedes it); None: anywhere."""
        if not self.in_graph:
            return None
        return self.symm.reserve(torch.float32, (m, n))

    def tree_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """float32 sum of every rank's float32 subtree `x`, added in the canonical pairwise tree
        (kernels/splitk: rank r's subtree is leaf r), so a tp-rank mesh adds exactly as one device
        does; identical on every rank. An all-gather then the tree (a ring all-reduce's order would
        depend on the degree)."""
        from ..kernels.splitk import tree_sum

        if self.in_graph:
            return self.symm.tree(x)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return tree_sum(parts)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenation of every rank's `x` along `dim` on rank 0; None elsewhere (on every rank
        inside a captured forward, where a gather to one rank is an all-gather)."""
        if self.in_graph:
            return torch.cat(list(self.symm.all_gather(x).unbind(0)), dim=dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (`x` is a same-shaped buffer on the others)."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    # ---- commands (CPU, gloo) ------------------------------------------------------------------
    def send_command(self, header: bytes) -> None:
        """One CMD_BYTES broadcast; a longer header (a packed verify of many slots with their riders)
        sends its tail in a second one, sized by the length the first carries."""
        n = len(header)
        if n > CMD_MAX:
            raise ValueError(f"mesh command header of {n} bytes exceeds {CMD_MAX}")
        head = CMD_BYTES - 2
        buf = torch.empty(CMD_BYTES, dtype=torch.uint8)          # only the first 2 + n bytes are read
        buf.numpy()[:2 + min(n, head)] = memoryview(n.to_bytes(2, "little") + header[:head])
        dist.broadcast(buf, src=0, group=self.cmd_group)
        if n > head:
            dist.broadcast(torch.frombuffer(bytearray(header[head:]), dtype=torch.uint8), src=0, group=self.cmd_group)

    def recv_command(self) -> bytes:
        buf = torch.empty(CMD_BYTES, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cmd_group)
        raw = buf.numpy()
        n, head = int(raw[0]) | int(raw[1]) << 8, CMD_BYTES - 2
        if n <= head:
            return raw[2:2 + n].tobytes()
        tail = torch.empty(n - head, dtype=torch.uint8)
        dist.broadcast(tail, src=0, group=self.cmd_group)
        return raw[2:].tobytes() + tail.numpy().tobytes()

    def agree(self, flag: int) -> list[int]:
        """Every rank's small integer flag on every rank, over the command group (rank 0's side
        bounded by the mesh timeout), between two calls."""
        t = torch.tensor([flag], dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.cmd_group)
        return [int(p) for p in parts]

    def exchange_flags(self, flag: int) -> list[int]:
        """Every rank's small integer flag (e.g. load succeeded), on every rank."""
        t = torch.tensor([flag], dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.start_group)
        return [int(p) for p in parts]


def init(rank: int, world: int, device: torch.device, timeout_s: float, init_method: str | None,
         start_timeout_s: float) -> tuple[Comm, bool]:
    """Join (or create) the process group and make the mesh's two groups. Returns the Comm and
    whether this call created the default group (and so must destroy it).

    The forward's group and rank 0's side of the command group time out after `timeout_s` (a gloo
    broadcast waits for every receiver); a worker waits for the next command indefinitely. The
    start-up exchange has its own group bounded by `start_timeout_s` (loading may take minutes)."""
    created = False
    backend = "nccl" if device.type == "cuda" else "gloo"
    start = datetime.timedelta(seconds=start_timeout_s)
    if device.type == "cuda":
        for k, v in NO_MULTICAST.items():   # NVLink multicast is off on our GPU machines
            os.environ.setdefault(k, v)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world,
                                timeout=start)
        created = True
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    cmd_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s) if rank == 0
                               else IDLE_TIMEOUT)
    start_group = dist.new_group(backend="gloo", timeout=start)
    return Comm(rank, world, group, cmd_group, start_group, device), created


def shutdown(comm: Comm, created: bool) -> None:
    """Destroy the groups this process made (best effort: peers may already be gone)."""
    try:
        dist.destroy_process_group(comm.start_group)
        dist.destroy_process_group(comm.cmd_group)
        dist.destroy_process_group(comm.group)
        if created:
            dist.destroy_process_group()
    except Exception:  # a failed mesh may leave a group half-torn; nothing more to free here
        pass
