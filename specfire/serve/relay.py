"""Run one prepared request on the engine worker and relay its events as an OpenAI response: a JSON
object, or server-sent events.

A request with `n` choices runs as n engine requests (`choice_params`), which share the engine's
steps like any concurrent requests; their choices are indexed 0..n-1 in one response or one
stream. A watcher task waits on the connection for the whole life of the jobs: when the client
goes away (streaming or not, queued or running) it sets every job's cancel flag, which the worker
checks after every engine step, so an abandoned request stops within one step and counts as
`abort`."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import SpecfireError
from ..params import MAX_SEED, SamplingParams, SpecPolicy
from ..runtime.prefix import Fork
from .logprobs import LogprobFormat, merge
from .wire import RequestError
from .worker import CANCELLED, CHUNK, DONE, ERROR, Finished, Job

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


Event = tuple[str, Any]
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
    """One choice's job and its event queue."""

    def __init__(self, st: "ServeState", prep: "Prepared", index: int, rid: str, fork: "Fork | None" = None):
        self.st, self.prep, self.index, self.rid = st, prep, index, rid
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        assert st.worker is not None
        sp = choice_params(prep.params, index)
        # the route does not depend on the seed's value (only on whether there is one): the plan holds
        plan = prep.plan if sp is prep.params else replace(prep.plan, params=sp)
        self.job = st.worker.submit(Job(prep.ids, sp, prep.spec, on_event, plan=plan, fork=fork))

    async def next(self) -> Event:
        return await self.events.get()


class Relays:
    """A request's n choices, one Relay (one engine request) each, and one watcher of the connection
    (its receive channel has one reader) that cancels them all when the client goes away."""

    def __init__(self, request: Request, st: "ServeState", prep: "Prepared"):
        rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.prep, self.rid = prep, rid
        fork = Fork() if prep.n > 1 else None        # the prompt is prefilled once for every choice
        self.all = [Relay(st, prep, i, rid, fork) for i in range(prep.n)]
        self.watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                for r in self.all:
                    r.job.cancel.set()
                return

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


async def respond(request: Request, st: "ServeState", prep: "Prepared") -> Response:
    g = Relays(request, st, prep)
    try:                                     # the first choice's first event decides the status
        first = await g.all[0].next()
        if (early := check_event(g, first)) is not None:
            g.end()
            return early
    except BaseException:
        g.end()
        raise
    firsts: list[Event | None] = [first] + [None] * (prep.n - 1)
    if prep.stream:                          # (a choice still waiting for a slot does not hold the others back)
        return StreamingResponse(stream(g, firsts), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        ends = []
        for r, ev in zip(g.all, firsts):
            if ev is None:
                ev = await r.next()
            while ev[0] == CHUNK:
                ev = await r.next()
            if (early := check_event(g, ev)) is not None:
                return early
            ends.append(ev[1])
    finally:
        g.end()
    fmt = LogprobFormat(st.llm.tokenizer)
    fins: list[Finished] = ends
    return JSONResponse({"id": g.rid, "object": "chat.completion" if prep.chat else "text_completion",
                         "created": int(time.time()), "model": st.model_name,
                         "choices": [choice(prep, fin, i, fmt) for i, fin in enumerate(fins)],
                         "usage": usage(*fins), "timings": timings(fins[0])})


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


async def stream(g: Relays, firsts: list[Event | None]) -> AsyncIterator[str]:
    """The choices' events as server-sent events: each choice's pieces in order (interleaved
    between choices as they come), then the usage (when asked) and [DONE]."""
    prep, fins = g.prep, []
    obj = "chat.completion.chunk" if prep.chat else "text_completion"
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def run(r: Relay, first: Event | None) -> None:
        try:
            async for kind, item in choice_stream(r, first if first is not None else await r.next(), obj):
                await queue.put((kind, item))
        finally:
            await queue.put(("over", None))

    tasks = [asyncio.create_task(run(r, first)) for r, first in zip(g.all, firsts)]
    try:
        left = len(tasks)
        while left:
            kind, item = await queue.get()
            if kind == "over":
                left -= 1
            elif kind == "fin":
                fins.append(item)
            elif kind == "error":
                yield sse(item)
                yield "data: [DONE]\n\n"
                return
            else:
                yield sse(item)
        if prep.include_usage:
            yield sse({"id": g.rid, "object": obj, "created": int(time.time()), "model": g.all[0].st.model_name,
                       "choices": [], "usage": usage(*fins), "timings": timings(fins[0])})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        g.end()  # the client left or the stream ended: stop generating


async def choice_stream(r: Relay, first: Event, obj: str) -> AsyncIterator[tuple[str, Any]]:
    """One choice's chunks ("chunk", dict), then ("fin", Finished) or ("error", an error body)."""
    prep, chat, name = r.prep, r.prep.chat, r.st.model_name
    out = prep.assistant() if prep.assistant is not None else None
    fmt = LogprobFormat(r.st.llm.tokenizer)
    sent = {"tokens": 0, "chars": len(prep.echo or "")}      # logprobs sent, text offset of the next

    def piece(text: str | None, finish: str | None, role: bool = False,
              delta: dict[str, Any] | None = None, logprobs: Any = None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": r.index, "finish_reason": finish, "logprobs": logprobs}
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                d["content"] = text
            c["delta"] = {**d, **(delta or {})}
        else:
            c["text"] = text or ""
        return {"id": r.rid, "object": obj, "created": int(time.time()), "model": name, "choices": [c]}

    def shaped(lps: list | None, ids: list[int]) -> Any:
        """These tokens' logprobs in the endpoint's shape (None when not asked or none)."""
        if not lps:
            return None
        if chat:
            return {"content": fmt.chat(lps), "refusal": None}
        got = fmt.completion(lps, ids, sent["chars"])
        sent["chars"] += sum(len(t) for t in got["tokens"])
        return got

    def pieces(text: str, lps: list | None, ids: list[int], final: bool = False) -> list[dict[str, Any]]:
        """Chunks for generated text: the assistant parser's deltas, or the text as content; these
        tokens' logprobs ride on the first (on an empty delta when the text made none)."""
        lp = shaped(lps, ids)
        if out is None:
            return [piece(text, None, logprobs=lp)] if text or lp else []
        deltas = out.feed(text) + (out.finish() if final else [])
        if lp is not None and not deltas:
            deltas = [{}]
        return [piece(None, None, delta=d, logprobs=lp if i == 0 else None) for i, d in enumerate(deltas)]

    def chunk_logprobs(lps: list | None, res: Any = None) -> tuple[list | None, list[int]]:
        if res is not None:                        # the last chunk: whatever was not sent yet
            lps, ids = res.logprobs, res.token_ids
            lps, ids = (None, []) if lps is None else (lps[sent["tokens"]:], ids[sent["tokens"]:])
        else:
            ids = [x.token for x in lps] if lps else []
        sent["tokens"] += len(ids)
        return lps, ids

    ev = first
    if chat:
        yield "chunk", piece("", None, role=True)
    elif prep.echo is not None:                # the prompt first (and its logprobs, known by then)
        kind, payload = ev
        plp = payload.prompt_logprobs if kind == CHUNK else payload.result.prompt_logprobs if kind == DONE else None
        yield "chunk", piece(prep.echo, None, logprobs=fmt.completion(plp, prep.ids) if plp else None)
    while True:
        kind, payload = ev
        if kind == CHUNK:
            lps, ids = chunk_logprobs(payload.logprobs)
            for p in pieces(payload.text, lps, ids):
                yield "chunk", p
        elif kind == DONE:
            fin: Finished = payload
            lps, ids = chunk_logprobs(None, fin.result)
            for p in pieces(fin.text, lps, ids, final=True):
                yield "chunk", p
            reason = fin.result.finish_reason if out is None else out.finish_reason(fin.result.finish_reason)
            last = piece(None if chat else "", reason)
            last["timings"] = timings(fin)
            yield "chunk", last
            yield "fin", fin
            return
        else:  # ERROR, or CANCELLED: the server is shutting down (or the client already left)
            err = engine_error(payload) if kind == ERROR else RequestError(SHUTTING_DOWN, None, 503, "server_error")
            yield "error", err.body()
            return
        ev = await r.next()
