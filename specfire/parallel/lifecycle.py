"""Faults and teardown of a mesh, on rank 0.

The forward's collectives have a bounded timeout (SPECFIRE_TP_TIMEOUT seconds, default 60), rank 0
checks that its local workers are alive before every call, and the first failure closes the mesh
and raises MeshError naming the rank. Workers exit when their parent dies (parallel/worker.py).
"""
from __future__ import annotations

import os
import time

import torch

from ..errors import MeshError, SpecfireError
from . import comm as comm_mod
from .comm import Comm
from .control import CLOSE, Call
from .launch import JOIN_S, TIMEOUT_ENV, LocalWorker


class Mesh:
    """Processes and groups of one mesh; tears them down exactly once. Holds no reference to the
    trunk, so it can be the trunk's finalizer."""

    def __init__(self, comm: Comm, created: bool, workers: list[LocalWorker], store: str | None,
                 threads_before: int | None, timeout_s: float):
        self.comm, self.created = comm, created
        self.timeout_s = timeout_s
        self.workers = workers
        self.store = store
        self.threads_before = threads_before
        self.error: str | None = None
        self.closed = False

    def check(self) -> None:
        if self.error is not None:
            raise MeshError(f"the tensor-parallel mesh failed earlier and is closed: {self.error}")
        if self.closed:
            raise SpecfireError("this LLM has been closed")
        for w in self.workers:
            if not w.is_alive():
                raise self.fail(None)

    def fail(self, exc: BaseException | None) -> MeshError:
        """Name what went wrong, close the mesh, return the error to raise."""
        deadline = time.monotonic() + 1.0     # a killed worker may need a moment to be reaped
        dead = []
        while True:
            dead = [w for w in self.workers if not w.is_alive()]
            if dead or time.monotonic() > deadline or exc is None:
                break
            time.sleep(0.02)
        if dead:
            w = dead[0]
            msg = f"tensor-parallel worker rank {w.rank} (pid {w.pid}) died with exit code {w.exitcode}"
        elif exc is not None and ("timed out" in str(exc).lower() or "timeout" in str(exc).lower()):
            msg = (f"a tensor-parallel rank did not answer within {self.timeout_s:g} s "
                   f"({TIMEOUT_ENV}); it is hung or too slow")
        else:
            first = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else type(exc).__name__
            msg = f"a tensor-parallel collective failed: {first}"
        self.error = msg
        self.teardown(graceful=False)
        return MeshError(msg)

    def shutdown(self) -> None:
        """close(), garbage collection and interpreter exit all end here."""
        if not self.closed:
            self.teardown(graceful=self.error is None)

    def teardown(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.comm.send_command(Call(CLOSE, ()).header())
            except Exception:
                graceful = False
        for w in self.workers:
            w.join(JOIN_S if graceful else 0.0)
            w.kill()
            w.close()
        comm_mod.shutdown(self.comm, self.created)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self.store is not None and os.path.exists(self.store):
            os.unlink(self.store)
