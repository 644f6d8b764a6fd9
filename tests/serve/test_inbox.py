"""The server's hand-over of engine events to the event loop (specfire/serve/inbox.py): everything
posted while the loop is busy arrives in one drain, in order; wake-ups are paced by the interval;
the first event after a pause and a request's last event are not held back."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specfire.serve.inbox import Inbox


class Recorder:
    """A sink that notes, for each event, which drain handed it over."""

    def __init__(self, inbox: Inbox):
        self.inbox, self.got, self.batches = inbox, [], []

    def push(self, ev) -> None:
        stamp = self.inbox.last
        if not self.batches or self.batches[-1][0] != stamp:
            self.batches.append((stamp, []))
        self.batches[-1][1].append(ev)
        self.got.append(ev)


def run(interval: float, body) -> Recorder:
    async def main():
        inbox = Inbox(asyncio.get_running_loop(), interval)
        rec = Recorder(inbox)
        await body(inbox, rec)
        return rec
    return asyncio.run(main())


def test_events_posted_while_the_loop_is_busy_arrive_in_one_drain_in_order():
    async def body(inbox, rec):
        t = threading.Thread(target=lambda: [inbox.post(rec, ("chunk", i)) for i in range(200)])
        t.start()
        t.join()                            # the loop is blocked meanwhile: nothing is drained yet
        assert rec.got == []
        await asyncio.sleep(0.05)
    rec = run(0.0, body)
    assert [ev for ev in rec.got] == [("chunk", i) for i in range(200)]
    assert len(rec.batches) == 1


def test_a_post_within_the_interval_waits_for_the_next_that_wakes_and_an_end_never_waits():
    interval = 0.3

    async def body(inbox, rec):
        inbox.post(rec, ("chunk", 0))         # after a pause: drained at the loop's next turn
        await asyncio.sleep(0)
        assert rec.got == [("chunk", 0)]
        inbox.post(rec, ("chunk", 1))         # within the interval: held ...
        inbox.post(rec, ("chunk", 2))
        await asyncio.sleep(interval * 1.5)
        assert rec.got == [("chunk", 0)]      # ... (no timer of the loop's wakes it) ...
        inbox.post(rec, ("chunk", 3))         # ... until a post once the interval has passed
        await asyncio.sleep(0)
        inbox.post(rec, ("done", 4))          # a request's end goes at once
        await asyncio.sleep(0)
        assert rec.got == [("chunk", i) for i in range(4)] + [("done", 4)]
    rec = run(interval, body)
    assert [b for _, b in rec.batches] == [[("chunk", 0)], [("chunk", 1), ("chunk", 2), ("chunk", 3)], [("done", 4)]]


def test_a_post_after_the_loop_closed_is_dropped():
    loop = asyncio.new_event_loop()
    inbox = Inbox(loop, 0.0)
    loop.close()
    inbox.post(Recorder(inbox), ("done", None))     # no error: nobody is listening
    assert inbox.items


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match="stream interval must be >= 0 seconds"):
        Inbox(asyncio.new_event_loop(), bad)


def test_posting_from_a_thread_while_the_loop_drains_loses_nothing():
    async def body(inbox, rec):
        def post():
            for i in range(20000):
                inbox.post(rec, ("chunk", i))
                if i % 1000 == 0:
                    time.sleep(0.001)
        t = threading.Thread(target=post)
        t.start()
        while t.is_alive() or len(rec.got) < 20000:
            await asyncio.sleep(0.001)
        t.join()
    rec = run(0.0, body)
    assert rec.got == [("chunk", i) for i in range(20000)]
