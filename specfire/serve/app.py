"""The FastAPI app: one ServeState, the routes bound to the plain handler functions of
handlers.py, and the exception handlers that turn every failure into an OpenAI-shaped error."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import handlers
from .chat_options import ChatOptions
from .guard import Access, AccessMiddleware, check_api_key
from .inbox import Inbox
from .state import ServeState, state_of
from .transport import BODY_TIMEOUT_S, MAX_REQUEST_BYTES
from .wire import RequestError
from .worker import EngineWorker

if TYPE_CHECKING:
    from ..api import LLM
    from .client import EngineClient
    from .remote import RemoteModel

log = logging.getLogger("specfire")


def build_app(llm: "LLM | RemoteModel", model_name: str, api_key: str | None = None, close_llm: bool = False,
              max_request_bytes: int = MAX_REQUEST_BYTES,
              sampling_defaults: dict[str, Any] | None = None, access: Access | None = None,
              body_timeout: float = BODY_TIMEOUT_S, chat: ChatOptions | None = None,
              stream_interval: float | None = None, engine: "EngineClient | None" = None) -> FastAPI:
    """The app serving `llm` as `model_name`. Its lifespan starts the engine worker and, on
    shutdown, cancels running work and (with close_llm) frees the model. `sampling_defaults`:
    sampling fields (the penalties from `specfire serve`'s flags) for requests that leave them
    out; they override the model's own defaults (`llm.generation_defaults`, from its
    generation_config.json), which override the built-in ones. `access`: the allowed origins and
    hosts (default: no foreign Origin, any Host). An empty `api_key` means none. `stream_interval`:
    the least seconds between two hand-overs of engine events to the loop (inbox.py; default the
    interpreter's switch interval); a stream's chunk carries every token since its last. `engine`:
    the engine process that loaded the model (then `llm` is its client.model); none: the engine
    runs in a thread of this process over `llm`."""
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    api_key = check_api_key(api_key)
    if stream_interval is not None and not stream_interval >= 0:
        raise ValueError(f"stream_interval must be >= 0 seconds, got {stream_interval!r}")
    from ..params import SamplingParams

    SamplingParams(**dict(sampling_defaults or {}))   # a bad default is refused here, not per request
    defaults = {**llm.generation_defaults.as_dict(), **(sampling_defaults or {})}
    st = ServeState(llm, model_name, api_key, max_request_bytes, body_timeout, sampling_defaults=defaults,
                    chat=chat or ChatOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.inbox = Inbox(asyncio.get_running_loop(), stream_interval)
        st.worker = engine.attach(st.metrics) if engine is not None else EngineWorker(llm, st.metrics)
        try:
            yield
        finally:
            st.worker.close()
            if close_llm:
                llm.close()
            log.info("engine stopped and model freed")

    app = FastAPI(title="specfire", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = st
    app.add_middleware(AccessMiddleware, access=access or Access(), on_refused=st.metrics.http_error)
    app.add_exception_handler(RequestError, request_error)            # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, client_gone)          # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)     # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", handlers.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    return app


def error_response(request: Request, e: RequestError) -> JSONResponse:
    state_of(request).metrics.http_error(e.status)
    # a body refused unread (too large, too slow): the connection cannot carry another request
    headers = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def client_gone(request: Request, e: ClientDisconnect) -> Response:
    """The client hung up while sending its request: nobody to answer, nothing went wrong here."""
    state_of(request).metrics.client_disconnected()
    return Response(status_code=499)


async def request_error(request: Request, e: RequestError) -> JSONResponse:
    return error_response(request, e)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(request, RequestError(f"{request.method} {request.url.path}: {e.detail}", None,
                                                e.status_code, kind))


async def internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(request, RequestError(f"internal error: {type(e).__name__}: {e}", None, 500,
                                                "server_error"))
