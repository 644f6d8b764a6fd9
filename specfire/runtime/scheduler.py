"""Continuous scheduling: requests join and leave at step boundaries, each running one engine step
in turn on its own slot (runtime/slots.py).

A round, at a step boundary: requests cancelled since the last one leave (their slots are free
again), waiting requests take free slots in arrival order, then every running request advances to
its next pause: a step staged up to its verify (its drafts made), one forward of its prefill (so a
long prompt does not stall the others), or a chunk of output. Then one packed forward runs every
staged verify (runtime/trunk.py verify_many: each weight read once for all the requests' rows,
each row computed as in its request's own forward), and each request goes on from its rows: the
accept, its commit, its next step staged (or the chunk it yields). When every slot is busy,
requests wait in arrival order; none is refused for memory.

Whoever waits for output drives (`drive_until`): the server's engine thread, or a caller of
LLM.generate / LLM.stream. One thread at a time runs rounds and delivers every request's events,
so a lone caller runs its request in its own thread with no hand-off, and callers on several
threads share the rounds.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

import torch

from ..errors import SpecfireError
from ..params import SamplingParams, SpecPolicy
from ..tokenizer import ChatIds
from .slots import SlotPool, request_blocks
from .spec import Chains, queue_chains
from .trunk import Verify, verify_many

if TYPE_CHECKING:
    from .engine import Engine, StreamChunk
    from .prefix import Fork
    from .route import RoutePlan
    from .trunk import Rows
    from .spec import OnCycle

log = logging.getLogger("specfire")

# event kinds passed to Request.on_event(kind, payload), in this order: STARTED once it holds a
# slot, CHUNK per streamed piece (a StreamChunk), then one of DONE (the last StreamChunk, whose
# `result` is set; a task's return value), ERROR (the exception), CANCELLED (None)
STARTED, CHUNK, DONE, ERROR, CANCELLED = "started", "chunk", "done", "error", "cancelled"


@dataclass(eq=False)
class Request:
    """One generation (or, with `task`, one call on a slot: LLM.score). `on_event` runs on the
    driving thread and must return quickly."""

    ids: list[int]
    params: SamplingParams | None
    spec: SpecPolicy | None
    on_event: Callable[[str, Any], None]
    plan: "RoutePlan | None" = None
    on_cycle: "OnCycle | None" = None
    task: "Callable[[Engine], Any] | None" = None
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    engine: "Engine | None" = None          # its slot, while it runs
    steps: "Generator[StreamChunk | Verify | Chains | None, Rows | None, None] | None" = None
    verify: "Verify | None" = None          # the verify forward its step waits for
    chain: "Chains | None" = None           # the draft chain its step left pending (queued with the round's)
    fork: "Fork | None" = None              # the prompt's prefill, shared with requests of the same prompt
    ends: tuple[int, ...] | None = None     # a chat prompt's turn ends (Engine.steps; None: those of ChatIds ids)
    over: bool = False                      # DONE, ERROR or CANCELLED was sent

    def __post_init__(self) -> None:
        if self.ends is None:
            self.ends = self.ids.ends if isinstance(self.ids, ChatIds) else ()


class Scheduler:
    """The requests of one model's slots: `submit` from any thread, `drive_until` to run rounds."""

    def __init__(self, pool: SlotPool):
        self.pool = pool
        dev = pool.first.trunk.device
        self.device = dev if dev.type == "cuda" else None
        self.cond = threading.Condition()   # reentrant: a generator finalised by the GC may cancel inside it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.driving = False                # a thread is running a round
        self.closed = False
        # called on the driving thread after every round (its events all sent): the engine process
        # batches a round's events into one message to the server (serve/engine.py)
        self.after_round: Callable[[], None] | None = None
        self.forwards = 0                   # verify forwards run, the verifies they held, the most in one
        self.verifies = 0
        self.widest = 0

    # ---- any thread -------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        with self.cond:
            if self.closed:
                raise SpecfireError("this LLM has been closed")
            self.waiting.append(req)
            self.cond.notify_all()
        return req

    def cancel_all(self) -> None:
        """Cancel every running and waiting request (each ends with CANCELLED at the next round)."""
        with self.cond:
            for r in [*self.waiting, *self.running]:
                r.cancel.set()
            self.cond.notify_all()

    def wake(self) -> None:
        """A request's cancel flag was set: let an idle driver see it."""
        with self.cond:
            self.cond.notify_all()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def drive_until(self, done: Callable[[], bool]) -> None:
        """Run rounds until `done()`. While another thread drives (it delivers this thread's events
        too) or there is nothing to run, wait."""
        with self.cond:
            while True:
                while not done() and (self.driving or not self.busy()):
                    self.cond.wait()
                if done():
                    return
                self._round_unlocked()

    def run_round(self) -> None:
        """One round now (after the one another thread is running, if any)."""
        with self.cond:
            while self.driving:
                self.cond.wait()
            self._round_unlocked()

    def _round_unlocked(self) -> None:
        """A round, called and returning with `cond` held (released while it runs)."""
        self.driving = True
        self.cond.release()
        try:
            if self.device is not None:         # whichever thread drives: the model's device is current
                with torch.cuda.device(self.device):
                    self.round()
            else:
                self.round()
        finally:
            try:
                if self.after_round is not None:
                    self.after_round()
            finally:
                self.cond.acquire()
            self.driving = False
            self.cond.notify_all()

    def close(self) -> None:
        """Refuse new requests, cancel the rest and run the rounds that end them."""
        with self.cond:
            self.closed = True
        self.cancel_all()
        self.drive_until(lambda: not self.busy())

    # ---- the driving thread -----------------------------------------------------------------------
    def round(self) -> None:
        """One step boundary: leave, join, then one step of every running request."""
        for r in [r for r in self.running if r.cancel.is_set()]:
            self._end(r, CANCELLED, None)
        if self.waiting:                    # (read unlocked: a request submitted meanwhile joins next round)
            with self.cond:
                gone = [r for r in self.waiting if r.cancel.is_set()]
                for r in gone:
                    self.waiting.remove(r)
            for r in gone:
                self._send(r, CANCELLED, None)
            self._join()
        t0 = time.perf_counter()
        for r in list(self.running):
            if r.verify is None:
                self._advance(r, None)
        waiting = [r for r in self.running if r.verify is not None]
        if waiting:                         # one packed forward for every running request's verify
            calls = [r.verify for r in waiting]
            clean = len(waiting) == len(self.running)     # no prefill piece or chunk-only step in this round
            for r in waiting:
                r.verify = None
            try:
                rows = verify_many(calls)
            except Exception as e:          # the forward failed: every request in it fails, the rest go on
                log.exception("a packed verify forward failed")
                for r in waiting:
                    self._end(r, ERROR, e)
                return
            self.forwards += 1
            self.verifies += len(calls)
            self.widest = max(self.widest, len(calls))
            view = self.pool.first.shared.round    # (one model: every slot's engine shares it)
            view.width = len(calls)
            for r, got in zip(waiting, rows):
                self._advance(r, got)
            chained = [r for r in waiting if r.chain is not None]
            drafted = [(c.route, c.ids.shape[0] - 1) for c in calls]      # each verify's (route, k)
            pending = [d for r, d in zip(waiting, drafted) if r.chain is not None]
            packed = [r.chain is not None and pending.count(d) > 1 for r, d in zip(waiting, drafted)]
            if chained:                     # the draft chains those steps left pending: one packed chain
                items = [r.chain for r in chained]
                for r in chained:
                    r.chain = None
                try:
                    queue_chains(items)
                except Exception as e:
                    log.exception("a packed draft chain failed")
                    for r in chained:
                        self._end(r, ERROR, e)
                    return
                for r in chained:
                    self._advance(r, None)
            if clean:                       # what the round cost, for auto's price of drafting under sharing
                view.seconds = time.perf_counter() - t0
                view.members = tuple((r, k, p) for (r, k), p in zip(drafted, packed))
        self._send_reads()

    def _send_reads(self) -> None:
        """Queue the host copy of every step this round launched: one per model's slots, read next
        round (a step read before that sends its batch itself)."""
        sent = set()
        for r in self.running:
            reads = r.engine.bufs.reads
            if id(reads) not in sent:
                sent.add(id(reads))
                reads.send()

    def _join(self) -> None:
        """Waiting requests take free slots, in arrival order (the head waits for the next free one)."""
        while True:
            with self.cond:
                if not self.waiting:
                    return
                head = self.waiting[0]
            eng = self.pool.acquire(self._blocks(head))     # may build a slot: outside the lock
            if eng is None:
                return
            with self.cond:                 # only the driving thread takes from `waiting`
                self.waiting.popleft()
                self.running.append(head)
            head.engine = eng
            if head.task is None:
                head.steps = eng.steps(head.ids, head.params, head.spec, on_cycle=head.on_cycle, plan=head.plan,
                                       fork=head.fork, ends=head.ends or ())
            self._send(head, STARTED, None)

    def _blocks(self, r: Request) -> int:
        """The KV blocks a request may reach (a task: the whole max_seq)."""
        first = self.pool.first
        if r.task is not None or r.params is None:
            return request_blocks(first.max_seq, 0, None)
        return request_blocks(first.max_seq, len(r.ids), r.params.max_tokens)

    def _advance(self, r: Request, rows: "Rows | None") -> None:
        """Run the request to its next pause: `rows` answers the verify it waits for (None: it
        waits for none). A `Verify` it yields waits for this round's packed forward, or the next."""
        if r.task is not None:
            try:
                value = r.task(r.engine)
            except BaseException as e:
                self._end(r, ERROR, e)
                if not isinstance(e, Exception):
                    raise
                return
            self._end(r, DONE, value)
            return
        try:
            chunk = r.steps.send(rows)
        except StopIteration:
            self._end(r, ERROR, SpecfireError("the generation ended without a result"))
            return
        except BaseException as e:          # the request fails, the others go on (an interrupt goes up)
            if isinstance(e, Exception):
                log.exception("request failed")
            self._end(r, ERROR, e)
            if not isinstance(e, Exception):
                raise
            return
        if isinstance(chunk, Verify):
            r.verify = chunk
            return
        if isinstance(chunk, Chains):
            r.chain = chunk
            return
        if chunk is None:                   # between prefill forwards
            return
        if chunk.result is not None:
            self._end(r, DONE, chunk)
        else:
            self._send(r, CHUNK, chunk)

    def _end(self, r: Request, kind: str, payload: Any) -> None:
        """Close the request's stream (work it queued is dropped unread), free its slot, tell it."""
        if r.steps is not None:
            try:
                r.steps.close()
            except Exception:
                log.exception("closing a request's stream failed")
        with self.cond:
            if r in self.running:
                self.running.remove(r)
        if r.engine is not None:
            self.pool.release(r.engine)
        r.engine, r.steps, r.verify, r.chain = None, None, None, None
        self._send(r, kind, payload)

    @staticmethod
    def _send(r: Request, kind: str, payload: Any) -> None:
        try:
            r.on_event(kind, payload)
        except Exception:                   # a listener's bug must not stop the other requests
            log.exception("a request's event handler failed")
        if kind in (DONE, ERROR, CANCELLED):
            r.over = True                   # after the handler: a waiter that sees it finds the payload


# ---- the caller's side ------------------------------------------------------------------------------

def follow(sched: Scheduler, req: Request) -> Iterator["StreamChunk"]:
    """Submit `req` (its on_event is replaced) and yield its chunks as they come, driving the rounds
    while waiting; the last chunk carries the result. Leaving early cancels it."""
    box: deque[tuple[str, Any]] = deque()
    req.on_event = lambda kind, payload: box.append((kind, payload))
    sched.submit(req)
    try:
        while True:
            sched.drive_until(lambda: bool(box))
            kind, payload = box.popleft()
            if kind == CHUNK:
                yield payload
            elif kind == DONE:
                yield payload
                return
            elif kind == ERROR:
                raise payload
            elif kind == CANCELLED:
                raise SpecfireError("the request was cancelled: the LLM was closed")
    finally:
        if not req.over:                    # the next round ends it (no lock here: this may run in a GC pass)
            req.cancel.set()


def run_all(sched: Scheduler, reqs: list[Request]) -> list[Any]:
    """Submit `reqs` in order and drive until every one has ended; their DONE payloads, in order.
    The first failure is raised once all have ended (an interrupt cancels the rest)."""
    out: list[Any] = [None] * len(reqs)
    errors: list[BaseException | None] = [None] * len(reqs)

    def handler(i: int) -> Callable[[str, Any], None]:
        def on_event(kind: str, payload: Any) -> None:
            if kind == DONE:
                out[i] = payload
            elif kind == ERROR:
                errors[i] = payload
            elif kind == CANCELLED:
                errors[i] = SpecfireError("the request was cancelled: the LLM was closed")
        return on_event

    for i, r in enumerate(reqs):
        r.on_event = handler(i)
        sched.submit(r)
    try:
        sched.drive_until(lambda: all(r.over for r in reqs))
    finally:
        if not all(r.over for r in reqs):
            for r in reqs:
                r.cancel.set()
    for e in errors:
        if e is not None:
            raise e
    return out
