"""Run one prepared request on the engine worker and relay its events as an OpenAI response: a JSON
object, or server-sent events.

A watcher task waits on the connection for the whole life of the job: when the client goes away
(streaming or not, queued or running) it sets the job's cancel flag, which the worker checks after
every engine step, so an abandoned request stops within one step and counts as `abort`."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import SpecfireError
from ..params import SamplingParams, SpecPolicy
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


Event = tuple[str, Any]
SHUTTING_DOWN = "the request was cancelled: the server is shutting down"


def usage(fin: Finished) -> dict[str, Any]:
    f = fin.figures
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.generated_tokens,
            "total_tokens": f.prompt_tokens + f.generated_tokens,
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


async def watch(request: Request, job: Job) -> None:
    """Cancel `job` when the client disconnects (the ASGI server reports it on receive)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel.set()
            return


class Relay:
    """One request's job and its event queue."""

    def __init__(self, request: Request, st: "ServeState", prep: "Prepared"):
        self.request, self.st, self.prep = request, st, prep
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        assert st.worker is not None
        self.job = st.worker.submit(Job(prep.ids, prep.params, prep.spec, on_event, plan=prep.plan))
        self.watcher = asyncio.create_task(watch(request, self.job))
        self.rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]

    async def next(self) -> Event:
        return await self.events.get()

    def end(self) -> None:
        """The job is over or abandoned: stop it (a no-op once done) and the watcher."""
        self.job.cancel.set()
        self.watcher.cancel()

    def gone(self) -> bool:
        return self.watcher.done() and self.job.cancel.is_set()


async def respond(request: Request, st: "ServeState", prep: "Prepared") -> Response:
    r = Relay(request, st, prep)
    try:
        first = await r.next()
        if first[0] == ERROR:
            raise engine_error(first[1])
        if first[0] == CANCELLED:
            if r.gone():
                return Response(status_code=499)
            raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
    except BaseException:
        r.end()
        raise
    if prep.stream:
        return StreamingResponse(stream(r, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        ev = first
        while ev[0] == CHUNK:
            ev = await r.next()
    finally:
        r.end()
    if ev[0] == ERROR:
        raise engine_error(ev[1])
    if ev[0] == CANCELLED:
        if r.gone():
            return Response(status_code=499)
        raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
    fin: Finished = ev[1]
    res = fin.result
    fmt = LogprobFormat(st.llm.tokenizer)
    choice: dict[str, Any] = {"index": 0, "finish_reason": res.finish_reason, "logprobs": None}
    if prep.assistant is not None:
        out = prep.assistant()
        out.feed(res.text)
        out.finish()
        choice["message"], choice["finish_reason"] = out.message(), out.finish_reason(res.finish_reason)
    elif prep.chat:
        choice["message"] = {"role": "assistant", "content": res.text}
    else:
        choice["text"] = (prep.echo or "") + res.text
    if prep.chat and res.logprobs is not None:
        choice["logprobs"] = {"content": fmt.chat(res.logprobs), "refusal": None}
    elif res.logprobs is not None:
        head = (fmt.completion(res.prompt_logprobs, prep.ids) if prep.echo is not None and res.prompt_logprobs
                else None)
        choice["logprobs"] = merge(head, fmt.completion(res.logprobs, res.token_ids, len(prep.echo or "")))
    return JSONResponse({"id": r.rid, "object": "chat.completion" if prep.chat else "text_completion",
                         "created": int(time.time()), "model": st.model_name, "choices": [choice],
                         "usage": usage(fin), "timings": timings(fin)})


async def stream(r: Relay, first: Event) -> AsyncIterator[str]:
    chat, name = r.prep.chat, r.st.model_name
    obj = "chat.completion.chunk" if chat else "text_completion"

    out = r.prep.assistant() if r.prep.assistant is not None else None
    fmt = LogprobFormat(r.st.llm.tokenizer)
    sent = {"tokens": 0, "chars": len(r.prep.echo or "")}      # logprobs sent, text offset of the next

    def piece(text: str | None, finish: str | None, role: bool = False,
              delta: dict[str, Any] | None = None, logprobs: Any = None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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

    def pieces(text: str, lps: list | None, ids: list[int], final: bool = False) -> list[str]:
        """SSE events for generated text: the assistant parser's deltas, or the text as content;
        these tokens' logprobs ride on the first (on an empty delta when the text made none)."""
        lp = shaped(lps, ids)
        if out is None:
            return [sse(piece(text, None, logprobs=lp))] if text or lp else []
        deltas = out.feed(text) + (out.finish() if final else [])
        if lp is not None and not deltas:
            deltas = [{}]
        return [sse(piece(None, None, delta=d, logprobs=lp if i == 0 else None)) for i, d in enumerate(deltas)]

    def chunk_logprobs(lps: list | None, res: Any = None) -> tuple[list | None, list[int]]:
        if res is not None:                        # the last chunk: whatever was not sent yet
            lps, ids = res.logprobs, res.token_ids
            lps, ids = (None, []) if lps is None else (lps[sent["tokens"]:], ids[sent["tokens"]:])
        else:
            ids = [x.token for x in lps] if lps else []
        sent["tokens"] += len(ids)
        return lps, ids

    ev = first
    try:
        if chat:
            yield sse(piece("", None, role=True))
        elif r.prep.echo is not None:              # the prompt first (and its logprobs, known by then)
            kind, payload = ev
            plp = payload.prompt_logprobs if kind == CHUNK else payload.result.prompt_logprobs if kind == DONE else None
            yield sse(piece(r.prep.echo, None, logprobs=fmt.completion(plp, r.prep.ids) if plp else None))
        while True:
            kind, payload = ev
            if kind == CHUNK:
                lps, ids = chunk_logprobs(payload.logprobs)
                for event in pieces(payload.text, lps, ids):
                    yield event
            elif kind == DONE:
                fin: Finished = payload
                lps, ids = chunk_logprobs(None, fin.result)
                for event in pieces(fin.text, lps, ids, final=True):
                    yield event
                reason = fin.result.finish_reason if out is None else out.finish_reason(fin.result.finish_reason)
                last = piece(None if chat else "", reason)
                last["timings"] = timings(fin)
                yield sse(last)
                if r.prep.include_usage:
                    yield sse({"id": r.rid, "object": obj, "created": int(time.time()), "model": name,
                               "choices": [], "usage": usage(fin), "timings": timings(fin)})
                yield "data: [DONE]\n\n"
                return
            else:  # ERROR, or CANCELLED: the server is shutting down (or the client already left)
                err = engine_error(payload) if kind == ERROR else RequestError(SHUTTING_DOWN, None, 503,
                                                                               "server_error")
                yield sse(err.body())
                yield "data: [DONE]\n\n"
                return
            ev = await r.next()
    finally:
        r.end()  # the client left or the stream ended: stop generating
