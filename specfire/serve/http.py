"""`specfire serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Every generation runs on the EngineWorker thread in arrival order; handlers only parse, tokenize,
validate and relay events, so a bad request never reaches the engine and the event loop never
blocks on a forward pass. The protocol is documented in docs/PROTOCOL.md."""

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import time
import uuid
from typing import Any, AsyncIterator

from ..config import SamplingParams, SpecPolicy
from ..errors import SpecfireError
from .schema import (RequestError, check_route, encode_checked, messages_of, optional, prompt_of,
                     sampling_params, spec_policy)

log = logging.getLogger("specfire")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import _add_model_args

    _add_model_args(p, positional=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECFIRE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECFIRE_API_KEY, else open)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint's folder name)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import _load

    if not (0 < args.port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    llm = _load(args)
    name = args.served_model_name or default_model_name(llm)
    app = build_app(llm, name, args.api_key, close_llm=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=args.log_level in ("info", "debug"))

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.cancel_all()  # end running and queued generations now, not after the grace period
            super().handle_exit(sig, frame)

    server = Server(config)
    print(f"[specfire] serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn handles SIGINT / SIGTERM (stop accepting, end streams, run the lifespan shutdown) and then
    # re-raises the signal with the handler that was installed before it; a no-op one makes a SIGTERM
    # shutdown end with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    print("[specfire] server stopped", file=sys.stderr, flush=True)
    return 0


def default_model_name(llm: Any) -> str:
    return os.path.basename(os.path.normpath(llm.path)) or "specfire"


# ---- responses ------------------------------------------------------------------------------------

def timings(stats: dict[str, Any], ttft_s: float) -> dict[str, Any]:
    """Per-request timings and speculation figures (not an OpenAI field; clients keep extra keys)."""
    return {
        "ttft_ms": 1000.0 * ttft_s,
        "prefill_ms": 1000.0 * stats["prefill_s"], "prefill_tok_s": stats["prefill_tok_s"],
        "decode_ms": 1000.0 * stats["decode_s"], "decode_tok_s": stats["decode_tok_s"],
        "route": stats["route"], "route_reason": stats["route_reason"], "k": stats["k"],
        "cycles": stats["cycles"], "drafted": stats["drafted"], "accepted": stats["accepted"],
        "mean_accept_len": stats["mean_accept_len"],
    }


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    p, c = stats["prompt_tokens"], stats["generated_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": 0}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- the app ------------------------------------------------------------------------------------

def build_app(llm: Any, model_name: str, api_key: str | None = None, close_llm: bool = False):
    """The FastAPI app serving `llm` as `model_name`. Its lifespan starts the engine worker and, on
    shutdown, cancels running work and (with close_llm) frees the model."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .metrics import Metrics
    from .worker import CANCELLED, CHUNK, DONE, ERROR, EngineWorker, Job

    metrics = Metrics(model_name)
    created = int(time.time())
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["worker"] = EngineWorker(llm, metrics)
        try:
            yield
        finally:
            state["worker"].close()
            if close_llm:
                llm.close()
            log.info("engine stopped and model freed")

    app = FastAPI(title="specfire", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cancel_all = lambda: state["worker"].cancel_all() if "worker" in state else None

    def error_response(e: RequestError) -> JSONResponse:
        metrics.http_error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(f"{request.method} {request.url.path}: {e.detail}", None,
                                           e.status_code, kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return error_response(RequestError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error"))

    # ---- helpers --------------------------------------------------------------------------------
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise RequestError("invalid API key: send 'Authorization: Bearer <key>'", None, 401,
                               "authentication_error", "invalid_api_key")

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}", None) from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object", None)
        return body

    def check_model(body: dict[str, Any]) -> None:
        m = optional(body, "model", "string")
        if m is not None and m != model_name:
            raise RequestError(f"model {m!r} does not exist; this server serves {model_name!r}", "model", 404,
                               "not_found_error", "model_not_found")

    def common(body: dict[str, Any], ids: list[int], default_max: int) -> tuple[SamplingParams, SpecPolicy]:
        room = llm.engine.trunk.max_seq - len(ids)
        sp = sampling_params(body, default_max_tokens=min(default_max, room))
        policy = spec_policy(body, llm.spec)
        check_route(llm, policy, sp)
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise RequestError(f"'stream_options' must be an object, got {so!r}", "stream_options")
        if so is not None:
            optional(so, "include_usage", "boolean")
        optional(body, "stream", "boolean")
        return sp, policy

    def engine_error(e: BaseException) -> RequestError:
        if isinstance(e, (ValueError, SpecfireError)):
            return RequestError(str(e), None)
        return RequestError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error")

    async def run(request: Request, ids: list[int], sp: SamplingParams, policy: SpecPolicy, chat: bool,
                  stream: bool, include_usage: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        worker: EngineWorker = state["worker"]
        job = worker.submit(Job(ids, sp, policy, on_event))

        async def next_event() -> tuple[str, Any] | None:
            """The next engine event, or None once the client has gone away."""
            while True:
                try:
                    return await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        try:
            first = await next_event()
        except BaseException:
            job.cancel.set()
            raise
        if first is None:
            job.cancel.set()
            return Response(status_code=499)
        if first[0] == ERROR:
            raise engine_error(first[1])
        if first[0] == CANCELLED:
            raise RequestError("the request was cancelled: the server is shutting down", None, 503, "server_error")

        if not stream:
            try:
                ev: tuple[str, Any] | None = first
                while ev is not None and ev[0] == CHUNK:
                    ev = await next_event()
            finally:
                job.cancel.set()  # a no-op once the job is done
            if ev is None:
                return Response(status_code=499)
            if ev[0] == ERROR:
                raise engine_error(ev[1])
            if ev[0] == CANCELLED:
                raise RequestError("the request was cancelled: the server is shutting down", None, 503,
                                   "server_error")
            chunk, ttft = ev[1]
            res = chunk.result
            choice: dict[str, Any] = {"index": 0, "finish_reason": res.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": res.text}
            else:
                choice["text"] = res.text
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice], "usage": usage(res.stats),
                                 "timings": timings(res.stats, ttft)})

        obj_chunk = "chat.completion.chunk" if chat else "text_completion"

        def piece(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            return {"id": rid, "object": obj_chunk, "created": int(time.time()), "model": model_name, "choices": [c]}

        async def events_sse() -> AsyncIterator[str]:
            ev: tuple[str, Any] | None = first
            try:
                if chat:
                    yield sse(piece("", None, role=True))
                while ev is not None:
                    kind, payload = ev
                    if kind == CHUNK:
                        if payload.text:
                            yield sse(piece(payload.text, None))
                    elif kind == DONE:
                        chunk, ttft = payload
                        res = chunk.result
                        if chunk.text:
                            yield sse(piece(chunk.text, None))
                        last = piece(None if chat else "", res.finish_reason)
                        last["timings"] = timings(res.stats, ttft)
                        yield sse(last)
                        if include_usage:
                            yield sse({"id": rid, "object": obj_chunk, "created": int(time.time()),
                                       "model": model_name, "choices": [], "usage": usage(res.stats),
                                       "timings": timings(res.stats, ttft)})
                        yield "data: [DONE]\n\n"
                        return
                    elif kind == ERROR:
                        yield sse(engine_error(payload).body())
                        yield "data: [DONE]\n\n"
                        return
                    else:  # CANCELLED: the server is shutting down (or the client already left)
                        yield sse(RequestError("the request was cancelled: the server is shutting down", None,
                                               503, "server_error").body())
                        yield "data: [DONE]\n\n"
                        return
                    ev = await next_event()
            finally:
                job.cancel.set()  # the client left or the stream ended: stop generating

        return StreamingResponse(events_sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        w = state.get("worker")
        if w is None or not w.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specfire", "root": llm.path,
                                            "max_model_len": llm.engine.trunk.max_seq}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await json_body(request)
        check_model(body)
        msgs = messages_of(body)
        kw = optional(body, "chat_template_kwargs", "object") or {}
        if llm.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot serve chat; use /v1/completions "
                               "with token ids", "messages")
        from jinja2 import TemplateError

        try:
            text = llm.tokenizer.render_chat(msgs, add_generation_prompt=True, **kw)
        except (ValueError, TypeError, TemplateError) as e:
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        ids = await asyncio.to_thread(encode_checked, llm, text, "messages")  # long prompts: off the loop
        sp, policy = common(body, ids, llm.engine.trunk.max_seq)
        so = body.get("stream_options") or {}
        return await run(request, ids, sp, policy, True, bool(body.get("stream")), bool(so.get("include_usage")))

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await json_body(request)
        check_model(body)
        ids = await asyncio.to_thread(encode_checked, llm, prompt_of(body), "prompt")
        sp, policy = common(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS)
        so = body.get("stream_options") or {}
        return await run(request, ids, sp, policy, False, bool(body.get("stream")), bool(so.get("include_usage")))

    return app
