"""`specfire serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

The listening socket is bound before anything heavy is imported or the model loads, so a port in
use fails in a second with a clear message. The app is in app.py, the endpoints in handlers.py,
the event relay in relay.py, who may connect in guard.py, the connection limits in transport.py;
the protocol is documented in docs/PROTOCOL.md."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import SpecfireError
from ..params import PREFIX_CACHE_MB
from .guard import Access, check_api_key
from .transport import (BODY_TIMEOUT_S, HEADER_TIMEOUT_S, LISTEN_BACKLOG, MAX_CONNECTIONS_CAP, MAX_REQUEST_BYTES,
                        FileBudget, check_timeout, guarded_protocol, open_file_limit, quiet_accept_errors)
from .chat_options import add_arguments as add_chat_args
from .chat_options import options_from as chat_options

if TYPE_CHECKING:
    from ..api import LLM
    from .remote import RemoteModel

__all__ = ["add_arguments", "main", "bind", "default_model_name"]

SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def __getattr__(name: str) -> Any:
    if name == "build_app":          # imported on use: fastapi is not needed to parse serve's flags
        from .app import build_app

        return build_app
    raise AttributeError(name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import add_model_args, add_penalty_args
    from ..flags import add_batch_args

    add_model_args(p, positional=True)
    add_batch_args(p)
    add_penalty_args(p, what=" for requests that leave the field out")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECFIRE_API_KEY; unset or "
                        "empty: no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint's folder name)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="refuse larger request bodies with 413")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="web origins (scheme://host[:port], or *) whose pages may call the server, comma-separated "
                        "or a JSON list, repeatable; a request with any other Origin header gets 403 (default: "
                        "none, so only clients that send no Origin: curl, SDKs, scripts)")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="host names (or *.domain, or *) accepted in the Host header besides localhost and IP "
                        "addresses, comma-separated or a JSON list, repeatable (default: any Host, except on a "
                        "loopback --host, where only localhost and IP addresses: a defence against DNS rebinding)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; further ones are answered 503 (default: what the open-file "
                        f"limit, ulimit -n, leaves room for, at most {MAX_CONNECTIONS_CAP})")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a request's line and headers may take to arrive (then 408)")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help="seconds a request body may pause between two pieces (then 408)")
    add_prefix_args(p)
    add_chat_args(p)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-mb", type=int, default=None,
                   help="memory for snapshots of recent prompts, so a chat's next turn prefills only what is new "
                        f"(default {PREFIX_CACHE_MB} on one device, off on a tensor-parallel mesh; 0 turns it off)")
    p.add_argument("--prefill-piece", type=int, default=None,
                   help="prompt rows per prefill forward, the granularity of prefix reuse (default 1024; one device)")


def check_prefix_flags(args: argparse.Namespace) -> None:
    """--prefix-cache-mb and --prefill-piece, before the model loads: a mesh honours neither (its
    ranks prefill in fixed pieces and keep no snapshots), so setting one there is refused."""
    mb, piece = args.prefix_cache_mb, args.prefill_piece
    if mb is not None and mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {mb}")
    if piece is not None and piece < 1:
        raise ValueError(f"--prefill-piece must be >= 1, got {piece}")
    tp = getattr(args, "tp", 1) or 1
    if tp > 1 and (mb or piece is not None):
        flag = "--prefix-cache-mb" if mb else "--prefill-piece"
        raise ValueError(f"{flag}: the prefix cache and its prefill pieces serve one device; this model runs "
                         f"with --tp {tp} (leave {flag} out)")


def enable_prefix(llm: "LLM", args: argparse.Namespace) -> None:
    check_prefix_flags(args)
    mb = PREFIX_CACHE_MB if args.prefix_cache_mb is None else args.prefix_cache_mb
    if mb and llm.tp == 1:
        llm.enable_prefix_cache(mb << 20, args.prefill_piece)


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
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        why = "the port is already in use" if e.errno == 98 else e.strerror
        raise SpecfireError(f"cannot listen on {host}:{port}: {why} (choose another --port)") from None
    sock.set_inheritable(True)
    return sock


def api_key(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--api-key, else $SPECFIRE_API_KEY (through specfire/env.py), checked; and, for an empty one,
    which of the two said so."""
    given, source = args.api_key, "--api-key ''"
    if given is None:
        from ..env import API_KEY, Env

        given, source = Env.read().api_key, f"{API_KEY}=''"
    return check_api_key(given), (source if given == "" else None)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C; then, the model freed, end the process at once (exit_now)."""
    from ..cli import flagged, penalty_kw
    from ..params import SamplingParams

    # ---- everything checkable before the port: flags, the key, the packages ----------------------
    from ..flags import check_batch_flags

    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    check_batch_flags(args)
    try:
        check_prefix_flags(args)
        defaults = penalty_kw(args)
        SamplingParams(**defaults)                # range errors before the port and the model
    except ValueError as e:
        raise flagged(e) from None
    budget = FileBudget(open_file_limit())
    max_connections = budget.max_connections(args.max_connections)
    header_timeout = check_timeout("--header-timeout", args.header_timeout)
    body_timeout = check_timeout("--body-timeout", args.body_timeout)
    access = Access.from_flags(args.allowed_origins, args.allowed_hosts, args.host)
    key, empty_key = api_key(args)
    missing = [m for m in SERVER_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        from ..cli import missing_package   # one wording for every subcommand's missing package

        raise missing_package("serve", ModuleNotFoundError(name=missing[0]))
    sock = bind(args.host, args.port)             # before torch and the model: a taken port fails fast
    # ---- the model and the server -----------------------------------------------------------------
    try:
        import uvicorn

        from .app import build_app
        from .client import EngineClient

        engine = EngineClient.start(args)    # the model loads in the engine process (serve/engine.py)
    except BaseException:
        sock.close()
        raise
    llm = engine.model
    name = args.served_model_name or default_model_name(llm)
    app = build_app(llm, name, key, max_request_bytes=args.max_request_bytes, sampling_defaults=defaults,
                    access=access, body_timeout=body_timeout, chat=chat_options(args), engine=engine)
    st = app.state.serve
    protocol = guarded_protocol(max_connections, header_timeout, budget.refusing, st.metrics)
    config = uvicorn.Config(app, http=protocol, ws="none", backlog=budget.accept_burst,
                            log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=args.log_level in ("info", "debug"))

    class Server(uvicorn.Server):
        signalled = False

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            quiet_accept_errors(asyncio.get_running_loop(), budget.nofile)
            await super().startup(sockets)
            # asyncio listens with the backlog it accepts per wake-up (the accept burst); the
            # kernel's queue may be long, as queued connections hold none of our files
            for s in sockets or []:
                s.listen(LISTEN_BACKLOG)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signalled = True
            st.cancel_all()  # end running and queued generations now, not after the grace period
            super().handle_exit(sig, frame)

    server = Server(config)
    # the fields a request leaves out that the model's generation_config.json sets (HTTP's
    # built-in temperature is OpenAI's 1; its max_tokens, the rest of the context)
    from ..cli import model_defaults_line

    from_model = llm.generation_defaults.overriding(defaults, {"temperature": 1.0, "max_tokens": None})
    if from_model:
        print(model_defaults_line(llm, from_model), file=sys.stderr, flush=True)
    if empty_key:
        say(f"the API key is empty ({empty_key}): requests need no key")
    say(f"serving {name} on http://{args.host}:{args.port}/v1, up to {llm.max_num_seqs} request(s) at once"
        + (f" ({llm.slots.why})" if llm.slots.why else "")
        + ("; tp-invariant: the bits of every --tp degree" if llm.tp_invariant else ""))
    # uvicorn handles SIGINT / SIGTERM (stop accepting, end streams, run the lifespan shutdown) and then
    # re-raises the signal with the handler that was installed before it; a no-op one makes a SIGTERM
    # shutdown end with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    rc = 0
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        rc = 130
    say("server stopped")
    if server.signalled:     # told to end the process
        exit_now(rc)
    return rc


def load(args: argparse.Namespace) -> "LLM":
    from ..cli import load_model

    llm = load_model(args)
    try:
        enable_prefix(llm, args)
    except BaseException:
        llm.close()
        raise
    return llm


def say(line: str) -> None:
    print(f"[specfire] {line}", file=sys.stderr, flush=True)


def exit_now(rc: int) -> NoReturn:
    """End the process once the server has stopped and the model is freed, skipping the
    interpreter's teardown: unloading torch's modules and threads took seconds on a busy machine
    and has nothing left to release."""
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def default_model_name(llm: "LLM | RemoteModel") -> str:
    return os.path.basename(os.path.normpath(llm.path)) or "specfire"
