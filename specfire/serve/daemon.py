"""`specfire daemon`: JSON lines on stdin/stdout, for tools that drive the engine as a child process.

One message per line in, one event per line out, in order; the protocol is in docs/PROTOCOL.md.
A reader thread feeds stdin lines to a queue; the main thread handles each line in its turn and,
while generations run, drives the model's scheduler (runtime/scheduler.py) one round at a time,
so concurrent generates share the steps (up to max_num_seqs; more wait in arrival order) and
`ping` / `cancel` are answered between rounds. A `load` or `unload` waits for the generations
before it to end. The end of input means no more input (`specfire daemon < requests.jsonl`):
every line read before it is answered, then the daemon exits. stdout carries only protocol JSON:
while the daemon runs, `sys.stdout` points at stderr so a stray print from any library cannot
corrupt the stream; a reader that goes away (`specfire daemon | head`) ends the daemon quietly."""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Iterable

from ..errors import CheckpointError, SpecfireError
from ..params import PREFIX_CACHE_MB
from .chat_options import REASONING_PARSERS, ChatOptions
from .schema import GenerateMessage, check_route, encode, sampling_params, spec_policy, validate
from .wire import RequestError, check_tree

if TYPE_CHECKING:
    from ..api import LLM
    from .assistant import AssistantOutput

log = logging.getLogger("specfire")

LOAD_PARAMS = ("tp", "device", "dtype", "kv_dtype", "max_seq_len", "spec", "mtp_path", "prefix_cache_mb",
               "prefill_piece", "draft_vocab", "generation_config", "max_num_seqs", "kv_cache_memory_bytes",
               "tp_invariant")
BARRIERS = ("load", "unload")      # wait for every generation before them to end
DEFAULT_MAX_TOKENS = 256
EOF = None


class DaemonError(Exception):
    """A refused message: `cls` is the error class clients switch on, `retryable` whether the same
    message may succeed if sent again."""

    def __init__(self, message: str, cls: str, retryable: bool = False):
        super().__init__(message)
        self.message, self.cls, self.retryable = message, cls, retryable


@dataclass(eq=False)
class Attempt:
    """A generate message the scheduler holds (waiting or running)."""

    mid: Any
    attempt: int
    params: Any
    prompt_tokens: int
    t0: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    tokens: int = 0
    started: bool = False
    cancelled_by: dict[str, Any] | None = None   # the cancel message that stopped it
    req: Any = None                     # its runtime.scheduler.Request
    out: "AssistantOutput | None" = None   # a `messages` generate: its answer split into reasoning / content


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="load this checkpoint at start (as if a load message came first); 'bundled' for the "
                        "bundled model")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="default draft_vocab of every load: the MTP drafter scores token ids 0..N-1 only "
                        "(a load message's params.draft_vocab overrides it)")
    p.add_argument("--generation-config", default=None, choices=("auto", "none"),
                   help="default generation_config of every load (a load message's params.generation_config "
                        "overrides it): auto, the checkpoint's generation_config.json supplies the default "
                        "sampling of a generate message; none, the built-in defaults (default: auto)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="default max_num_seqs of every load: generations that run at once (more wait in "
                        "arrival order; default: 8 on a GPU, 4 on a CPU)")
    p.add_argument("--tp-invariant", action="store_true",
                   help="default tp_invariant of every load: the bits every tp degree computes, one device "
                        "included (a load message's params.tp_invariant overrides it)")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="as serve's: a messages generate's <think> block goes to the events' reasoning, the rest "
                        "to content, and a structured output starts after it (default: when the template "
                        "writes them)")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Daemon:
    def __init__(self, out: IO[bytes], draft_vocab: int | None = None, generation_config: str | None = None,
                 max_num_seqs: int | None = None, tp_invariant: bool = False, chat: ChatOptions | None = None):
        self.out = out
        self.chat = chat or ChatOptions()      # --reasoning-parser: how messages are prepared and split
        self.draft_vocab = draft_vocab         # --draft-vocab: the default of every load
        self.generation_config = generation_config   # --generation-config: the default of every load
        self.max_num_seqs = max_num_seqs       # --max-num-seqs: the default of every load
        self.tp_invariant = tp_invariant       # --tp-invariant: the default of every load
        self.attempts: dict[int, Attempt] = {}   # generates the scheduler holds, by attempt_id
        self.llm: "LLM | None" = None
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.pending: collections.deque[bytes] = collections.deque()  # read during a generation, not yet handled
        self.closed = False                    # stdout's reader has gone
        self.eof = False                       # stdin has ended

    # ---- output ---------------------------------------------------------------------------------
    def emit(self, obj: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            line = json.dumps(obj, ensure_ascii=False) + "\n"
            data = line.encode("utf-8")
        except UnicodeEncodeError:             # a lone surrogate: the escaped form is still valid JSON
            data = (json.dumps(obj) + "\n").encode("ascii")
        try:
            self.out.write(data)
            self.out.flush()
        except (BrokenPipeError, ConnectionResetError, ValueError):
            self.closed = True

    def error(self, mid: Any, e: DaemonError, attempt: int | None = None) -> None:
        ev: dict[str, Any] = {"type": "error", "id": mid}
        if attempt is not None:
            ev["attempt_id"] = attempt
        self.emit({**ev, "message": e.message, "class": e.cls, "retryable": e.retryable})

    # ---- input ----------------------------------------------------------------------------------
    def run(self, inp: Iterable[bytes]) -> None:
        """Handle every line of `inp` (read on a thread), those before its end included, then
        return; stdout's reader leaving ends it at once."""
        def read() -> None:
            try:
                for raw in inp:
                    self.lines.put(raw)
            finally:
                self.lines.put(EOF)

        threading.Thread(target=read, name="specfire-stdin", daemon=True).start()
        try:
            while not self.closed:
                self.poll()
                if self.pending and not (self.attempts and self._kind(self.pending[0]) in BARRIERS):
                    self.handle_line(self.pending.popleft())
                elif self.attempts:
                    assert self.llm is not None
                    self.llm.scheduler.run_round()     # events go out through each attempt's listener
                elif self.eof:
                    break
                else:
                    raw = self.lines.get()
                    if raw is EOF:
                        self.eof = True
                    else:
                        self.pending.append(raw)
        finally:
            self._unload()

    def _kind(self, raw: bytes) -> Any:
        try:
            return self.parse(raw).get("type")
        except DaemonError:
            return None

    def handle_line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        mid: Any = None
        attempt: int | None = None
        try:
            msg = self.parse(raw)
            mid = msg.get("id")
            try:
                check_tree(mid)
            except RequestError:
                mid = None                       # an id that cannot be echoed faithfully
            kind = msg.get("type")
            if kind == "generate" and is_int(msg.get("attempt_id")) and msg["attempt_id"] >= 0:
                attempt = msg["attempt_id"]
            check_tree(msg)
            handler = {"ping": self.ping, "load": self.load, "generate": self.generate, "unload": self.unload,
                       "cancel": self.cancel}.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise DaemonError(f"unknown message type {kind!r}; expected ping, load, generate, cancel or "
                                  f"unload", "invalid_request")
            handler(msg)
        except DaemonError as e:
            self.error(mid, e, attempt)
        except (RequestError, SpecfireError, ValueError) as e:
            self.error(mid, DaemonError(e.message if isinstance(e, RequestError) else str(e), "invalid_request"),
                       attempt)
        except Exception as e:  # the daemon outlives any one message
            log.exception("message failed")
            oom = "out of memory" in str(e).lower()
            self.error(mid, DaemonError(f"{type(e).__name__}: {e}", "oom" if oom else "internal_error", True),
                       attempt)

    @staticmethod
    def parse(raw: bytes) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DaemonError(f"line is not valid UTF-8 (byte {e.start})", "parse_error") from None
        try:
            msg = json.loads(text)
        except json.JSONDecodeError as e:
            raise DaemonError(f"line is not valid JSON: {e}", "parse_error") from None
        except RecursionError:
            raise DaemonError("line is nested too deeply", "parse_error") from None
        if not isinstance(msg, dict):
            raise DaemonError("a message must be a JSON object", "parse_error")
        return msg

    # ---- messages -------------------------------------------------------------------------------
    def ping(self, msg: dict[str, Any]) -> None:
        self.emit({"type": "pong", "id": msg.get("id")})

    def cancel(self, msg: dict[str, Any]) -> None:
        """Cancel attempt `attempt_id`: one the scheduler holds stops at its next step boundary (it
        then ends with `aborted` and this `cancelled`); one still waiting in line here is dropped now."""
        attempt = msg.get("attempt_id")
        if not is_int(attempt) or attempt < 0:
            raise DaemonError(f"'attempt_id' must be a non-negative integer, got {attempt!r}", "invalid_request")
        held = self.attempts.get(attempt)
        if held is not None and held.cancelled_by is None:
            held.cancelled_by = msg
            held.req.cancel.set()
            return
        found = False
        for raw in list(self.pending):
            try:
                m = self.parse(raw)
            except DaemonError:
                continue
            if m.get("type") == "generate" and m.get("attempt_id") == attempt:
                self.pending.remove(raw)
                self.emit({"type": "aborted", "id": m.get("id"), "attempt_id": attempt, "tokens": 0,
                           "reason": "cancel"})
                found = True
                break
        self.emit({"type": "cancelled", "id": msg.get("id"), "attempt_id": attempt, "found": found})

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
        params = dict(params)
        if self.max_num_seqs is not None:
            params.setdefault("max_num_seqs", self.max_num_seqs)
        if self.draft_vocab is not None:
            params.setdefault("draft_vocab", self.draft_vocab)
        if self.generation_config is not None:
            params.setdefault("generation_config", self.generation_config)
        if self.tp_invariant:
            params.setdefault("tp_invariant", True)
        given = params.get("prefix_cache_mb")
        cache_mb = params.pop("prefix_cache_mb", PREFIX_CACHE_MB)
        piece = params.pop("prefill_piece", None)
        tp = params.get("tp", 1)
        if is_int(tp) and tp > 1 and (given or piece is not None):     # a mesh honours neither
            name = "prefix_cache_mb" if given else "prefill_piece"
            raise DaemonError(f"'params.{name}': the prefix cache and its prefill pieces serve one device; "
                              f"this load has tp={tp} (leave it out)", "invalid_request")
        if not is_int(cache_mb) or cache_mb < 0:
            raise DaemonError(f"'params.prefix_cache_mb' must be an integer >= 0, got {cache_mb!r}", "invalid_request")
        if piece is not None and (not is_int(piece) or piece < 1):
            raise DaemonError(f"'params.prefill_piece' must be a positive integer, got {piece!r}", "invalid_request")
        self.finish_generations()
        self._unload()
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model, progress=False, **params)
            if cache_mb and self.llm.tp == 1:
                self.llm.enable_prefix_cache(cache_mb << 20, piece)
        except (CheckpointError, FileNotFoundError) as e:
            raise DaemonError(str(e), "load_error") from None
        except TypeError as e:
            raise DaemonError(f"bad load params: {e}", "invalid_request") from None
        llm = self.llm
        cfg = llm.cfg
        self.emit({"type": "loaded", "id": msg.get("id"), "model": llm.path, "arch": cfg.model_type,
                   "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size, "mtp": bool(llm.mtp_loaded),
                   "tp": llm.tp, "tp_invariant": llm.tp_invariant, "max_seq_len": llm.max_model_len,
                   "max_num_seqs": llm.max_num_seqs,
                   "device": str(llm.device),
                   "dtype": str(llm.dtype).replace("torch.", ""), "chat": llm.tokenizer is not None,
                   "sampling_defaults": llm.generation_defaults.as_dict(),
                   "load_ms": 1000.0 * (time.perf_counter() - t0)})

    def finish_generations(self) -> None:
        """Run the scheduler until every generation the daemon holds has ended (a load or unload
        waits for them; the run loop keeps answering pings and cancels meanwhile)."""
        if self.llm is not None and self.attempts:
            self.llm.scheduler.drive_until(lambda: not self.attempts)

    def _unload(self) -> bool:
        if self.llm is None:
            return False
        self.llm.close()
        self.llm = None
        return True

    def unload(self, msg: dict[str, Any]) -> None:
        self.finish_generations()
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
        b: GenerateMessage = validate(GenerateMessage, msg)
        if b.chat_template_kwargs is not None and b.messages is None:
            raise DaemonError("'chat_template_kwargs' goes with 'messages' (a prompt is not rendered)",
                              "invalid_request")
        prep = None
        if b.messages is not None:
            if llm.tokenizer is None:
                raise DaemonError("this model has no tokenizer, so it cannot take messages", "invalid_request")
            from .chat import prepare_chat

            # the HTTP chat endpoint's preparation: control tokens typed in text stay text, and the
            # reasoning parser decides where a grammar starts and how the answer is split
            prep = prepare_chat(llm, b.messages, {}, b.chat_template_kwargs or {}, self.chat)
            ids = prep.ids
        else:
            ids = encode(llm, b.prompt, "prompt")
        sp = sampling_params(b, default_max_tokens=DEFAULT_MAX_TOKENS, default_temperature=0.0,
                             defaults=llm.generation_defaults.as_dict(), room=llm.max_model_len - len(ids))
        if prep is not None:
            sp = prep.params(sp)
        policy = spec_policy(b.speculation, llm.spec)
        plan = check_route(llm, sp, policy)

        if attempt in self.attempts:
            raise DaemonError(f"attempt_id {attempt} is already running or waiting; give each generate its own",
                              "invalid_request")
        from ..runtime.scheduler import Request

        a = Attempt(mid, attempt, sp, len(ids), out=prep.assistant() if prep is not None else None)
        a.req = Request(ids, sp, policy, lambda kind, payload: self._event(a, kind, payload), plan=plan)
        self.attempts[attempt] = a
        llm.scheduler.submit(a.req)

    def _event(self, a: Attempt, kind: str, payload: Any) -> None:
        """One scheduler event of attempt `a` (on this thread, which drives the rounds) -> its events out."""
        from ..runtime import scheduler as sch

        ev = {"id": a.mid, "attempt_id": a.attempt}
        if kind == sch.STARTED:
            a.started = True
            self.emit({"type": "gen_start", **ev, "prompt_tokens": a.prompt_tokens})
            return
        if kind in (sch.CHUNK, sch.DONE):
            if a.ttft is None and payload.token_ids:
                a.ttft = time.perf_counter() - a.t0
            a.tokens += len(payload.token_ids)
            lps = getattr(payload, "logprobs", None)
            split = self._split(a, payload.text, kind == sch.DONE)
            # a token without text yet (a partial character) too; and the answer's held-back tail at the end
            if payload.text or payload.token_ids or any(split.values()):
                tok = {"type": "token", **ev, "text": payload.text, "ids": payload.token_ids, **split}
                if lps is not None:
                    tok["logprobs"] = logprob_entries(lps)
                self.emit(tok)
            if kind == sch.CHUNK:
                return
        self.attempts.pop(a.attempt, None)
        if kind == sch.DONE:
            res = payload.result
            fig = self.llm.figures(res, a.params)
            done = {"type": "done", **ev, "tokens": fig.generated_tokens, "prefill_tokens": fig.prompt_tokens,
                    **fig.timings(1000.0 * (a.ttft or 0.0)), "finish_reason": res.finish_reason,
                    "context_limited": fig.context_limited, "tau": fig.mean_accept_len}
            if a.out is not None:
                msg = a.out.message()
                done["content"] = msg["content"]
                if a.out.reasoning:
                    done["reasoning"] = msg["reasoning"]
                done["finish_reason"] = a.out.finish_reason(res.finish_reason)
            self.emit(done)
        elif kind == sch.CANCELLED:
            by = a.cancelled_by
            self.emit({"type": "aborted", **ev, "tokens": a.tokens, "reason": "closed" if by is None else "cancel"})
            if by is not None:
                self.emit({"type": "cancelled", "id": by.get("id"), "attempt_id": a.attempt, "found": True})
        else:
            e = payload
            if isinstance(e, (SpecfireError, ValueError)):
                err = DaemonError(str(e), "invalid_request")
            else:
                oom = "out of memory" in str(e).lower()
                err = DaemonError(f"{type(e).__name__}: {e}", "oom" if oom else "internal_error", True)
            self.error(a.mid, err, a.attempt)

    @staticmethod
    def _split(a: Attempt, text: str, final: bool) -> dict[str, str]:
        """A `messages` attempt's piece of text as the HTTP chat stream's deltas split it: `content`,
        and `reasoning` where the reasoning parser applies (text held back comes in a later event)."""
        if a.out is None:
            return {}
        deltas = a.out.feed(text) + (a.out.finish() if final else [])
        split = {"content": "".join(d.get("content", "") for d in deltas)}
        if a.out.reasoning:
            split["reasoning"] = "".join(d.get("reasoning", "") for d in deltas)
        return split

    def poll(self) -> None:
        """Take the lines read so far: while generations run, answer pings and act on cancels at
        once; keep the rest in line (and note the end of input, which stops nothing: the lines
        before it are still answered)."""
        while not self.eof:
            try:
                raw = self.lines.get_nowait()
            except queue.Empty:
                return
            if raw is EOF:
                self.eof = True
                return
            if self.attempts and self._kind(raw) in ("ping", "cancel"):
                self.handle_line(raw)
            else:
                self.pending.append(raw)      # (a bad line too: reported in its turn)


def logprob_entries(lps: Any) -> list[dict[str, Any]]:
    """A token event's `logprobs`: per id, its log-probability and the top ids' (-9999.0 for -inf)."""
    from .logprobs import finite

    return [{"id": x.token, "logprob": finite(x.logprob), "top": [[t, finite(v)] for t, v in x.top]} for x in lps]


def main(args: argparse.Namespace) -> int:
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                      # fd 1 (C libraries) and sys.stdout now write to stderr
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    d = Daemon(out, getattr(args, "draft_vocab", None), getattr(args, "generation_config", None),
               getattr(args, "max_num_seqs", None), getattr(args, "tp_invariant", False),
               ChatOptions(reasoning_parser=getattr(args, "reasoning_parser", "auto")))
    try:
        if args.model is not None:
            d.handle_line(json.dumps({"type": "load", "model": None if args.model == "bundled" else args.model})
                          .encode())
        # the reader thread gets its own file on a copy of fd 0: it may still be blocked in a read
        # at exit, and the interpreter aborts if that lock is sys.stdin's
        d.run(os.fdopen(os.dup(0), "rb"))
    finally:
        sys.stdout = real_stdout
        try:
            out.close()
        except OSError:                # the reader has gone: nothing left to flush to
            pass
    return 0
