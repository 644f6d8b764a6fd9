"""The host reads of the steps' results, batched per scheduler round.

Each step queues its (n, tokens) into a row of one device buffer shared by the slots of a model
(`put`); the scheduler ends a round with one copy of the rows to the host and one event (`send`),
so reading a round's steps waits on the device once, not once per request. A row read before its
batch was sent (a step read right after its own launch: the CPU, a direct `Engine.stream`) sends
the batch then, so any caller is served; only the timing differs. A greedy drafting step keeps
a copy of its own (runtime/spec.py `StepBuffers.send`): its draft chain is queued behind it, and
the round's copy, queued after every step's chain, would make its read wait for all of them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..params import MAX_SPEC_K


class Batch:
    """The rows queued between two sends; their host copy once sent, their values once read."""

    def __init__(self, reads: "RoundReads"):
        self.reads = reads
        self.rows = 0
        self.host: torch.Tensor | None = None       # where the copy lands (set by `send`)
        self.event: torch.cuda.Event | None = None
        self.values: list[list[int]] | None = None

    def row(self, i: int) -> list[int]:
        """Row i as a list (waits for the batch's copy the first time a row of it is read)."""
        if self.values is None:
            with self.reads.lock:
                if self.values is None:
                    if self.host is None:           # read before the round's send: send it now
                        self.reads.send()
                    self.reads.waits += 1
                    if self.event is not None:
                        self.event.synchronize()
                    self.values = self.host.tolist()
                    self.host = None                # (its buffer may take a later batch)
        return self.values[i]


@dataclass
class Ticket:
    """Where a step's result lands: row `row` of `batch`."""

    batch: Batch
    row: int

    def read(self) -> list[int]:
        return self.batch.row(self.row)


class RoundReads:
    """Rows of (n, tokens...) queued on the device, sent to the host a batch at a time. `ROWS` rows
    a batch at most (a full batch is sent at once); `BUFFERS` host buffers in turn, and one whose
    batch is still unread is read before it takes the next. Thread-safe: a direct `Engine.stream`
    on one slot may run beside the scheduler's rounds on the others."""

    ROWS = 32
    BUFFERS = 3

    def __init__(self, device: torch.device, width: int = MAX_SPEC_K + 2):
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self.dev = torch.zeros(self.ROWS, width, dtype=torch.long, device=self.device)
        self.host = [torch.zeros(self.ROWS, width, dtype=torch.long, pin_memory=pinned) for _ in range(self.BUFFERS)]
        self.holder: list[Batch | None] = [None] * self.BUFFERS
        self._turn = 0
        self.batch = Batch(self)
        self.lock = threading.RLock()
        self.sends = 0                              # batches sent and host waits on them (tests, benches)
        self.waits = 0

    def put(self, n: torch.Tensor, targets: torch.Tensor) -> Ticket:
        """Queue (n, targets...) of one step (n a 0-d or [1] tensor, targets [k+1], on the device)."""
        with self.lock:
            if self.batch.rows == self.ROWS:
                self.send()
            b = self.batch
            torch.cat([n.view(1), targets], out=self.dev[b.rows, :targets.shape[0] + 1])
            b.rows += 1
            return Ticket(b, b.rows - 1)

    def send(self) -> None:
        """Queue the copy of the rows put since the last send (nothing if none)."""
        with self.lock:
            b = self.batch
            if b.rows == 0:
                return
            self.batch = Batch(self)
            t = self._turn
            self._turn = (t + 1) % self.BUFFERS
            old = self.holder[t]
            if old is not None and old.values is None:
                old.row(0)                          # its buffer is about to be overwritten: read it first
            self.holder[t] = b
            host = self.host[t][:b.rows]
            host.copy_(self.dev[:b.rows], non_blocking=host.is_pinned())
            if host.is_pinned():
                b.event = torch.cuda.Event()
                b.event.record()
            b.host = host
            self.sends += 1
