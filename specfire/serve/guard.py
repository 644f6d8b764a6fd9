"""Who may reach the server: the API key's form, and a browser's defences against cross-site
requests (CSRF) and DNS rebinding, as an ASGI middleware in front of every route.

A request whose `Origin` header is present and not in `--allowed-origins` (none by default) is
refused with 403; a CORS preflight from an allowed origin is answered, and its responses carry
`Access-Control-Allow-Origin`. A server listening on a loopback address also refuses a `Host` that
is neither a local name, an IP address nor in `--allowed-hosts`: a rebound DNS name reaches it
only with its own name in `Host`."""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ORIGIN = re.compile(r"^https?://[^/\s?#]+$")
METHODS = "GET, POST, OPTIONS"


def check_api_key(key: str | None) -> str | None:
    """The key as given, or None for none ("" included); a key no client could send is refused."""
    if not key:
        return None
    if key != key.strip():
        raise ValueError("the API key (--api-key / SPECFIRE_API_KEY) has leading or trailing whitespace, which "
                         "no Authorization header can carry; remove it")
    bad = next((c for c in key if not (" " <= c <= "~")), None)
    if bad is not None:
        raise ValueError(f"the API key (--api-key / SPECFIRE_API_KEY) holds {bad!r} (U+{ord(bad):04X}); a key "
                         f"must be printable ASCII")
    return key


def flag_list(values: list[str] | None, flag: str) -> list[str] | None:
    """A repeatable list flag's values: each a JSON array (vLLM's form) or comma-separated."""
    if values is None:
        return None
    out: list[str] = []
    for v in values:
        v = v.strip()
        if v.startswith("["):
            try:
                items = json.loads(v)
            except json.JSONDecodeError:
                items = None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"{flag} {v!r} is not a JSON array of strings")
            out += [x.strip() for x in items if x.strip()]
        else:
            out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def host_name(header: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, no trailing dot, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":")[0]
    return h.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(address: str) -> bool:
    """An address or name that only this machine can reach (the server's --host)."""
    name = address.strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """origins: allowed `Origin` values ("*": any). hosts: names allowed in `Host` beyond local
    names and IP addresses ("*.example.com": its subdomains), or None for any `Host`."""

    origins: tuple[str, ...] = ()
    hosts: tuple[str, ...] | None = None

    @staticmethod
    def from_flags(origins: list[str] | None, hosts: list[str] | None, listen_host: str) -> "Access":
        """--allowed-origins / --allowed-hosts; with no --allowed-hosts, a loopback server answers
        local names and IP addresses only, any other server any Host."""
        os_: list[str] = []
        for o in flag_list(origins, "--allowed-origins") or []:
            n = o.lower().rstrip("/")
            if n not in ("*", "null") and not ORIGIN.match(n):
                raise ValueError(f"--allowed-origins {o!r} is not an origin: give scheme://host[:port] "
                                 f"(e.g. http://localhost:3000), null or *")
            os_.append(n)
        given = flag_list(hosts, "--allowed-hosts")
        if given is None:
            return Access(tuple(os_), () if is_loopback(listen_host) else None)
        hs: list[str] = []
        for h in given:
            n = h.lower().rstrip(".")
            if n != "*" and (not n or "/" in n or ":" in n or " " in n or "*" in n[1:]):
                raise ValueError(f"--allowed-hosts {h!r} is not a host name: give names without a port "
                                 f"(example.com, *.example.com) or *")
            hs.append(n)
        return Access(tuple(os_), None if "*" in hs else tuple(hs))

    def origin_ok(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().lower().rstrip("/") in self.origins

    def host_ok(self, header: str) -> bool:
        if self.hosts is None:
            return True
        name = host_name(header)
        if name == "localhost" or name.endswith(".localhost") or is_ip(name):
            return True
        for pat in self.hosts:
            if name == pat or (pat.startswith("*.") and name.endswith(pat[1:])):
                return True
        return False


def refusal(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "permission_error", "param": None, "code": code}}


class AccessMiddleware:
    """Checks Host and Origin before any route runs; answers CORS preflights of allowed origins."""

    def __init__(self, app: ASGIApp, access: Access, on_refused: Callable[[int], None] = lambda status: None):
        self.app, self.access, self.on_refused = app, access, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host, origin = headers.get("host"), headers.get("origin")
        if host is not None and not self.access.host_ok(host):
            await self.refuse(send, refusal(
                f"Host {host!r} is not allowed: this server listens on a loopback address and answers only "
                f"localhost and IP addresses (a defence against DNS rebinding); name it with --allowed-hosts",
                "host_not_allowed"))
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.access.origin_ok(origin):
            await self.refuse(send, refusal(
                f"Origin {origin!r} is not allowed: pages from other sites may not call this server; allow it "
                f"with --allowed-origins {origin}", "origin_not_allowed"))
            return
        allow = [(b"access-control-allow-origin", b"*" if "*" in self.access.origins else origin.encode("latin-1")),
                 (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers", "authorization, content-type")
            await send({"type": "http.response.start", "status": 204, "headers": allow + [
                (b"access-control-allow-methods", METHODS.encode()),
                (b"access-control-allow-headers", asked.encode("latin-1")),
                (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_allowed(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": list(msg.get("headers", [])) + allow}
            await send(msg)

        await self.app(scope, receive, send_allowed)

    async def refuse(self, send: Send, body: dict[str, Any]) -> None:
        self.on_refused(403)
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})
