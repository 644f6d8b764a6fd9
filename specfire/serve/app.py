"""The FastAPI app: one ServeState, the routes bound to the plain handler functions of
handlers.py, and the exception handlers that turn every failure into an OpenAI-shaped error."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import handlers
from .schema import RequestError
from .state import DEFAULT_MAX_REQUEST_BYTES, ServeState, state_of
from .worker import EngineWorker

if TYPE_CHECKING:
    from ..api import LLM

log = logging.getLogger("specfire")


def build_app(llm: "LLM", model_name: str, api_key: str | None = None, close_llm: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              sampling_defaults: dict[str, Any] | None = None) -> FastAPI:
    """The app serving `llm` as `model_name`. Its lifespan starts the engine worker and, on
    shutdown, cancels running work and (with close_llm) frees the model. `sampling_defaults`:
    sampling fields (the penalties from `specfire serve`'s flags) for requests that leave them
    out; they override the model's own defaults (`llm.generation_defaults`, from its
    generation_config.json), which override the built-in ones."""
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    from ..config import SamplingParams

    SamplingParams(**dict(sampling_defaults or {}))   # a bad default is refused here, not per request
    defaults = {**llm.generation_defaults.as_dict(), **(sampling_defaults or {})}
    st = ServeState(llm, model_name, api_key, max_request_bytes, sampling_defaults=defaults)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.worker = EngineWorker(llm, st.metrics)
        try:
            yield
        finally:
            st.worker.close()
            if close_llm:
                llm.close()
            log.info("engine stopped and model freed")

    app = FastAPI(title="specfire", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = st
    app.add_exception_handler(RequestError, request_error)            # type: ignore[arg-type]
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
    return JSONResponse(e.body(), status_code=e.status)


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
