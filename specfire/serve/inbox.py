"""Engine events into the event loop with one wake-up for everything posted since the loop last
looked, not one per event: the engine thread and the loop share the GIL, so every wake-up and
every write the loop makes between engine steps is time taken from the engine."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

Event = tuple[str, Any]


class Sink(Protocol):
    def push(self, ev: Event) -> None:
        """Take one event, on the loop's thread (it must not block)."""


class Inbox:
    """What the engine thread posts, handed to each sink on the loop's thread in posting order.
    `post` schedules a drain only when none is pending; a drain takes everything queued by then."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[tuple[Sink, Event]] = deque()   # append / popleft are atomic across threads
        self.armed = False                                # a drain is scheduled and has not started

    def post(self, sink: Sink, ev: Event) -> None:
        """Any thread: queue `ev` for `sink` (dropped once the loop is closed: nobody listens)."""
        self.items.append((sink, ev))
        if not self.armed:                                # (read after the append: a drain that starts
            self.armed = True                             # later sees the item, one that started earlier
            try:                                          # cleared the flag first, so we arm another)
                self.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:
                pass

    def drain(self) -> None:
        """The loop's thread: hand over every queued event."""
        self.armed = False
        items = self.items
        while items:
            sink, ev = items.popleft()
            sink.push(ev)
