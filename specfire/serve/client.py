"""The server's side of its engine process (serve/engine.py): EngineClient has EngineWorker's
interface (submit, alive, cancel_all, close), so the endpoints have one code path whichever runs
the engine. A reader thread takes each round's message and hands its events to the jobs, as the
engine thread does in-process; a job's cancel flag, once set, sends a Cancel. EOF on the pipe means
the engine died: every request in flight fails at once with a 500 naming it, and /health says 503."""
from __future__ import annotations

import argparse
import itertools
import logging
import subprocess
import sys
import threading
import weakref
from multiprocessing import Pipe
from typing import TYPE_CHECKING, Any, Callable

from ..errors import SpecfireError
from .metrics import Metrics
from .remote import Hello, RemoteModel, chunk_of, engine_env, rebuilt
from .worker import CHUNK, ERROR, STARTED, Job, listener

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from ..params import SamplingParams, SpecPolicy
    from ..runtime.prefix import Fork
    from ..runtime.route import RoutePlan

log = logging.getLogger("specfire")

STOP_JOIN_S = 30.0      # how long a stopping engine may take to end its requests and free the model


class EngineDied(RuntimeError):
    """The engine process exited while the server runs."""


class RemoteCancel(threading.Event):
    """A job's cancel flag that, set, tells the engine process (once, and only while the request
    has not ended: a relay sets every flag when its response is over)."""

    def __init__(self, client: "EngineClient", rid: int):
        super().__init__()
        self.client, self.rid = client, rid

    def set(self) -> None:
        if not self.is_set():
            super().set()
            if self.rid in self.client.jobs:
                self.client._send(("cancel", self.rid))


class EngineClient:
    def __init__(self, proc: subprocess.Popen, conn: "Connection", hello: Hello):
        self.proc, self.conn = proc, conn
        self.model = RemoteModel(hello, self.plan)
        self.metrics: Metrics | None = None
        self.send_lock = threading.Lock()
        self.jobs: dict[int, Callable[[str, Any], None]] = {}
        self.calls: dict[int, list[Any]] = {}           # qid -> [Event, plan, error]
        self.ids = itertools.count()
        self.fork_keys: weakref.WeakKeyDictionary["Fork", int] = weakref.WeakKeyDictionary()
        self.kv_share = 0.0
        self.died: EngineDied | None = None
        self.lock = threading.Lock()                    # jobs / calls against the reader's EOF
        self.reader = threading.Thread(target=self._read, name="specfire-engine-reader", daemon=True)
        self.reader.start()

    @staticmethod
    def start(args: argparse.Namespace) -> "EngineClient":
        """Start the engine process with the serve flags and wait until its model has loaded; a
        load failure is raised here as the error the engine process met."""
        ours, theirs = Pipe(duplex=True)
        proc = subprocess.Popen([sys.executable, "-m", "specfire.serve.engine", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), env=engine_env(), stdin=subprocess.DEVNULL)
        theirs.close()
        try:
            ours.send(args)
            msg = ours.recv()
        except (EOFError, OSError):
            proc.wait()
            ours.close()
            raise SpecfireError(f"the engine process exited with code {proc.returncode} while loading the "
                                f"model") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if msg[0] == "error":
            proc.wait()
            ours.close()
            raise rebuilt(*msg[1:])
        return EngineClient(proc, ours, msg[1])

    # ---- the interface the endpoints use ---------------------------------------------------------
    def attach(self, metrics: Metrics) -> "EngineClient":
        self.metrics = metrics
        return self

    def submit(self, job: Job) -> Job:
        rid = next(self.ids)
        job.cancel = RemoteCancel(self, rid)
        if self.metrics:
            self.metrics.queued()
        on_event = listener(job, self.metrics, lambda: self.kv_share, self.model.figures)
        fork = None
        if job.fork is not None:
            fork = self.fork_keys.setdefault(job.fork, rid)
        with self.lock:
            died = self.died
            if died is None:
                self.jobs[rid] = on_event
        if died is not None:
            on_event(ERROR, died)
            return job
        self._send(("submit", rid, job.ids, job.params, job.spec, job.plan, fork))
        return job

    @property
    def alive(self) -> bool:
        return self.died is None and self.proc.poll() is None

    def cancel_all(self) -> None:
        self._send(("cancel_all",))

    def close(self, timeout: float | None = STOP_JOIN_S) -> None:
        """Stop (running and queued requests end cancelled, the model is freed), wait, then kill."""
        self._send(("stop",))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop within %g s: killed", timeout)
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5.0)
        self.conn.close()

    def plan(self, params: "SamplingParams", spec: "SpecPolicy") -> "RoutePlan":
        """The route the engine process decides for a request (RemoteModel.plan_route)."""
        qid = next(self.ids)
        call: list[Any] = [threading.Event(), None, None]
        with self.lock:
            if self.died is not None:
                raise self.died
            self.calls[qid] = call
        self._send(("plan", qid, params, spec))
        call[0].wait()
        if call[2] is not None:
            raise call[2]
        return call[1]

    # ---- the pipe ---------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(msg)
        except (OSError, ValueError):     # the engine is gone: the reader's EOF fails what is in flight
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(msg)
            except Exception:
                log.exception("an engine message failed")
        self._lost()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "round":
            _, evs, self.kv_share = msg
            for rid, kind, payload in evs:
                on_event = self.jobs.get(rid)
                if on_event is None:
                    continue
                if kind == CHUNK:
                    payload = chunk_of(payload)
                elif kind == ERROR:
                    payload = rebuilt(*payload)
                if kind not in (CHUNK, STARTED):
                    self.jobs.pop(rid, None)
                on_event(kind, payload)
        elif msg[0] == "planned":
            _, qid, plan, err = msg
            call = self.calls.pop(qid, None)
            if call is not None:
                call[1], call[2] = plan, (rebuilt(*err) if err is not None else None)
                call[0].set()

    def _lost(self) -> None:
        """EOF: every request and route call in flight fails, naming the engine's exit."""
        rc = None
        try:
            rc = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        with self.lock:
            how = f"exited with code {rc}" if rc is not None else "closed its pipe"
            self.died = EngineDied(f"the engine process {how}")
            jobs, self.jobs = self.jobs, {}
            calls, self.calls = self.calls, {}
        for call in calls.values():
            call[2] = self.died
            call[0].set()
        for on_event in jobs.values():
            on_event(ERROR, self.died)
