"""The operational environment knobs, in one typed place: read by `Env.read()` where a server or a
mesh starts (no other module reads a SPECFIRE_* variable)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

API_KEY = "SPECFIRE_API_KEY"          # the server's bearer key (--api-key's default)
TP_TIMEOUT = "SPECFIRE_TP_TIMEOUT"    # seconds a mesh collective may wait for a peer
DEFAULT_TP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Env:
    api_key: str | None = None
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> "Env":
        """The knobs from `environ`; a bad value is refused naming the variable and what is allowed."""
        return cls(api_key=environ.get(API_KEY) or None, tp_timeout_s=_seconds(environ, TP_TIMEOUT, DEFAULT_TP_TIMEOUT_S))


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0 < v < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return v
