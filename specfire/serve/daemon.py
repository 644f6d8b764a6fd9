"""`specfire daemon`: JSON lines on stdin/stdout, for tools that drive the engine as a child process.

One message per line in, one event per line out, in order; the protocol is in docs/PROTOCOL.md.
stdout carries only protocol JSON: while the daemon runs, `sys.stdout` points at stderr so a stray
print or progress bar from any library cannot corrupt the stream."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import IO, Any

from ..errors import CheckpointError, SpecfireError
from .schema import (RequestError, check_route, encode_checked, is_int, messages_of, prompt_of, sampling_params,
                     spec_policy)

log = logging.getLogger("specfire")

LOAD_PARAMS = ("tp", "device", "dtype", "kv_dtype", "max_seq_len", "spec", "mtp_path")


class DaemonError(Exception):
    """A refused message: `cls` is the error class clients switch on, `retryable` whether the same
    message may succeed if sent again."""

    def __init__(self, message: str, cls: str, retryable: bool = False):
        super().__init__(message)
        self.message, self.cls, self.retryable = message, cls, retryable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="load this checkpoint at start (as if a load message came first); 'bundled' for the "
                        "bundled model")


class Daemon:
    def __init__(self, out: IO[str]):
        self.out = out
        self.llm: Any = None

    # ---- output ---------------------------------------------------------------------------------
    def emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()

    def error(self, mid: Any, e: DaemonError) -> None:
        self.emit({"type": "error", "id": mid, "message": e.message, "class": e.cls, "retryable": e.retryable})

    # ---- input ----------------------------------------------------------------------------------
    def handle_line(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        mid = None
        try:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError as e:
                raise DaemonError(f"line is not valid JSON: {e}", "parse_error") from None
            if not isinstance(msg, dict):
                raise DaemonError("a message must be a JSON object", "parse_error")
            mid = msg.get("id")
            kind = msg.get("type")
            handler = {"ping": self.ping, "load": self.load, "generate": self.generate,
                       "unload": self.unload}.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise DaemonError(f"unknown message type {kind!r}; expected ping, load, generate or unload",
                                  "invalid_request")
            handler(msg)
        except DaemonError as e:
            self.error(mid, e)
        except RequestError as e:
            self.error(mid, DaemonError(e.message, "invalid_request"))
        except (SpecfireError, ValueError) as e:
            self.error(mid, DaemonError(str(e), "invalid_request"))
        except Exception as e:  # the daemon outlives any one message
            log.exception("message failed")
            oom = "out of memory" in str(e).lower()
            self.error(mid, DaemonError(f"{type(e).__name__}: {e}", "oom" if oom else "internal_error", True))

    def ping(self, msg: dict[str, Any]) -> None:
        self.emit({"type": "pong", "id": msg.get("id")})

    def load(self, msg: dict[str, Any]) -> None:
        from ..api import LLM

        model = msg.get("model")
        if model is not None and not isinstance(model, str):
            raise DaemonError(f"'model' must be a path string or null, got {model!r}", "invalid_request")
        params = msg.get("params") or {}
        if not isinstance(params, dict):
            raise DaemonError(f"'params' must be an object, got {params!r}", "invalid_request")
        unknown = sorted(set(params) - set(LOAD_PARAMS))
        if unknown:
            raise DaemonError(f"'params' has unknown field(s) {unknown}; allowed: {', '.join(LOAD_PARAMS)}",
                              "invalid_request")
        self._unload()
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model, progress=False, **params)
        except (CheckpointError, FileNotFoundError) as e:
            raise DaemonError(str(e), "load_error") from None
        except TypeError as e:
            raise DaemonError(f"bad load params: {e}", "invalid_request") from None
        llm = self.llm
        cfg = llm.cfg
        self.emit({"type": "loaded", "id": msg.get("id"), "model": llm.path, "arch": cfg.model_type,
                   "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size, "mtp": bool(llm.mtp_loaded),
                   "tp": llm.tp, "max_seq_len": llm.engine.trunk.max_seq, "device": str(llm.device),
                   "dtype": str(llm.dtype).replace("torch.", ""), "chat": llm.tokenizer is not None,
                   "load_ms": 1000.0 * (time.perf_counter() - t0)})

    def _unload(self) -> bool:
        if self.llm is None:
            return False
        self.llm.close()
        self.llm = None
        return True

    def unload(self, msg: dict[str, Any]) -> None:
        was = self._unload()
        self.emit({"type": "unloaded", "id": msg.get("id"), "was_loaded": was})

    def generate(self, msg: dict[str, Any]) -> None:
        mid = msg.get("id")
        attempt = msg.get("attempt_id")
        if attempt is None:
            raise DaemonError("'attempt_id' is required (a non-negative integer)", "invalid_request")
        if not is_int(attempt) or attempt < 0:
            raise DaemonError(f"'attempt_id' must be a non-negative integer, got {attempt!r}", "invalid_request")
        if self.llm is None:
            raise DaemonError("no model is loaded: send a load message first", "not_loaded")
        llm = self.llm
        if ("prompt" in msg) == ("messages" in msg):
            raise DaemonError("give exactly one of 'prompt' or 'messages'", "invalid_request")
        if "messages" in msg:
            msgs = messages_of(msg)
            if llm.tokenizer is None:
                raise DaemonError("this model has no tokenizer, so it cannot take messages", "invalid_request")
            ids = encode_checked(llm, llm.tokenizer.render_chat(msgs), "messages")
        else:
            ids = encode_checked(llm, prompt_of(msg), "prompt")
        sp = sampling_params(msg, default_max_tokens=min(256, llm.engine.trunk.max_seq - len(ids)),
                             default_temperature=0.0)
        policy = spec_policy(msg, llm.spec)
        check_route(llm, policy, sp)

        t0 = time.perf_counter()
        self.emit({"type": "gen_start", "id": mid, "attempt_id": attempt, "prompt_tokens": len(ids)})
        ttft = None
        res = None
        for chunk in llm.stream(ids, sp, policy):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            if chunk.text:
                self.emit({"type": "token", "id": mid, "attempt_id": attempt, "text": chunk.text,
                           "ids": chunk.token_ids})
            res = chunk.result
        assert res is not None
        st = res.stats
        self.emit({"type": "done", "id": mid, "attempt_id": attempt, "tokens": st["generated_tokens"],
                   "prefill_tokens": st["prompt_tokens"], "prefill_ms": 1000.0 * st["prefill_s"],
                   "prefill_tok_s": st["prefill_tok_s"], "decode_tok_s": st["decode_tok_s"],
                   "ttft_ms": 1000.0 * (ttft or 0.0), "finish_reason": res.finish_reason,
                   "mean_accept_len": st["mean_accept_len"], "tau": st["mean_accept_len"],
                   "cycles": st["cycles"], "route": st["route"], "k": st["k"]})

    def run(self, inp: IO[str]) -> None:
        for line in inp:
            self.handle_line(line)
        self._unload()


def main(args: argparse.Namespace) -> int:
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)                      # fd 1 (C libraries) and sys.stdout now write to stderr
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        d = Daemon(out)
        if args.model is not None:
            d.handle_line(json.dumps({"type": "load", "model": None if args.model == "bundled" else args.model}))
        d.run(sys.stdin)
    finally:
        sys.stdout = real_stdout
        out.close()
    return 0
