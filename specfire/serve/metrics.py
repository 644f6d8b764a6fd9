"""Prometheus metrics for the HTTP server (prometheus_client), named like vLLM's with a `specfire:`
prefix so dashboards written for `vllm:*` work after a prefix swap (docs/PROTOCOL.md lists them).

One registry per app, so two servers in one process (tests) do not share counters. Every method
is thread-safe: the engine worker and the event loop both record."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..report import RequestFigures

PREFIX = "specfire:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        m = {"model_name": model_name}
        lb = ["model_name"]

        def gauge(name: str, help_: str) -> Gauge:
            return Gauge(PREFIX + name, help_, lb, registry=self.registry).labels(**m)

        def counter(name: str, help_: str, extra: list[str] | None = None) -> Counter:
            c = Counter(PREFIX + name, help_, lb + (extra or []), registry=self.registry)
            return c if extra else c.labels(**m)

        def hist(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, help_, lb, buckets=buckets, registry=self.registry).labels(**m)

        self.model = m
        self.running = gauge("num_requests_running", "Requests holding a sequence slot now, each streaming.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a free slot, in arrival order.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV cache in use (used blocks / the "
                              "pool's blocks; on a mesh busy slots / max_num_seqs; 1 = full).")
        self.success = counter("request_success", "Finished requests by finish reason (abort = client left).",
                               ["finished_reason"])
        for reason in FINISH_REASONS:
            self.success.labels(**m, finished_reason=reason)
        self.http_errors = counter("http_errors", "Requests refused with an HTTP error, by status code.", ["status"])
        self.disconnects = counter("http_client_disconnects",
                                   "Clients that hung up before their request was read whole (no answer sent).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (cached ones included).")
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = hist("time_to_first_token_seconds", "Time from request arrival to the first token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from request arrival to its end.", E2E_BUCKETS)
        self.drafts = counter("spec_decode_num_drafts", "Speculative cycles that drafted tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ["position"])

    # ---- recording ------------------------------------------------------------------------------
    def queued(self) -> None:
        self.waiting.inc()

    def started(self) -> None:
        self.waiting.dec()
        self.running.inc()

    def kv_used(self, share: float) -> None:
        self.kv_usage.set(share)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens_arrived(self, gap_s: float, n: int) -> None:
        """A chunk of n tokens arrived gap_s after the previous one: n inter-token gaps of gap_s / n."""
        for _ in range(max(0, n)):
            self.itl.observe(gap_s / n)

    def finished(self, reason: str, e2e_s: float, fig: RequestFigures | None, started: bool = True) -> None:
        (self.running if started else self.waiting).dec()
        self.success.labels(**self.model, finished_reason=reason).inc()
        self.e2e.observe(e2e_s)
        if fig is None:
            return
        self.prompt_tokens.inc(fig.prompt_tokens)
        self.cached_tokens.inc(fig.cached_tokens)
        self.generation_tokens.inc(fig.generated_tokens)
        if fig.cycles:                     # any drafting cycle, whatever route `auto` settled on
            self.drafts.inc(fig.cycles)
            self.draft_tokens.inc(fig.drafted)
            self.accepted_tokens.inc(fig.accepted)
            for i, a in enumerate(fig.accepted_per_pos):
                self.accepted_per_pos.labels(**self.model, position=str(i)).inc(a)

    def http_error(self, status: int) -> None:
        self.http_errors.labels(**self.model, status=str(status)).inc()

    def client_disconnected(self) -> None:
        self.disconnects.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
