"""What every handler reads: the app's one ServeState (on `app.state.serve`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from .chat_options import ChatOptions
from .inbox import Inbox
from .metrics import Metrics
from .transport import BODY_TIMEOUT_S, MAX_REQUEST_BYTES
from .worker import EngineWorker

if TYPE_CHECKING:
    from ..api import LLM
    from .client import EngineClient
    from .remote import RemoteModel

@dataclass
class ServeState:
    """Everything a handler needs; one per app, on `app.state.serve`."""

    llm: "LLM | RemoteModel"          # the model, or its stand-in when the engine runs in a process of its own
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    body_timeout: float = BODY_TIMEOUT_S
    metrics: Metrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    worker: "EngineWorker | EngineClient | None" = None
    inbox: Inbox | None = None           # engine events into the event loop (both set by the app's lifespan)
    # what a request leaves out: the serve flags over the model's generation_config.json values
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat: ChatOptions = field(default_factory=ChatOptions)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name)

    def cancel_all(self) -> None:
        if self.worker is not None:
            self.worker.cancel_all()


def state_of(request: Request) -> ServeState:
    return request.app.state.serve
