"""The cross-rank tree of a row-parallel projection, the residual add and the next RMSNorm in one
kernel (CUDA rows forward: decode and verify rows).

Why: on a tp2 mesh each row-parallel projection (o_proj, out_proj, down_proj) was followed by
three launches: its subtree, torch's one-shot all-reduce (an entry barrier with the peer, then the
peer's buffer read over NVLink) and add_rms_norm; 131 all-reduces cost ~0.95 ms of a 9.3 ms tp2
step on 2 x H200. Here the producer (kernels/splitk/loop.py gemv_tree_loop, or `push_rows`) writes
its float32 subtree into slot `rank` of every rank's buffer and bumps a counter on each peer; this
kernel waits for its own counter, adds the W slots in the canonical tree (kernels/splitk tree_sum:
((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))), rounds to the model dtype, adds the residual and applies the
RMSNorm, writing both the new residual and the normed row: one launch and local reads only.

Bits: every degree (one device in the canonical mode included, W = 1) runs this one compiled
kernel: W, M and the wait target are runtime values (never specialised), so the norm's sum of
squares is reduced in the same order on every degree. The result equals `tree_add_rms_norm_ref`
up to that float32 reduction order (the norm's), like kernels/small/kernel.py's norms.

Measured (27B, 2 x H200, docs/BENCHMARKS.md "Sixth wave"): tp2 at the same speed as the
three-launch path and the same bits; the consumer's own work (4.45 us: eight masked slots spill
registers) and the producer's system-scope signal (~2.9 us) eat what the collective saved. Two
variants, built and tested on the CPU, not yet measured on a mesh: SPECFIRE_TREE_NORM=ll (each
value travels with its epoch flag in one 8-byte word: no fence, no counter; the consumer polls
the flags; sync word 1 is the buffer's epoch) and SPECFIRE_TREE_NORM_FOLD=1 (the consumer folds
the slots in a loop).

The sync words of a buffer slot (int32, in symmetric memory): [arrivals, consumers done, timed
out (sticky: a wait that gave up, ~2^26 polls, skips later waits on it), unused]. The last
of the M row programs to finish resets both; a peer writes this slot again only two calls later,
after this kernel has finished (each rank runs producer -> consumer in stream order, and a peer's
next producer waits, through its consumer, for this rank's next producer).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..norm.ref import add_rms_norm_ref
from .ref import tree_stack


def low_latency(x: torch.Tensor) -> bool:
    """SPECFIRE_TREE_NORM=ll (CUDA): the slots travel as 8-byte (value, flag) words and the consumer
    polls the flags (no fence or counter in the producer). Every degree then takes the LL consumer
    (one device and an eager mesh pack their float32 slots with flag 0 and do not wait)."""
    return x.is_cuda and ll_mode()


def ll_mode() -> bool:
    return os.environ.get("SPECFIRE_TREE_NORM", "1") == "ll"


def enabled(x: torch.Tensor) -> bool:
    """Whether a rows forward over x leaves its row-parallel sums to the fused kernel: on CUDA
    unless SPECFIRE_TREE_NORM=0 (the three-launch path, which benchmarks compare), on the CPU only
    with SPECFIRE_TREE_NORM=force (the mesh's flow checked on the CPU: the slots are then added
    by the reference, the same bits as the unfused path). Read when a forward runs, so a captured
    graph keeps what it captured."""
    v = os.environ.get("SPECFIRE_TREE_NORM", "1")
    return v == "force" or (x.is_cuda and v != "0")


@dataclass
class Push:
    """Where a producer sends its [M, N] float32 subtree: slot `rank` of every rank's buffer
    (`bufs`: int64 device addresses of each rank's [W, M, N] block), then one release-add on every
    peer's arrival word (`sigs`: int64 device addresses). `target` (arrivals the consumer waits
    for) is set by the producer that launches (programs that push, times W - 1)."""

    bufs: torch.Tensor
    sigs: torch.Tensor
    rank: int
    world: int
    target: int = 0
    ll: bool = False          # low-latency words: `bufs` lists every rank (this one too), `sigs` is the epoch word


@dataclass
class Pending:
    """A row-parallel sum not yet combined: `parts` [W, M, N] float32 (slot r: rank r's subtree),
    `sync` this buffer's two int32 sync words when the slots arrive by push (None: all present)."""

    parts: torch.Tensor
    sync: torch.Tensor | None = None
    target: int = 0
    ll: bool = False          # parts are int64 (value, flag) words; wait (when sync) for this use's flags

    @classmethod
    def of(cls, parts: torch.Tensor) -> "Pending":
        """Float32 slots all present, in the form the forward's mode consumes."""
        if low_latency(parts):
            from .tree_norm_kernel import ll_pack
            return cls(ll_pack(parts), ll=True)
        return cls(parts)

    def add_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + tree(parts), rms_norm(x + tree(parts))) in x's dtype (CUDA)."""
        if self.ll:
            from .tree_norm_kernel import tree_add_rms_norm_ll
            return tree_add_rms_norm_ll(self.parts, x, w, eps, self.sync)
        from .tree_norm_kernel import tree_add_rms_norm
        return tree_add_rms_norm(self.parts, x, w, eps, self.sync, self.target)

    def combined(self) -> torch.Tensor:
        """The float32 canonical tree over the slots (the CPU's path: the caller adds and norms)."""
        return tree_stack(self.parts)


def tree_add_rms_norm_ref(parts: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the canonical tree over the W slots (float32), then add_rms_norm_ref."""
    return add_rms_norm_ref(x, tree_stack(parts), w, eps)


def push_rows(src: torch.Tensor, push: Push) -> None:
    """Send a subtree already in this rank's slot to every peer (producers that cannot push from
    their own epilogue); sets push.target."""
    from .tree_norm_kernel import push_rows as run
    run(src, push)
