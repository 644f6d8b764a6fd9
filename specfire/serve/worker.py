"""The engine thread: it drives the model's scheduler (runtime/scheduler.py) while any request runs
or waits, so concurrent requests each get their own slot and stream at once (more than
max_num_seqs wait in arrival order).

Callers get events through a callback, called on this thread, and cancel by setting an Event,
which the scheduler checks at every step boundary (a cancelled request leaves its slot there; a
queued one never starts)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..params import SamplingParams, SpecPolicy
from ..report import RequestFigures
from ..runtime import scheduler as sch
from .metrics import Metrics

if TYPE_CHECKING:
    from ..runtime.prefix import Fork
    from ..api import LLM, GenerationResult
    from ..runtime.route import RoutePlan

log = logging.getLogger("specfire")

# event kinds passed to Job.on_event(kind, payload)
STARTED, CHUNK, DONE, ERROR, CANCELLED = sch.STARTED, sch.CHUNK, sch.DONE, sch.ERROR, sch.CANCELLED


@dataclass
class Finished:
    """The DONE payload: the last chunk's text, the result and its figures."""

    text: str
    result: "GenerationResult"
    figures: RequestFigures
    ttft_s: float


@dataclass
class Job:
    ids: list[int]
    params: SamplingParams
    spec: SpecPolicy
    on_event: Callable[[str, Any], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    plan: "RoutePlan | None" = None     # the route decided when the request was checked (else decided here)
    started: bool = False               # it holds a slot (or did)
    fork: "Fork | None" = None          # the prompt's prefill shared with the request's other choices


class EngineWorker:
    """The engine in a thread of this process, over an LLM object (the Python API, tests); the
    CLI server runs it in a process of its own instead (client.EngineClient, the same interface)."""

    def __init__(self, llm: "LLM", metrics: Metrics | None = None):
        self.llm = llm
        self.metrics = metrics
        self.sched = llm.scheduler
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="specfire-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        if self.metrics:
            self.metrics.queued()
        on_event = listener(job, self.metrics, self._kv_share, self.llm.figures)
        self.sched.submit(sch.Request(job.ids, job.params, job.spec, on_event, plan=job.plan, cancel=job.cancel,
                                      arrived=job.arrived, fork=job.fork))
        return job

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _kv_share(self) -> float:
        pool = self.sched.pool
        return pool.usage

    def cancel_all(self) -> None:
        """Cancel the running requests and every queued one (they end with a CANCELLED event)."""
        self.sched.cancel_all()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel the running requests and every queued one, then stop the thread once they have ended."""
        self.cancel_all()
        self.stopping.set()
        self.sched.wake()
        self.thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                self.sched.drive_until(lambda: self.stopping.is_set() and not self.sched.busy())
                return
            except Exception:  # the server must outlive any one round
                log.exception("scheduler round failed")


def listener(job: Job, m: Metrics | None, kv_share: Callable[[], float],
             figures: Callable[["GenerationResult", SamplingParams], RequestFigures]) -> Callable[[str, Any], None]:
    """The scheduler's events of `job` -> metrics and the job's own events (on the thread that
    delivers them: the engine thread, or the engine process's reader)."""
    last_t: list[float | None] = [None]

    def on_event(kind: str, payload: Any) -> None:
        now = time.perf_counter()
        if m and kind != CHUNK:
            m.kv_used(kv_share())
        if kind == sch.STARTED:
            job.started = True
            if m:
                m.started()
            return
        if kind == CHUNK or kind == DONE:
            n = n_gap = len(payload.token_ids)
            if job.ttft_s is None and n:
                job.ttft_s = now - job.arrived
                if m:
                    m.first_token(job.ttft_s)
                n_gap = 0
            if m and last_t[0] is not None and n_gap > 0:
                m.tokens_arrived(now - last_t[0], n_gap)
            last_t[0] = now
        if kind == CHUNK:
            job.on_event(CHUNK, payload)
        elif kind == DONE:
            fig = figures(payload.result, job.params)
            if m:
                m.finished(payload.result.finish_reason, now - job.arrived, fig)
            job.on_event(DONE, Finished(payload.text, payload.result, fig, job.ttft_s or 0.0))
        elif kind == ERROR:
            if m:
                m.finished("error", now - job.arrived, None, started=job.started)
            job.on_event(ERROR, payload)
        elif kind == CANCELLED:
            if m:
                m.finished("abort", now - job.arrived, None, started=job.started)
            job.on_event(CANCELLED, None)

    return on_event
