"""A request's response: whole (every choice's last event) or streamed (the choices' events as
server-sent events).

Whatever a choice's events brought since the client last got a chunk goes out as one content chunk
(its text the pieces' concatenation, its logprobs theirs in order), and whatever every choice has
ready goes out in one write: when the client reads slower than the engine makes tokens, or the
loop is held up, deltas merge rather than queue, so the server's work follows the writes, not the
tokens (OpenAI clients take a delta of several tokens)."""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .inbox import Event
from .logprobs import LogprobFormat
from .relay import SHUTTING_DOWN, Relay, Relays, check_event, choice, engine_error, sse, timings, usage
from .wire import RequestError
from .worker import CHUNK, DONE, ERROR, Finished

if TYPE_CHECKING:
    from ..runtime.output import TokenLogprobs
    from .relay import Prepared
    from .state import ServeState

END = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


class ChoiceStream:
    """One choice's events -> its SSE lines: the opening chunk (chat's role, or the echoed prompt),
    content chunks, the finish chunk (with `timings`). The envelope (id, object, created, model) is
    encoded once; `created` is the stream's start for every chunk, as OpenAI sends it."""

    def __init__(self, r: Relay, obj: str, created: int):
        prep = r.prep
        self.r, self.chat, self.index = r, prep.chat, r.index
        self.out = prep.assistant() if prep.assistant is not None else None
        self.fmt = LogprobFormat(r.st.llm.tokenizer)
        self.tokens, self.chars = 0, len(prep.echo or "")     # logprobs sent, text offset of the next
        self.opened = False
        env = dumps({"id": r.rid, "object": obj, "created": created, "model": r.st.model_name})
        self.head = "data: " + env[:-1] + ', "choices": ['

    def line(self, c: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
        tail = "]}" if extra is None else "], " + dumps(extra)[1:]
        return self.head + dumps(c) + tail + "\n\n"

    def piece(self, text: str | None, finish: str | None = None, role: bool = False,
              delta: dict[str, Any] | None = None, logprobs: Any = None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": self.index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            d: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                d["content"] = text
            c["delta"] = {**d, **(delta or {})}
        else:
            c["text"] = text or ""
        return c

    def shaped(self, lps: "list[TokenLogprobs] | None", ids: list[int]) -> Any:
        """These tokens' logprobs in the endpoint's shape (None when not asked or none)."""
        self.tokens += len(ids)
        if not lps:
            return None
        if self.chat:
            return {"content": self.fmt.chat(lps), "refusal": None}
        got = self.fmt.completion(lps, ids, self.chars)
        self.chars += sum(len(t) for t in got["tokens"])
        return got

    def pieces(self, text: str, lps: "list[TokenLogprobs] | None", ids: list[int], final: bool = False) -> list[str]:
        """Lines for generated text: the assistant parser's deltas, or the text as content; these
        tokens' logprobs ride on the first (on an empty delta when the text made none)."""
        lp = self.shaped(lps, ids)
        if self.out is None:
            return [self.line(self.piece(text, logprobs=lp))] if text or lp else []
        deltas = self.out.feed(text) + (self.out.finish() if final else [])
        if lp is not None and not deltas:
            deltas = [{}]
        return [self.line(self.piece(None, delta=d, logprobs=lp if i == 0 else None)) for i, d in enumerate(deltas)]

    def opening(self, ev: Event) -> list[str]:
        if self.chat:
            return [self.line(self.piece("", role=True))]
        prep = self.r.prep
        if prep.echo is None:
            return []
        kind, payload = ev                     # the prompt first (and its logprobs, known by then)
        plp = payload.prompt_logprobs if kind == CHUNK else payload.result.prompt_logprobs if kind == DONE else None
        return [self.line(self.piece(prep.echo, logprobs=self.fmt.completion(plp, prep.ids) if plp else None))]

    def feed(self, evs: list[Event]) -> tuple[list[str], Finished | None, dict[str, Any] | None]:
        """Lines for these events (the choice's next, in order), its Finished once it is done, or
        the error body that ends the stream."""
        out = [] if self.opened else self.opening(evs[0])
        self.opened = True
        texts: list[str] = []
        lps: list[TokenLogprobs] | None = None
        for kind, payload in evs:
            if kind == CHUNK:                  # merged with the rest of this look's chunks
                texts.append(payload.text)
                if payload.logprobs:
                    lps = (lps or []) + payload.logprobs
                continue
            if kind == DONE:                   # the chunks before it go with its text; its logprobs are
                fin: Finished = payload        # the result's from the first one not sent
                res = fin.result
                ids = res.token_ids[self.tokens:]
                rest = None if res.logprobs is None else res.logprobs[self.tokens:]
                out += self.pieces("".join(texts) + fin.text, rest, ids if rest is not None else [], final=True)
                reason = res.finish_reason if self.out is None else self.out.finish_reason(res.finish_reason)
                out.append(self.line(self.piece(None if self.chat else "", reason), {"timings": timings(fin)}))
                return out, fin, None
            out += self.content(texts, lps)   # ERROR, or CANCELLED: the server is shutting down
            err = engine_error(payload) if kind == ERROR else RequestError(SHUTTING_DOWN, None, 503, "server_error")
            return out, None, err.body()
        return out + self.content(texts, lps), None, None

    def content(self, texts: list[str], lps: "list[TokenLogprobs] | None") -> list[str]:
        return self.pieces("".join(texts), lps, [x.token for x in lps] if lps else [])


async def stream(g: Relays) -> AsyncIterator[str]:
    """The choices' events as server-sent events: each choice's pieces in order (interleaved
    between choices as they come), then the usage (when asked) and [DONE]; each yield is what all
    the choices had ready, one write."""
    prep = g.prep
    obj = "chat.completion.chunk" if prep.chat else "text_completion"
    created = int(time.time())
    live = [ChoiceStream(r, obj, created) for r in g.all]
    fins: list[Finished] = []
    try:
        while live:
            await g.wait()
            out: list[str] = []
            for s in list(live):
                evs = s.r.take()
                if not evs:
                    continue
                lines, fin, err = s.feed(evs)
                out += lines
                if err is not None:
                    yield "".join(out) + sse(err) + END
                    return
                if fin is not None:
                    fins.append(fin)
                    live.remove(s)
            if not live:
                if prep.include_usage:
                    out.append(sse({"id": g.rid, "object": obj, "created": created, "model": g.all[0].st.model_name,
                                    "choices": [], "usage": usage(*fins), "timings": timings(fins[0])}))
                out.append(END)
            if out:
                yield "".join(out)
    finally:
        g.end()  # the client left or the stream ended: stop generating


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
    if prep.stream:                          # (a choice still waiting for a slot does not hold the others back)
        g.all[0].events.appendleft(first)
        return StreamingResponse(stream(g), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:                                     # (a request that does not stream gets no chunks: its last events)
        ends = []
        for i, r in enumerate(g.all):
            ev = first if i == 0 else await r.next()
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
