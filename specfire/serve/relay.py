"""Run one prepared request on the engine worker and relay its events as an OpenAI response: a JSON
object, or server-sent events (streaming.py). The events come through the app's Inbox: one
wake-up of the event loop for all that the engine posted since it last looked.

A request with `n` choices runs as n engine requests (`choice_params`), which share the engine's
steps like any concurrent requests; their choices are indexed 0..n-1 in one response or one
stream. A watcher task waits on the connection for the whole life of the jobs: when the client
goes away (streaming or not, queued or running) it sets every job's cancel flag, which the worker
checks after every engine step, so an abandoned request stops within one step and counts as
`abort`."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from fastapi import Request
from fastapi.responses import Response

from ..errors import SpecfireError
from ..params import MAX_SEED, SamplingParams, SpecPolicy
from ..runtime.prefix import Fork
from .logprobs import LogprobFormat, merge
from .wire import RequestError
from .inbox import Event
from .worker import CANCELLED, CHUNK, ERROR, Finished, Job

if TYPE_CHECKING:
    from ..runtime.route import RoutePlan
    from .assistant import AssistantOutput
    from .state import ServeState


@dataclass
class Prepared:
    """A request ready for the engine (handlers.prepare makes it)."""

    ids: list[int]
    params: SamplingParams
    spec: SpecPolicy
    chat: bool
    stream: bool
    include_usage: bool
    plan: "RoutePlan"        # the route, decided once (schema.check_route)
    assistant: Callable[[], AssistantOutput] | None = None   # chat: reasoning / tool-call parsing
    echo: str | None = None  # completions with echo: the prompt's text, returned before the answer
    n: int = 1               # choices: each a request of its own (`choice_params`), sharing the engine's steps


def choice_params(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling: a seeded request's choice i draws from seed + i (so each choice is the
    request with that seed alone); greedy choices are alike."""
    return sp if i == 0 or sp.seed is None else replace(sp, seed=(sp.seed + i) % (MAX_SEED + 1))


SHUTTING_DOWN = "the request was cancelled: the server is shutting down"


def usage(*fins: Finished) -> dict[str, Any]:
    """The request's usage: its prompt once, every choice's completion tokens."""
    f = fins[0].figures
    gen = sum(x.figures.generated_tokens for x in fins)
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": gen, "total_tokens": f.prompt_tokens + gen,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


def timings(fin: Finished) -> dict[str, Any]:
    """Per-request timings and speculation figures (not an OpenAI field; clients keep extra keys)."""
    return fin.figures.timings(1000.0 * fin.ttft_s)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def engine_error(e: BaseException) -> RequestError:
    if isinstance(e, (ValueError, SpecfireError)):
        return RequestError(str(e), None)
    return RequestError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error")


class Relay:
    """One choice's job and the events it has not handed on yet. A request that does not stream
    gets only its last event: its chunks are dropped on the engine thread, costing the loop nothing."""

    def __init__(self, st: "ServeState", prep: "Prepared", index: int, rid: str, ready: asyncio.Event,
                 fork: "Fork | None" = None):
        self.st, self.prep, self.index, self.rid, self.ready = st, prep, index, rid, ready
        self.events: deque[Event] = deque()
        inbox, stream = st.inbox, prep.stream
        assert st.worker is not None and inbox is not None

        def on_event(kind: str, payload: Any) -> None:
            if stream or kind != CHUNK:
                inbox.post(self, (kind, payload))

        sp = choice_params(prep.params, index)
        # the route does not depend on the seed's value (only on whether there is one): the plan holds
        plan = prep.plan if sp is prep.params else replace(prep.plan, params=sp)
        self.job = st.worker.submit(Job(prep.ids, sp, prep.spec, on_event, plan=plan, fork=fork))

    def push(self, ev: Event) -> None:
        self.events.append(ev)
        self.ready.set()

    def take(self) -> list[Event]:
        """Every event queued since the last look (none: [])."""
        evs = list(self.events)
        self.events.clear()
        return evs

    async def next(self) -> Event:
        while not self.events:
            self.ready.clear()
            await self.ready.wait()
        return self.events.popleft()


class Relays:
    """A request's n choices, one Relay (one engine request) each, one `ready` flag set when any
    of them has an event, and one watcher of the connection (its receive channel has one reader)
    that cancels them all when the client goes away."""

    def __init__(self, request: Request, st: "ServeState", prep: "Prepared"):
        rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.prep, self.rid, self.ready = prep, rid, asyncio.Event()
        fork = Fork() if prep.n > 1 else None        # the prompt is prefilled once for every choice
        self.all = [Relay(st, prep, i, rid, self.ready, fork) for i in range(prep.n)]
        self.watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                for r in self.all:
                    r.job.cancel.set()
                return

    async def wait(self) -> None:
        """Until some choice has an event (now, if one has)."""
        while not any(r.events for r in self.all):
            self.ready.clear()
            await self.ready.wait()

    def end(self) -> None:
        """The request is over or abandoned: stop every choice (a no-op once done) and the watcher."""
        for r in self.all:
            r.job.cancel.set()
        self.watcher.cancel()

    def gone(self) -> bool:
        return self.watcher.done() and all(r.job.cancel.is_set() for r in self.all)


def check_event(g: Relays, ev: Event) -> Response | None:
    """An ERROR raises its error; a CANCELLED answers 499 (the client left) or raises a 503."""
    if ev[0] == ERROR:
        raise engine_error(ev[1])
    if ev[0] == CANCELLED:
        if g.gone():
            return Response(status_code=499)
        raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
    return None


def choice(prep: "Prepared", fin: Finished, index: int, fmt: LogprobFormat) -> dict[str, Any]:
    """One choice of a whole (not streamed) response."""
    res = fin.result
    c: dict[str, Any] = {"index": index, "finish_reason": res.finish_reason, "logprobs": None}
    if prep.assistant is not None:
        out = prep.assistant()
        out.feed(res.text)
        out.finish()
        c["message"], c["finish_reason"] = out.message(), out.finish_reason(res.finish_reason)
    elif prep.chat:
        c["message"] = {"role": "assistant", "content": res.text}
    else:
        c["text"] = (prep.echo or "") + res.text
    if prep.chat and res.logprobs is not None:
        c["logprobs"] = {"content": fmt.chat(res.logprobs), "refusal": None}
    elif res.logprobs is not None:
        head = (fmt.completion(res.prompt_logprobs, prep.ids) if prep.echo is not None and res.prompt_logprobs
                else None)
        c["logprobs"] = merge(head, fmt.completion(res.logprobs, res.token_ids, len(prep.echo or "")))
    return c
