"""The engine process of `specfire serve`: `python -m specfire.serve.engine FD`, started by the
server (serve/client.py) with a private socket pair, so the scheduler's rounds never share a GIL
with the HTTP event loop.

Messages in (pickled, on FD): the serve flags first, then ("submit", rid, ids, params, spec, plan,
fork), ("cancel", rid), ("cancel_all",), ("plan", qid, params, spec) and ("stop",). Out: ("hello",
Hello) or ("error", name, message, extra) once loaded; then ("round", events, kv_share) after every
scheduler round, ONE message carrying each request's events of that round as (rid, kind, payload),
a CHUNK's payload plain data (`chunk_wire`: text, token ids, logprobs as (token, logprob, top)
tuples, prompt logprobs) so pickling it costs no object reductions, and ("planned", qid, plan,
error) answers. EOF on FD (the server died) stops the engine as ("stop",) does."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..runtime import scheduler as sch
from ..runtime.prefix import Fork
from .remote import Hello, chunk_wire, wire_error

if TYPE_CHECKING:
    from ..api import LLM

log = logging.getLogger("specfire")


class Host:
    """The engine side of the pipe: a reader thread takes the server's messages, the main thread
    drives the scheduler, and each round's events leave as one message."""

    def __init__(self, llm: "LLM", conn: Connection):
        self.llm, self.conn, self.sched = llm, conn, llm.scheduler
        self.send_lock = threading.Lock()
        self.pending: list[tuple[int, str, Any]] = []     # this round's events (the driving thread's)
        self.reqs: dict[int, sch.Request] = {}
        self.forks: weakref.WeakValueDictionary[int, Fork] = weakref.WeakValueDictionary()
        self.stopping = False
        self.sched.after_round = self.flush

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    # ---- the driving (main) thread --------------------------------------------------------------
    def serve(self) -> None:
        reader = threading.Thread(target=self.read, name="specfire-engine-pipe", daemon=True)
        reader.start()
        while True:
            try:
                self.sched.drive_until(lambda: self.stopping and not self.sched.busy())
                return
            except Exception:  # the engine must outlive any one round
                log.exception("scheduler round failed")

    def flush(self) -> None:
        """After a round: its events, and the slots' use, in one message."""
        evs, self.pending = self.pending, []
        if not evs:
            return
        pool = self.sched.pool
        try:
            self.send(("round", evs, pool.usage))
        except OSError:    # the server is gone: the reader's EOF stops the engine
            pass

    def listener(self, rid: int):
        def on_event(kind: str, payload: Any) -> None:
            if kind == sch.CHUNK:
                payload = chunk_wire(payload)
            elif kind == sch.ERROR:
                payload = wire_error(payload)
            if kind in (sch.DONE, sch.ERROR, sch.CANCELLED):
                self.reqs.pop(rid, None)
            self.pending.append((rid, kind, payload))
        return on_event

    # ---- the reader thread ------------------------------------------------------------------------
    def read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            try:
                self.handle(msg)
            except Exception:
                log.exception("engine message %r failed", msg[0])
            if msg[0] == "stop":
                return

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            self.submit(*msg[1:])
        elif kind == "cancel":
            req = self.reqs.get(msg[1])
            if req is not None:
                req.cancel.set()
                self.sched.wake()
        elif kind == "plan":
            _, qid, params, spec = msg
            try:
                self.send(("planned", qid, self.llm.plan_route(params, spec), None))
            except Exception as e:
                self.send(("planned", qid, None, wire_error(e)))
        elif kind in ("cancel_all", "stop"):
            if kind == "stop":
                self.stopping = True
            self.sched.cancel_all()
            self.sched.wake()
        else:
            raise ValueError(f"unknown engine message {kind!r}")

    def submit(self, rid: int, ids: list[int], params: Any, spec: Any, plan: Any, fork: int | None) -> None:
        f = None
        if fork is not None:
            f = self.forks.get(fork)
            if f is None:
                f = self.forks[fork] = Fork()
        req = sch.Request(ids, params, spec, self.listener(rid), plan=plan, fork=f)
        self.reqs[rid] = req
        try:
            self.sched.submit(req)
        except Exception as e:          # closed: the request fails at once
            self.reqs.pop(rid, None)
            self.send(("round", [(rid, sch.ERROR, wire_error(e))], 0.0))


def main() -> int:
    conn = Connection(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the server, which stops this process
    args = conn.recv()
    from ..cli import log_to_stderr
    from .http import load

    log_to_stderr(getattr(args, "verbose", False))
    t0 = time.perf_counter()
    try:
        llm = load(args)
    except BaseException as e:
        conn.send(("error", *wire_error(e)))
        return 1
    log.info("engine process %d: the model loaded in %.1f s", os.getpid(), time.perf_counter() - t0)
    try:
        conn.send(("hello", Hello.of(llm)))
        Host(llm, conn).serve()
    finally:
        llm.close()
        conn.close()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)      # skip the interpreter's teardown, as the server does (http.exit_now)
