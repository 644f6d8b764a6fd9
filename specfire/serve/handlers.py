"""The HTTP endpoints as plain functions. A generation request is read (size-limited), then parsed,
validated, rendered and tokenized in a worker thread (the event loop stays free for /health and
every other client), then handed to streaming.respond, whose relay.Relays queue it on the engine worker."""
from __future__ import annotations

import asyncio
import hmac

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import relay, streaming
from .chat import prepare_chat
from .metrics import CONTENT_TYPE
from .schema import ChatBody, CompletionBody, HttpBody, check_route, encode, sampling_params, spec_policy, validate
from .state import ServeState, state_of
from .wire import RequestError, parse_object

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


# ---- endpoints ------------------------------------------------------------------------------------

async def health(request: Request) -> JSONResponse:
    w = state_of(request).worker
    if w is None or not w.alive:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request) -> JSONResponse:
    st = state_of(request)
    authorize(st, request)
    return JSONResponse({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.created, "owned_by": "specfire",
        "root": st.model_name, "max_model_len": st.llm.max_model_len}]})


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, chat: bool) -> Response:
    st = state_of(request)
    authorize(st, request)
    require_json(request)
    raw = await read_body(request, st.max_request_bytes, st.body_timeout)
    prep = await asyncio.to_thread(prepare, st, raw, chat)
    return await streaming.respond(request, st, prep)


# ---- steps ----------------------------------------------------------------------------------------

def authorize(st: ServeState, request: Request) -> None:
    if st.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), st.api_key.encode()):
        raise RequestError("invalid API key: send 'Authorization: Bearer <key>'", None, 401,
                           "authentication_error", "invalid_api_key")


def too_large(size: int | str, limit: int) -> RequestError:
    return RequestError(f"request body is {size} bytes; this server accepts at most {limit} "
                        f"(--max-request-bytes)", None, 413, code="request_too_large")


def require_json(request: Request) -> None:
    """A JSON body must say so: a browser sends text/plain or a form cross-site without asking
    first (CORS lets those through unchecked), application/json only after a preflight."""
    ctype = request.headers.get("content-type")
    if ctype is None or ctype.split(";")[0].strip().lower() != "application/json":
        got = repr(ctype) if ctype is not None else "none"
        raise RequestError(f"Content-Type must be application/json, got {got} (send the header "
                           f"'Content-Type: application/json'; curl -d alone sends a form)", None, 415,
                           code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes, and with 408
    when `timeout` seconds pass without a piece of it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared, limit)
    parts: list[bytes] = []
    n = 0
    pieces = request.stream().__aiter__()
    while True:
        try:
            piece = await asyncio.wait_for(pieces.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestError(f"the request body stalled: no data for {timeout:g} s (--body-timeout)", None, 408,
                               code="request_timeout") from None
        n += len(piece)
        if n > limit:
            raise too_large(f"more than {limit}", limit)
        parts.append(piece)
    return b"".join(parts)


def prepare(st: ServeState, raw: bytes, chat: bool) -> relay.Prepared:
    """Parse, validate, render and tokenize one request (runs in a worker thread)."""
    llm = st.llm
    body = parse_object(raw)
    b: HttpBody = validate(ChatBody if chat else CompletionBody, body)
    if b.model is not None and b.model != st.model_name:
        raise RequestError(f"model {b.model!r} does not exist; this server serves {st.model_name!r}", "model", 404,
                           "not_found_error", "model_not_found")
    chat_prep = None
    if chat:
        assert isinstance(b, ChatBody)
        chat_prep = prepare_chat(llm, b.messages, {"tools": b.tools, "tool_choice": b.tool_choice},
                                 b.chat_template_kwargs or {}, st.chat)
        ids, assistant = chat_prep.ids, chat_prep.assistant
        default_max = llm.max_model_len
    else:
        assert isinstance(b, CompletionBody)
        ids, assistant = encode(llm, b.prompt, "prompt"), None
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
    sp = sampling_params(b, default_max_tokens=default_max, defaults=st.sampling_defaults,
                         room=llm.max_model_len - len(ids))
    if chat_prep is not None:
        sp = chat_prep.params(sp)
    policy = spec_policy(b.speculation, llm.spec)
    plan = check_route(llm, sp, policy)
    so = b.stream_options
    echo = None
    if isinstance(b, CompletionBody) and b.echo:
        echo = b.prompt if isinstance(b.prompt, str) else llm.tokenizer.decode(ids) if llm.tokenizer else ""
    return relay.Prepared(ids, sp, policy, chat, bool(b.stream), bool(so is not None and so.include_usage),
                          plan, assistant, echo, b.n or 1)

