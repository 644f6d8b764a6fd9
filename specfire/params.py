"""What a request or the engine's options ask for: SamplingParams (with its GrammarSpec), SpecPolicy,
and the checks of the engine's options. Every dataclass validates at construction; errors name the
field, the value and what is allowed."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import GrammarError

# the prefix cache's memory by default in the servers (one device; a mesh keeps no snapshots)
PREFIX_CACHE_MB = 1024


def _check_number(name: str, v: Any, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False, integer: bool = False) -> None:
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v!r}")


MAX_SEED = 2 ** 63 - 1   # torch generators take a signed 64-bit seed


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to: `kind` one of GRAMMAR_KINDS, `value` the schema (a dict), regex,
    choices or a Lark grammar; `param` the request field it came from (for errors); `after`: the
    text of one token (a think block's end, `</think>`) that the output must reach before the
    grammar applies (None: from the first token); `think`: the output may open with a
    `<think>...</think>` block of free text before the grammar applies (a model the prompt leaves free
    to reason first). The declarative half that
    SamplingParams.structured_outputs carries; the engine compiles it (grammar.py) into a request's
    matcher."""

    kind: str
    value: Any = None
    param: str = "response_format"
    after: str | None = None
    think: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}", self.param)
        if self.think and self.after is not None:
            raise GrammarError(f"'{self.param}': a grammar starts after {self.after!r} or after an optional think "
                               f"block, not both", self.param)

    def __hash__(self) -> int:          # a schema is a dict: hash its canonical text
        return hash((self.kind, json.dumps(self.value, sort_keys=True), self.param, self.after, self.think))


MAX_LOGPROBS = 20          # top log-probabilities a request may ask for per token (OpenAI's and vLLM's default limit)
MAX_OPENAI_PENALTY = 2.0   # presence / frequency penalty range, as OpenAI and vLLM allow
# repetition_penalty range: inside it every penalised float32 logit stays finite (a larger logit
# divided by 1e-40, or any logit times 1e39, is inf and the distribution NaN); at its ends the
# penalty already decides every pick it can
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 means no top-k truncation.

    Penalties (vLLM's semantics, applied to the logits before temperature, greedy included;
    runtime/sampling.py `penalize`): `repetition_penalty` r in [1e-6, 1e6] (1 = off) divides the
    positive logit of every token id that occurs in the prompt or the output so far by r and
    multiplies a negative one by r; `presence_penalty` and `frequency_penalty` in [-2, 2] (0 = off)
    subtract presence * [count > 0] + frequency * count, counts over the generated tokens only.

    Ends (vLLM's fields, runtime/output.py): EOS (unless `ignore_eos`) and any of `stop_token_ids`
    end the output with "stop", the token counted but not in the text; `stop` strings end it before
    the string; `include_stop_str_in_output` keeps the stop string (or the stop token's text);
    `min_tokens` forbids every end but max_tokens before that many tokens (EOS and the stop token
    ids are masked out of the distribution, runtime/sampling.py); `skip_special_tokens` false keeps
    special tokens' text.

    `structured_outputs` (a GrammarSpec: JSON schema, regex, choice or Lark grammar): every
    token is drawn from the grammar's mask, on every route (runtime/constraint.py); the output ends
    ("stop") where the grammar is complete. `logprobs` N (0..20): each generated token's
    log-probability and the N most likely, from the distribution it was drawn from (after the
    penalties, the grammar mask, temperature and truncation; greedy: the processed logits at
    temperature 1); `prompt_logprobs` N: the same for the prompt's tokens, from the model's raw
    logits (runtime/engine.py)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: GrammarSpec | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_number("max_tokens", self.max_tokens, lo=1, integer=True)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_number("top_k", self.top_k, lo=0, integer=True)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_number("seed", self.seed, lo=0, hi=MAX_SEED, integer=True)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             f"(float32 logits overflow beyond), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), lo=-MAX_OPENAI_PENALTY, hi=MAX_OPENAI_PENALTY)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_number("min_tokens", self.min_tokens, lo=0, integer=True)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if (not isinstance(ids, (list, tuple))
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS, integer=True)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, GrammarSpec):
                raise ValueError(f"structured_outputs must be a GrammarSpec (specfire.grammar), got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where "
                                 "the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (every one at its neutral value: no)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def tracked(self) -> bool:
        """Whether the target distribution depends on the request's token statistics (penalties,
        or min_tokens masking the ends): the engine then keeps them on the device."""
        return self.penalized or self.min_tokens > 0

    def penalty_text(self) -> str:
        """The penalties in force, for route reasons and logs ('' when none is)."""
        parts = [f"{name}={v:g}" for name, v, off in (("repetition_penalty", self.repetition_penalty, 1.0),
                                                       ("presence_penalty", self.presence_penalty, 0.0),
                                                       ("frequency_penalty", self.frequency_penalty, 0.0))
                 if v != off]
        return ", ".join(parts)


# the names LLM(dtype=...) and --dtype accept -> torch's (None: bfloat16 on a GPU, float32 on a CPU);
# vLLM's spellings included
DTYPE_NAMES = {"auto": None, "float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}

SPEC_MODES = ("off", "auto", "mtp", "ngram")
MAX_SPEC_K = 10


@dataclass(frozen=True)
class SpecPolicy:
    """The speculation policy: mode off|auto|mtp|ngram and draft length k (1..10)."""

    mode: str = "auto"
    k: int = 3

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec.mode must be one of {', '.join(SPEC_MODES)}, got {self.mode!r}")
        _check_number("spec.k", self.k, lo=1, hi=MAX_SPEC_K, integer=True)

    @classmethod
    def coerce(cls, v: "SpecPolicy | dict[str, Any] | str | None", default: "SpecPolicy | None" = None) -> "SpecPolicy":
        """Accept a SpecPolicy, a dict {'mode', 'k'} or a mode string; None gives `default`."""
        if v is None:
            return default if default is not None else cls()
        if isinstance(v, SpecPolicy):
            return v
        if isinstance(v, str):
            return cls(mode=v, k=(default or cls()).k)
        if isinstance(v, dict):
            unknown = set(v) - {"mode", "k"}
            if unknown:
                raise ValueError(f"spec has unknown field(s) {sorted(unknown)}; allowed: mode, k")
            base = default or cls()
            return cls(mode=v.get("mode", base.mode), k=v.get("k", base.k))
        raise ValueError(f"spec must be a SpecPolicy, a dict or a mode string, got {type(v).__name__}")


def check_draft_vocab(n: Any, vocab_size: int) -> int | None:
    """The MTP drafter's vocabulary: None (off, the whole vocabulary) or N, an integer in
    1..vocab_size, meaning the draft scores token ids 0..N-1 only (runtime/drafters.py). N equal
    to the vocabulary is the same as off."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab must be an integer in 1..{vocab_size} (the model's vocabulary), got {n!r}")
    return None if n == vocab_size else n


# ---- concurrency (runtime/slots.py) ------------------------------------------------------------------

def check_max_num_seqs(n: Any) -> int | None:
    """How many requests may run at once: a positive integer, or None for the device's default."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"max_num_seqs must be a positive integer, got {n!r}")
    return n


def parse_bytes(value: str | int | None, name: str = "kv_cache_memory_bytes") -> int | None:
    """An integer byte count, or one with a K / M / G / T suffix (powers of 1024); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count (e.g. 8589934592 or 8G), got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        try:
            n = int(digits) * scale if digits.isdigit() else int(float(digits) * scale)
        except (ValueError, OverflowError):
            raise ValueError(f"{name} must be a byte count (e.g. 8589934592 or 8G), got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n
