"""One engine, one thread: requests run to completion in arrival order.

The engine keeps a single sequence state and is not re-entrant, so every generation goes through
this worker's FIFO queue; callers get events through a callback and cancel by setting an Event,
which the worker checks before a job starts and after every engine step (a cancelled request's
state is simply reset by the next request's prefill)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..config import SamplingParams, SpecPolicy
from ..report import RequestFigures
from .metrics import Metrics

if TYPE_CHECKING:
    from ..api import LLM, GenerationResult
    from ..runtime.route import RoutePlan

log = logging.getLogger("specfire")

# event kinds passed to Job.on_event(kind, payload)
CHUNK, DONE, ERROR, CANCELLED = "chunk", "done", "error", "cancelled"


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


class EngineWorker:
    def __init__(self, llm: "LLM", metrics: Metrics | None = None):
        self.llm = llm
        self.metrics = metrics
        self.q: queue.Queue[Job | None] = queue.Queue()
        self.current: Job | None = None
        self.thread = threading.Thread(target=self._loop, name="specfire-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        if self.metrics:
            self.metrics.queued()
        self.q.put(job)
        return job

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def cancel_all(self) -> None:
        """Cancel the running request and every queued one (they end with a CANCELLED event)."""
        with self.q.mutex:
            queued = [j for j in self.q.queue if j is not None]
        cur = self.current
        for job in queued + ([cur] if cur is not None else []):
            job.cancel.set()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel the running request and every queued one, then stop the thread."""
        self.cancel_all()
        self.q.put(None)
        self.thread.join(timeout)

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            if job.cancel.is_set():
                if self.metrics:
                    self.metrics.finished("abort", time.perf_counter() - job.arrived, None, started=False)
                job.on_event(CANCELLED, None)
                continue
            if self.metrics:
                self.metrics.started()
            self.current = job
            try:
                self._run(job)
            except BaseException as e:  # the server must outlive any one request
                log.exception("request failed")
                if self.metrics:
                    self.metrics.finished("error", time.perf_counter() - job.arrived, None)
                job.on_event(ERROR, e)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        m = self.metrics
        last_t = None
        stream = self.llm.stream(job.ids, job.params, job.spec, plan=job.plan)
        try:
            for chunk in stream:
                now = time.perf_counter()
                n = len(chunk.token_ids)
                n_gap = n
                if job.ttft_s is None and n:
                    job.ttft_s = now - job.arrived
                    if m:
                        m.first_token(job.ttft_s)
                    n_gap = 0
                if m and last_t is not None and n_gap > 0:
                    m.tokens_arrived(now - last_t, n_gap)
                last_t = now
                if chunk.result is not None:
                    fig = self.llm.figures(chunk.result, job.params)
                    if m:
                        m.finished(chunk.result.finish_reason, now - job.arrived, fig)
                    job.on_event(DONE, Finished(chunk.text, chunk.result, fig, job.ttft_s or 0.0))
                    return
                job.on_event(CHUNK, chunk)
                if job.cancel.is_set():
                    if m:
                        m.finished("abort", now - job.arrived, None)
                    job.on_event(CANCELLED, None)
                    return
        finally:
            stream.close()
