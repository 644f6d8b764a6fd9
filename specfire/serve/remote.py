"""What crosses between the server and its engine process (serve/engine.py, serve/client.py): the
hello that describes the loaded model, errors as (type name, message, details), and RemoteModel,
the server's stand-in for the LLM it does not hold: the tokenizer, the chat template and the
prompt check run here, the route is decided by the engine process (one call per request)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .. import errors
from ..api import LLM
from ..runtime.output import TokenLogprobs
from ..runtime.prompts import Prompts, check_prompt_ids
from ..tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..config import GenerationDefaults, ModelConfig
    from ..params import SamplingParams, SpecPolicy
    from ..runtime.engine import StreamChunk
    from ..runtime.route import RoutePlan


@dataclass(frozen=True)
class Hello:
    """The engine process's first message once the model has loaded: what the server reads of it."""

    path: str
    cfg: "ModelConfig"
    tokenizer: bool                 # the checkpoint has a tokenizer.json (the server loads its own copy)
    max_model_len: int
    max_num_seqs: int
    slots_why: str | None
    tp: int
    tp_invariant: bool
    spec: "SpecPolicy"
    generation_defaults: "GenerationDefaults"

    @staticmethod
    def of(llm: LLM) -> "Hello":
        return Hello(llm.path, llm.cfg, llm.tokenizer is not None, llm.max_model_len, llm.max_num_seqs,
                     llm.slots.why, llm.tp, llm.tp_invariant, llm.spec, llm.generation_defaults)


@dataclass(frozen=True)
class Slots:
    why: str | None


class RemoteModel(Prompts):
    """The model as the server's endpoints read it (the attributes of LLM they use), for a model
    loaded in the engine process; `plan` asks that process for a request's route."""

    def __init__(self, hello: Hello, plan: Callable[["SamplingParams", "SpecPolicy"], "RoutePlan"]):
        self.hello = hello
        self.path, self.cfg, self.spec = hello.path, hello.cfg, hello.spec
        self.max_model_len, self.max_num_seqs = hello.max_model_len, hello.max_num_seqs
        self.tp, self.tp_invariant = hello.tp, hello.tp_invariant
        self.slots = Slots(hello.slots_why)
        self.generation_defaults = hello.generation_defaults
        self.tokenizer = Tokenizer(hello.path) if hello.tokenizer else None
        self._plan = plan

    def _check_ids(self, ids: list[int]) -> None:
        check_prompt_ids(ids, self.cfg.vocab_size, self.max_model_len)

    def plan_route(self, params: "SamplingParams", spec: "SpecPolicy | None" = None) -> "RoutePlan":
        from ..params import SpecPolicy

        return self._plan(params, SpecPolicy.coerce(spec, self.spec))

    figures = staticmethod(LLM.figures)

    def close(self) -> None:
        """The engine process frees the model (EngineClient.close)."""


# ---- chunks ---------------------------------------------------------------------------------------

def _lps(lps: "list[TokenLogprobs | None] | None") -> list[tuple | None] | None:
    return None if lps is None else [None if t is None else (t.token, t.logprob, t.top) for t in lps]


def _unlps(rows: list[tuple | None] | None) -> "list[TokenLogprobs | None] | None":
    return None if rows is None else [None if r is None else TokenLogprobs(*r) for r in rows]


def chunk_wire(c: "StreamChunk") -> tuple:
    """A streamed (not last) chunk as plain data: the round's message pickles lists and tuples only."""
    return c.text, c.token_ids, _lps(c.logprobs), _lps(c.prompt_logprobs)


def chunk_of(w: tuple) -> "StreamChunk":
    """The StreamChunk `chunk_wire` described, equal to the engine's."""
    from ..runtime.engine import StreamChunk

    text, ids, lps, plps = w
    return StreamChunk(text, ids, None, _unlps(lps), _unlps(plps))


# ---- errors ----------------------------------------------------------------------------------------

def wire_error(e: BaseException) -> tuple[str, str, dict[str, Any]]:
    """An exception as it crosses: its type's name, its message and the fields servers read."""
    extra: dict[str, Any] = {}
    for k in ("param", "too_long"):
        if hasattr(e, k):
            extra[k] = getattr(e, k)
    return type(e).__name__, str(e), extra


BUILTIN = {"ValueError": ValueError, "TypeError": TypeError}


def rebuilt(name: str, msg: str, extra: dict[str, Any] | None = None) -> BaseException:
    """The exception `wire_error` described: the specfire error of that name (so the HTTP status
    and the CLI's one line are those of the error itself), else one of that name and message."""
    extra = extra or {}
    cls = getattr(errors, name, None) or BUILTIN.get(name)
    if cls is errors.GrammarError:
        return errors.GrammarError(msg, extra.get("param", ""))
    if cls is errors.PromptError:
        return errors.PromptError(msg, bool(extra.get("too_long", False)))
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls(msg)
    return type(name, (RuntimeError,), {})(msg)


def engine_env() -> dict[str, str]:
    """The engine process's environment: this one, with the package importable."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
