"""`specfire serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

The listening socket is bound before the model loads, so a port in use fails in a second with a
clear message instead of after loading. The app is in app.py, the endpoints in handlers.py, the
event relay in relay.py; the protocol is documented in docs/PROTOCOL.md."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from ..errors import SpecfireError
from .app import DEFAULT_MAX_REQUEST_BYTES, build_app
from .chat import add_arguments as add_chat_args
from .chat import options_from as chat_options

if TYPE_CHECKING:
    from ..api import LLM

__all__ = ["add_arguments", "main", "build_app", "bind", "default_model_name"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import add_model_args, add_penalty_args

    add_model_args(p, positional=True)
    add_penalty_args(p, what=" (the default of requests that leave the field out)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("SPECFIRE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECFIRE_API_KEY, else open)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint's folder name)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="refuse larger request bodies with 413")
    add_prefix_args(p)
    add_chat_args(p)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="memory for snapshots of recent prompts, so a chat's next turn prefills only what is new "
                        "(0 turns prefix reuse off)")
    p.add_argument("--prefill-piece", type=int, default=1024,
                   help="prompt rows per prefill forward, the granularity of prefix reuse")


def enable_prefix(llm: "LLM", args: argparse.Namespace) -> None:
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.prefill_piece < 1:
        raise ValueError(f"--prefill-piece must be >= 1, got {args.prefill_piece}")
    if args.prefix_cache_mb and llm.tp == 1:
        llm.enable_prefix_cache(args.prefix_cache_mb << 20, args.prefill_piece)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a SpecfireError saying why not (e.g. the port is taken)."""
    if not (0 < port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise SpecfireError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "the port is already in use" if e.errno == 98 else e.strerror
        raise SpecfireError(f"cannot listen on {host}:{port}: {why} (choose another --port)") from None
    sock.set_inheritable(True)
    return sock


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import flagged, load_model, model_defaults_line, penalty_kw
    from ..config import SamplingParams

    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    try:
        defaults = penalty_kw(args)
        SamplingParams(**defaults)                # range errors before the port and the model
    except ValueError as e:
        raise flagged(e) from None
    sock = bind(args.host, args.port)             # before the model: a taken port fails fast
    try:
        llm = load_model(args)
    except BaseException:
        sock.close()
        raise
    try:
        enable_prefix(llm, args)
    except BaseException:
        llm.close()
        sock.close()
        raise
    name = args.served_model_name or default_model_name(llm)
    app = build_app(llm, name, args.api_key, close_llm=True, max_request_bytes=args.max_request_bytes,
                    sampling_defaults=defaults, chat=chat_options(args))
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=args.log_level in ("info", "debug"))

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.serve.cancel_all()  # end running and queued generations now, not after the grace period
            super().handle_exit(sig, frame)

    server = Server(config)
    # the fields a request leaves out that the model's generation_config.json sets (HTTP's
    # built-in temperature is OpenAI's 1; its max_tokens, the rest of the context)
    from_model = llm.generation_defaults.overriding(defaults, {"temperature": 1.0, "max_tokens": None})
    if from_model:
        print(model_defaults_line(llm, from_model), file=sys.stderr, flush=True)
    print(f"[specfire] serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn handles SIGINT / SIGTERM (stop accepting, end streams, run the lifespan shutdown) and then
    # re-raises the signal with the handler that was installed before it; a no-op one makes a SIGTERM
    # shutdown end with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    print("[specfire] server stopped", file=sys.stderr, flush=True)
    return 0


def default_model_name(llm: "LLM") -> str:
    return os.path.basename(os.path.normpath(llm.path)) or "specfire"
