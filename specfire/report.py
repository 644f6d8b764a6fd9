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
            accepted_per_pos=list(stats.get("accepted_per_pos", [])))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def timings(self, ttft_ms: float) -> dict[str, Any]:
        """The per-request `timings` object of the HTTP API and the figures of the daemon's `done`."""
        return {"ttft_ms": ttft_ms, "prefill_ms": self.prefill_ms, "prefill_tok_s": self.prefill_tok_s,
                "decode_ms": self.decode_ms, "decode_tok_s": self.decode_tok_s, "route": self.route,
                "route_reason": self.route_reason, "k": self.k, "cycles": self.cycles, "drafted": self.drafted,
                "accepted": self.accepted, "mean_accept_len": self.mean_accept_len,
                "cached_tokens": self.cached_tokens}

    def summary(self) -> str:
        """The one-line human summary `specfire run` prints to stderr."""
        spec = ""
        if self.cycles:
            per_pos = "/".join(f"{a:.2f}" for a in self.accept_per_pos)
            spec = (f", k={self.k} mean_accept_len {self.mean_accept_len:.2f} ({self.accepted}/{self.drafted} "
                    f"drafts accepted in {self.cycles} cycles, per position {per_pos or '-'})")
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        line = (f"[specfire] {self.prompt_tokens} prompt{cached} + {self.generated_tokens} generated tokens, "
                f"prefill {self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s, "
                f"route {self.route}{spec} ({self.route_reason})")
        if self.context_limited:
            line += "; cut short: the context is full (raise --max-seq-len or shorten the prompt)"
        return line
