"""Request parsing shared by the HTTP server and the daemon: JSON bodies in, typed SamplingParams
and SpecPolicy out, or a RequestError that names the offending field (`param`)."""
from __future__ import annotations

import math
from typing import Any

from ..config import SamplingParams, SpecPolicy
from ..errors import SpecfireError


class RequestError(Exception):
    """A request the server refuses; rendered in the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, float) or math.isfinite(v)))


def optional(body: dict[str, Any], name: str, kind: str) -> Any:
    """body[name] or None; a present value of the wrong JSON type is a RequestError naming `name`."""
    v = body.get(name)
    if v is None:
        return None
    ok = {"integer": is_int, "number": is_number, "string": lambda x: isinstance(x, str),
          "boolean": lambda x: isinstance(x, bool), "object": lambda x: isinstance(x, dict),
          "array": lambda x: isinstance(x, list)}[kind](v)
    if not ok:
        raise RequestError(f"'{name}' must be {'an' if kind[0] in 'aeio' else 'a'} {kind}, got {_type_name(v)} "
                           f"{v!r}", name)
    return v


SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "stop", "ignore_eos")


def sampling_params(body: dict[str, Any], default_max_tokens: int, default_temperature: float = 1.0) -> SamplingParams:
    """The OpenAI sampling fields of `body` as SamplingParams; missing ones take the defaults.

    `max_completion_tokens` (the newer name) wins over `max_tokens`; top_k -1 means no top-k (vLLM)."""
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = optional(body, mt_name, "integer")
    temperature = optional(body, "temperature", "number")
    top_p = optional(body, "top_p", "number")
    top_k = optional(body, "top_k", "integer")
    min_p = optional(body, "min_p", "number")
    seed = optional(body, "seed", "integer")
    ignore_eos = optional(body, "ignore_eos", "boolean")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f"'stop' must be a string or an array of strings, got {stop!r}", "stop")
    if top_k == -1:
        top_k = 0
    for name in ("n", "best_of"):
        n = body.get(name)
        if n is not None and (not is_int(n) or n != 1):
            raise RequestError(f"'{name}' must be 1 (one completion per request), got {n!r}", name)
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and (not is_number(v) or v != 0):
            raise RequestError(f"'{name}' is not supported; it must be 0 or absent, got {v!r}", name)
    if body.get("logprobs") not in (None, False, 0):
        raise RequestError("'logprobs' is not supported", "logprobs")
    if body.get("echo"):
        raise RequestError("'echo' is not supported", "echo")
    kw: dict[str, Any] = dict(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=default_temperature if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, top_k=0 if top_k is None else top_k,
        min_p=0.0 if min_p is None else min_p, seed=seed, stop=[s for s in stop if s],
        ignore_eos=bool(ignore_eos))
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0]
        if field == "max_tokens":
            field = mt_name
            msg = mt_name + msg[len("max_tokens"):]
        raise RequestError(msg, field) from None


def spec_policy(body: dict[str, Any], default: SpecPolicy, name: str = "speculation") -> SpecPolicy:
    """`"speculation": {"mode": ..., "k": ...}` (or a bare mode string) over the server's default."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (dict, str)):
        raise RequestError(f"'{name}' must be an object {{\"mode\", \"k\"}}, got {_type_name(v)} {v!r}", name)
    try:
        return SpecPolicy.coerce(v, default)
    except ValueError as e:
        msg = str(e).replace("spec.", f"{name}.", 1).replace("spec has", f"{name} has", 1)
        field = msg.split(" ", 1)[0]
        raise RequestError(msg, field if field.startswith(name) else name) from None


def check_route(llm: Any, policy: SpecPolicy, sp: SamplingParams, name: str = "speculation") -> None:
    """Refuse, before queueing, a speculation mode the loaded model cannot serve."""
    try:
        llm.engine.route(policy, sp)
    except SpecfireError as e:
        raise RequestError(str(e), f"{name}.mode") from None


def messages_of(body: dict[str, Any], name: str = "messages") -> list[dict[str, Any]]:
    """Validated chat messages; content may be a string or an array of text parts."""
    msgs = body.get(name)
    if msgs is None:
        raise RequestError(f"'{name}' is required", name)
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(f"'{name}' must be a non-empty array of messages, got {_type_name(msgs)}", name)
    out = []
    for i, m in enumerate(msgs):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object with 'role' and 'content', got {_type_name(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"'{where}.role' must be a non-empty string, got {role!r}", f"{where}.role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": "
                                       f"...}}; only text is supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or an array of text parts, got "
                               f"{_type_name(content)}", f"{where}.content")
        out.append({**m, "content": content})
    return out


def prompt_of(body: dict[str, Any], name: str = "prompt") -> str | list[int]:
    """A completions prompt: a string, an array of token ids, or an array holding one string."""
    p = body.get(name)
    if p is None:
        raise RequestError(f"'{name}' is required", name)
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(is_int(t) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or
                                                (isinstance(p[0], list) and p[0] and all(is_int(t) for t in p[0]))):
        return p[0] if isinstance(p[0], str) else list(p[0])
    raise RequestError(f"'{name}' must be a string, an array of token ids, or an array with one of those "
                       f"(one prompt per request), got {_type_name(p)}", name)


def encode_checked(llm: Any, prompt: str | list[int], name: str) -> list[int]:
    """Token ids of the prompt, refused (naming `name`) when empty, out of vocab or too long."""
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise RequestError("this model has no tokenizer; send token ids", name)
        ids = llm.tokenizer.encode(prompt)
    else:
        ids = prompt
    if not ids:
        raise RequestError(f"'{name}' is empty", name)
    vocab = llm.cfg.vocab_size
    bad = [t for t in ids if not (0 <= t < vocab)]
    if bad:
        raise RequestError(f"'{name}' has token id {bad[0]} outside the vocabulary [0, {vocab})", name)
    max_seq = llm.engine.trunk.max_seq
    if len(ids) >= max_seq:
        raise RequestError(f"'{name}' is {len(ids)} tokens; this server's context is {max_seq} tokens "
                           f"(the prompt must leave room for at least one generated token)", name,
                           code="context_length_exceeded")
    return ids
