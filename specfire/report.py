"""RequestFigures: the one projection of a generation's stats that the CLI, the daemon, the HTTP
server and its metrics print, so the three front ends cannot drift apart."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestFigures:
    """What one generation did and how fast; times in milliseconds."""

    prompt_tokens: int
    generated_tokens: int
    finish_reason: str                  # "stop" | "length"
    context_limited: bool               # "length" because the context ran out before max_tokens
    cached_tokens: int                  # prompt tokens served from a prefix cache
    route: str                          # "ar" | "mtp" | "ngram"
    route_reason: str
    k: int
    cycles: int
    drafted: int
    accepted: int
    mean_accept_len: float
    prefill_ms: float
    prefill_tok_s: float
    decode_ms: float
    decode_tok_s: float
    accept_per_pos: list[float] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    per_route: dict[str, dict[str, Any]] = field(default_factory=dict)   # what each route that ran did

    @classmethod
    def of(cls, stats: dict[str, Any], finish_reason: str, max_tokens: int) -> "RequestFigures":
        """From an engine result's `stats`; `max_tokens` is what the request asked for."""
        gen = int(stats["generated_tokens"])
        return cls(
            prompt_tokens=int(stats["prompt_tokens"]), generated_tokens=gen, finish_reason=finish_reason,
            context_limited=finish_reason == "length" and gen < max_tokens,
            cached_tokens=int(stats.get("cached_tokens", 0)), route=stats["route"],
            route_reason=stats["route_reason"], k=int(stats["k"]), cycles=int(stats["cycles"]),
            drafted=int(stats["drafted"]), accepted=int(stats["accepted"]),
            mean_accept_len=float(stats["mean_accept_len"]),
            prefill_ms=1000.0 * stats["prefill_s"], prefill_tok_s=float(stats["prefill_tok_s"]),
            decode_ms=1000.0 * stats["decode_s"], decode_tok_s=float(stats["decode_tok_s"]),
            accept_per_pos=list(stats.get("accept_per_pos", [])),
            accepted_per_pos=list(stats.get("accepted_per_pos", [])),
            per_route={r: dict(c) for r, c in stats.get("per_route", {}).items()})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def timings(self, ttft_ms: float) -> dict[str, Any]:
        """The per-request `timings` object of the HTTP API and the figures of the daemon's `done`."""
        return {"ttft_ms": ttft_ms, "prefill_ms": self.prefill_ms, "prefill_tok_s": self.prefill_tok_s,
                "decode_ms": self.decode_ms, "decode_tok_s": self.decode_tok_s, "route": self.route,
                "route_reason": self.route_reason, "k": self.k, "cycles": self.cycles, "drafted": self.drafted,
                "accepted": self.accepted, "mean_accept_len": self.mean_accept_len,
                "cached_tokens": self.cached_tokens, "per_route": self.per_route}

    def summary(self) -> str:
        """The one-line human summary `specfire run` prints to stderr: the route, and where `auto`
        ran several, each one's tokens and the acceptance of the drafting ones."""
        routes = self.per_route
        what = "ar" if self.route == "ar" else f"{self.route}, k={self.k}"
        if set(routes) <= {self.route}:
            ran = f"route {what}" + (f" {_drafts(routes[self.route])}" if self.route in routes and self.route != "ar"
                                     else "")
        else:
            ran = (f"route auto, settled on {what}: first token from the prefill; "
                   + "; ".join(f"{r} {_n(c['tokens'], 'token')}" + ("" if r == "ar" else f", {_drafts(c)}")
                               for r, c in routes.items()))
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        line = (f"[specfire] {self.prompt_tokens} prompt{cached} + {self.generated_tokens} generated tokens, "
                f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s, "
                f"{ran} ({self.route_reason})")
        if self.context_limited:
            line += "; cut short: the context is full (raise --max-seq-len or shorten the prompt)"
        return line


def _drafts(c: dict[str, Any]) -> str:
    """A drafting route's acceptance: mean_accept_len (drafts accepted in cycles, per position
    where a cycle drafted more than one)."""
    bare = c["steps"] - c["cycles"]
    if not c["cycles"]:
        return f"no drafts in {_n(bare, 'step')}"
    rates = c.get("accept_per_pos", [])
    per_pos = f", per position {'/'.join(f'{a:.2f}' for a in rates)}" if len(rates) > 1 else ""
    without = f", {_n(bare, 'step')} without a draft" if bare else ""
    return (f"mean_accept_len {c['mean_accept_len']:.2f} ({c['accepted']}/{c['drafted']} drafts accepted in "
            f"{_n(c['cycles'], 'cycle')}{per_pos}{without})")


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
