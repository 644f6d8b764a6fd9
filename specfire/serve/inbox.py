"""Engine events into the event loop with one wake-up for everything posted since the loop last
looked, not one per event, and about one per `interval` at most: the posting thread (the engine
thread in-thread, the engine process's reader in `specfire serve`) and the loop share the GIL, so
every wake-up and every write the loop makes is time taken from that thread; paced, the loop's
work follows the clock, not the tokens, whatever the engine's rate and concurrency."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any, Protocol

from .worker import CANCELLED, DONE, ERROR

Event = tuple[str, Any]


class Sink(Protocol):
    def push(self, ev: Event) -> None:
        """Take one event, on the loop's thread (it must not block)."""


TERMINAL = (DONE, ERROR, CANCELLED)     # a request's last event: never held


class Inbox:
    """What the engine thread posts, handed to each sink on the loop's thread in posting order.
    A post wakes the loop only when no drain is pending and the last wake-up is `interval`
    seconds old, or when it ends a request; otherwise it waits for the next post that does (a
    request's last event always does), so a chunk is held at most about `interval` plus one
    engine round. The wake-up is the engine thread's (a write at a point where it lets the GIL
    go), never a timer of the loop's that would have to take the GIL from a running engine.
    `interval` defaults to the interpreter's switch interval: while the engine runs Python, the
    loop gets the GIL about that often anyway."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float | None = None):
        if interval is not None and not interval >= 0:
            raise ValueError(f"stream interval must be >= 0 seconds, got {interval!r}")
        self.loop = loop
        self.interval = sys.getswitchinterval() if interval is None else interval
        self.lock = threading.Lock()
        self.items: list[tuple[Sink, Event]] = []
        self.armed = False                    # a drain is scheduled and has not started
        self.last = -float("inf")             # when the last drain was scheduled (time.monotonic)

    def post(self, sink: Sink, ev: Event) -> None:
        """Any thread: queue `ev` for `sink` (dropped once the loop is closed: nobody listens)."""
        with self.lock:
            self.items.append((sink, ev))
            if self.armed:
                return
            now = time.monotonic()
            if now - self.last < self.interval and ev[0] not in TERMINAL:
                return
            self.armed, self.last = True, now
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:
            pass

    def drain(self) -> None:
        """The loop's thread: hand over every queued event."""
        with self.lock:
            items, self.items = self.items, []
            self.armed = False
        for sink, ev in items:
            sink.push(ev)
