"""Prometheus text metrics for the HTTP server, named like vLLM's with a `specfire:` prefix so
dashboards written for `vllm:*` work after a prefix swap (docs/PROTOCOL.md lists them).

Written by hand (no prometheus_client dependency): a few counters, gauges and histograms behind
one lock, rendered in the text exposition format 0.0.4."""
from __future__ import annotations

import bisect
import threading
from typing import Any

PREFIX = "specfire:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in d.items())
    return "{" + body + "}"


def _num(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if not float(x).is_integer() else f"{x:.1f}"


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf overflow
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """Server-wide counters; every method is thread-safe (the engine worker and the event loop both
    record)."""

    def __init__(self, model_name: str):
        self.lock = threading.Lock()
        self.base = {"model_name": model_name}
        self.running = 0
        self.waiting = 0
        self.success: dict[str, int] = {}
        self.http_errors: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)

    # ---- recording ------------------------------------------------------------------------------
    def queued(self) -> None:
        with self.lock:
            self.waiting += 1

    def started(self) -> None:
        with self.lock:
            self.waiting -= 1
            self.running += 1

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def tokens_arrived(self, gap_s: float, n: int) -> None:
        """A chunk of n tokens arrived gap_s after the previous one: n inter-token gaps of gap_s / n."""
        if n <= 0:
            return
        with self.lock:
            for _ in range(n):
                self.itl.observe(gap_s / n)

    def finished(self, reason: str, e2e_s: float, stats: dict[str, Any] | None, started: bool = True) -> None:
        with self.lock:
            if started:
                self.running -= 1
            else:
                self.waiting -= 1
            self.success[reason] = self.success.get(reason, 0) + 1
            self.e2e.observe(e2e_s)
            if stats:
                self.prompt_tokens += int(stats.get("prompt_tokens", 0))
                self.generation_tokens += int(stats.get("generated_tokens", 0))
                if stats.get("route", "ar") != "ar":
                    self.drafts += int(stats.get("cycles", 0))
                    self.draft_tokens += int(stats.get("drafted", 0))
                    self.accepted_tokens += int(stats.get("accepted", 0))
                    per = stats.get("accepted_per_pos") or []
                    while len(self.accepted_per_pos) < len(per):
                        self.accepted_per_pos.append(0)
                    for i, a in enumerate(per):
                        self.accepted_per_pos[i] += int(a)

    def http_error(self, status: int) -> None:
        with self.lock:
            self.http_errors[str(status)] = self.http_errors.get(str(status), 0) + 1

    # ---- rendering ------------------------------------------------------------------------------
    def render(self) -> str:
        out: list[str] = []
        b = self.base

        def head(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {PREFIX}{name} {help_}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")

        def line(name: str, value: float, extra: dict[str, str] | None = None) -> None:
            out.append(f"{PREFIX}{name}{_labels({**b, **(extra or {})})} {_num(value)}")

        def hist(name: str, h: _Histogram, help_: str) -> None:
            head(name, "histogram", help_)
            acc = 0
            for le, c in zip(list(h.buckets) + [float("inf")], h.counts):
                acc += c
                line(f"{name}_bucket", acc, {"le": _num(le)})
            line(f"{name}_sum", h.sum)
            line(f"{name}_count", h.count)

        with self.lock:
            head("num_requests_running", "gauge", "Requests in the engine now (0 or 1: one engine, one stream).")
            line("num_requests_running", self.running)
            head("num_requests_waiting", "gauge", "Requests queued behind the running one.")
            line("num_requests_waiting", self.waiting)
            head("request_success_total", "counter", "Finished requests by finish reason (abort = client left).")
            for reason in sorted(set(self.success) | {"stop", "length"}):
                line("request_success_total", self.success.get(reason, 0), {"finished_reason": reason})
            head("http_errors_total", "counter", "Requests refused with an HTTP error, by status code.")
            for code in sorted(self.http_errors):
                line("http_errors_total", self.http_errors[code], {"status": code})
            head("prompt_tokens_total", "counter", "Prefill tokens processed.")
            line("prompt_tokens_total", self.prompt_tokens)
            head("generation_tokens_total", "counter", "Generated tokens.")
            line("generation_tokens_total", self.generation_tokens)
            hist("time_to_first_token_seconds", self.ttft, "Time from request arrival to the first token.")
            hist("inter_token_latency_seconds", self.itl, "Time between generated tokens.")
            hist("e2e_request_latency_seconds", self.e2e, "Time from request arrival to its end.")
            head("spec_decode_num_drafts_total", "counter", "Speculative cycles that drafted tokens.")
            line("spec_decode_num_drafts_total", self.drafts)
            head("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.")
            line("spec_decode_num_draft_tokens_total", self.draft_tokens)
            head("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.")
            line("spec_decode_num_accepted_tokens_total", self.accepted_tokens)
            head("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                 "Draft tokens accepted at each draft position.")
            for i, a in enumerate(self.accepted_per_pos):
                line("spec_decode_num_accepted_tokens_per_pos_total", a, {"position": str(i)})
        return "\n".join(out) + "\n"
