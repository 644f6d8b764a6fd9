"""Engine events into the event loop with one wake-up for everything posted since the loop last
looked, not one per event, and at most one drain per `interval`: the engine thread and the loop
share the GIL, so every wake-up and every write the loop makes is time taken from the engine; paced,
the loop's work follows the clock, not the tokens, whatever the engine's rate and concurrency."""
from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Protocol

Event = tuple[str, Any]


class Sink(Protocol):
    def push(self, ev: Event) -> None:
        """Take one event, on the loop's thread (it must not block)."""


class Inbox:
    """What the engine thread posts, handed to each sink on the loop's thread in posting order, at
    most one drain per `interval` seconds. The first event after a pause is drained at once (no
    delay to a first token); while events keep coming a timer drains them every `interval`, so
    the engine thread wakes the loop only after a pause. `interval` defaults to the interpreter's
    switch interval: while the engine runs Python, the loop gets the GIL about that often anyway."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float | None = None):
        if interval is not None and not interval >= 0:
            raise ValueError(f"stream interval must be >= 0 seconds, got {interval!r}")
        self.loop = loop
        self.interval = sys.getswitchinterval() if interval is None else interval
        self.lock = threading.Lock()
        self.items: list[tuple[Sink, Event]] = []
        self.armed = False                    # a drain is scheduled (exactly one while set)
        self.last = -float("inf")             # when the last drain with events ran (the loop's clock)

    def post(self, sink: Sink, ev: Event) -> None:
        """Any thread: queue `ev` for `sink` (dropped once the loop is closed: nobody listens)."""
        with self.lock:
            self.items.append((sink, ev))
            if self.armed:
                return
            self.armed = True
        try:
            self.loop.call_soon_threadsafe(self._arm)
        except RuntimeError:
            pass

    def _arm(self) -> None:
        wait = self.last + self.interval - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, self.drain)
        else:
            self.drain()

    def drain(self) -> None:
        """The loop's thread: hand over every queued event, and look again in `interval` (nothing
        queued by then: disarm, the next post wakes the loop)."""
        with self.lock:
            items, self.items = self.items, []
            if not items:
                self.armed = False
                return
        self.last = self.loop.time()
        self.loop.call_later(self.interval, self.drain)
        for sink, ev in items:
            sink.push(ev)
