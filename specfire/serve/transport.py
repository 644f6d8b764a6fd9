"""The connection layer under uvicorn: a connection limit below the open-file limit, a deadline for
a request's headers, and one log line (not thousands) when accept runs out of file descriptors.

Without these, sockets that send half a request hold a file descriptor each for as long as they
like; past the open-file limit every accept fails, /health stops answering and asyncio logs each
failed accept. Imports nothing heavy at module level: `specfire serve` reads the defaults before
it binds its port."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("specfire")

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused with 413
HEADER_TIMEOUT_S = 10.0      # a request's line and headers must arrive within this
BODY_TIMEOUT_S = 30.0        # at most this long between two pieces of a request body
MAX_CONNECTIONS_CAP = 4096   # past max_num_seqs requests wait: more waiting connections only cost memory
LINGER_S = 1.0               # how long a refused connection may take to send its request (then dropped)
LOG_EVERY_S = 10.0
LISTEN_BACKLOG = 2048        # connections the kernel queues before accept (they hold no file of ours)


def open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(frozen=True)
class FileBudget:
    """How the open-file limit is split: connections served, connections being refused (each
    answered 503 while it lingers), accept bursts (asyncio accepts up to `accept_burst` sockets per
    wake-up and a refused one closes two loop turns later, so three bursts may be open at once)
    and the files the engine itself holds."""

    nofile: int

    @property
    def accept_burst(self) -> int:
        return min(64, max(8, self.nofile // 16))

    @property
    def refusing(self) -> int:
        return min(64, max(4, self.nofile // 16))

    @property
    def reserve(self) -> int:
        return min(128, max(16, self.nofile // 8))

    @property
    def most_connections(self) -> int:
        return self.nofile - 3 * self.accept_burst - self.refusing - self.reserve

    def max_connections(self, given: int | None) -> int:
        """`--max-connections` (None: the most the file limit allows, at most MAX_CONNECTIONS_CAP)."""
        most = self.most_connections
        if given is None:
            if most < 1:
                raise ValueError(f"the open-file limit (ulimit -n {self.nofile}) leaves no room for connections; "
                                 f"raise it")
            return min(most, MAX_CONNECTIONS_CAP)
        if given < 1:
            raise ValueError(f"--max-connections must be >= 1, got {given}")
        if given > most:
            raise ValueError(f"--max-connections {given} needs more open files than this process may have "
                             f"(ulimit -n {self.nofile} allows at most {max(most, 0)}); raise the limit or lower "
                             f"--max-connections")
        return given


def check_timeout(flag: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    return value


class Every:
    """Lets a repeated event through at most once per `period_s`, counting the ones held back."""

    def __init__(self, period_s: float = LOG_EVERY_S):
        self.period_s, self.last, self.held = period_s, -math.inf, 0

    def due(self) -> int | None:
        """None while held back; else how many were held back since the last one let through."""
        now = time.monotonic()
        if now - self.last < self.period_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, nofile: int) -> None:
    """asyncio logs every accept that fails for want of file descriptors, with a traceback, many
    times per wake-up; log one line per LOG_EVERY_S instead and leave other errors as they were."""
    gate = Every()

    def handler(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        if str(ctx.get("message", "")).startswith("socket.accept() out of system resource"):
            held = gate.due()
            if held is not None:
                more = f" ({held} more since the last report)" if held else ""
                log.warning("cannot accept connections: %s (ulimit -n %d)%s", ctx.get("exception"), nofile, more)
            return
        lp.default_exception_handler(ctx)

    loop.set_exception_handler(handler)


def raw_error(status: int, reason: str, message: str, code: str, type_: str = "server_error",
              extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response in the OpenAI error shape, for a connection no request reached."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode("ascii") + body


def guarded_protocol(max_connections: int, header_timeout: float, refusing: int,
                     metrics: "Metrics | None" = None) -> type:
    """uvicorn's h11 protocol with a connection limit and a header deadline (uvicorn has neither:
    its keep-alive timer stops at a request's first byte). Over `max_connections` open connections a
    new one is answered 503 and closed once its request arrives (or after LINGER_S), so the client
    reads the answer rather than a reset; beyond `refusing` more, it is closed unanswered."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = raw_error(503, "Service Unavailable", f"the server has {max_connections} connections open, its limit "
                     "(--max-connections); try again later", "too_many_connections", extra="retry-after: 1\r\n")
    late = raw_error(408, "Request Timeout", f"the request's headers did not arrive within {header_timeout:g} s "
                     "(--header-timeout)", "request_timeout", type_="invalid_request_error")
    refused_log = Every()

    class GuardedH11Protocol(H11Protocol):
        refused = False
        heard = False                                  # some of the pending request has arrived
        header_timer: asyncio.TimerHandle | None = None
        linger_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            n = len(self.connections)
            if n <= max_connections:
                self._arm()
                return
            self.refused = True
            if n > max_connections + refusing:
                transport.abort()
                return
            if metrics is not None:
                metrics.http_error(503)
            held = refused_log.due()
            if held is not None:
                log.warning("refusing connections: %d open (--max-connections %d)%s", n - 1, max_connections,
                            f"; {held} more refused since the last report" if held else "")
            transport.write(busy)
            self.linger_timer = self.loop.call_later(LINGER_S, transport.close)

        def data_received(self, data: bytes) -> None:
            if self.refused:                           # its request, read (closing with it unread would send a
                self.transport.close()                 # reset, which can discard the 503 before the client reads it)
                return
            if self.conn.their_state is h11.IDLE:
                if self.header_timer is None:
                    self._arm()                        # the next request on a kept-alive connection
                self.heard = True
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self.linger_timer is not None:
                self.linger_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            self.heard = False

        def _header_timeout(self) -> None:
            """408 for a request begun and not finished; a connection that sent nothing is just closed."""
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.heard:
                    if metrics is not None:
                        metrics.http_error(408)
                    self.transport.write(late)
                self.transport.close()

    return GuardedH11Protocol
