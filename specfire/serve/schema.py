"""Request bodies shared by the HTTP server and the daemon: pydantic models for the shape,
SamplingParams / SpecPolicy for the ranges, or a RequestError naming the offending field (`param`);
the raw JSON under them is checked first (wire.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import PromptError, SpecfireError
from ..grammar import GrammarError, GrammarSpec, spec_from_fields
from ..params import MAX_LOGPROBS, SamplingParams, SpecPolicy
from .wire import RequestError, short, type_name

if TYPE_CHECKING:
    from ..api import LLM
    from ..runtime.route import RoutePlan


# ---- shapes ---------------------------------------------------------------------------------------

class _Strict(BaseModel):
    """JSON types as written (no "5" for 5, no true for 1). A field not declared here is refused,
    never dropped: a request that asks for something the server would ignore gets a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# why some well-known fields are refused (any other undeclared field is refused as unknown)
TOOLS = "use 'tools' and 'tool_choice'"
NOT_BUILT = {"functions": TOOLS, "function_call": TOOLS,
             "logit_bias": "biasing logits is not built", "suffix": "suffix (fill-in-the-middle) is not supported",
             "use_beam_search": "beam search is not supported",
             "echo": "echo is a /v1/completions field"}
# fields accepted only with a value that asks for nothing: (the values, what else would need)
NO_TOOLS = "the daemon parses no tool calls, /v1/chat/completions does"
ONLY_TRIVIAL = {"logit_bias": ((None, {}), "biasing logits is not built (only {})"),
                "tools": ((None, []), NO_TOOLS + " (only [])"),
                "tool_choice": ((None, "none"), NO_TOOLS + ' (only "none")')}


def check_trivial(v: Any, info: Any) -> Any:
    allowed, why = ONLY_TRIVIAL[info.field_name]
    if not any(v == a and type(v) is type(a) for a in allowed):
        raise ValueError(f"is not supported: {why}; got {short(v)}")
    return v


class StreamOptions(_Strict):
    include_usage: bool | None = None


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """Chat messages; content a string or an array of text parts (joined)."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"must be a non-empty array of messages, got {type_name(v)}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"'{where}' must be an object with 'role' and 'content', got {type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"'{where}.role' must be a non-empty string, got {short(role)}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": "
                                     f"...}}; only text is supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ValueError(f"'{where}.content' must be a string or an array of text parts, got "
                             f"{type_name(content)}")
        out.append({**m, "content": content})
    return out


def parse_prompt(p: Any) -> str | list[int]:
    """A completions prompt: a string, an array of token ids, or an array holding one of those."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str):
        return p
    if ids(p):
        return list(p)
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or ids(p[0])):
        return p[0] if isinstance(p[0], str) else list(p[0])
    raise ValueError(f"must be a string, an array of token ids, or an array with one of those (one prompt per "
                     f"request), got {type_name(p)}")


MAX_N = 64         # choices a request may ask for (each a request of its own in the scheduler)


class SamplingBody(_Strict):
    """The OpenAI sampling fields (and `speculation`), shared by chat, completions and the daemon."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None
    ignore_eos: bool | None = None
    n: Any = None
    best_of: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    speculation: Any = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # structured outputs (grammar.spec_from_fields checks their shapes): OpenAI's and vLLM's spellings
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("stop")
    @classmethod
    def check_stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v] if v else []
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return [s for s in v if s]
        raise ValueError(f"must be a string or an array of strings, got {short(v)}")

    @field_validator("best_of")
    @classmethod
    def check_one(cls, v: Any) -> Any:
        if v is not None and (type(v) is not int or v != 1):
            raise ValueError(f"must be 1 (one completion per request), got {short(v)}")
        return v

    @field_validator("n")
    @classmethod
    def check_n(cls, v: Any) -> Any:
        """Choices per request: the HTTP endpoints run them as concurrent requests (the daemon takes 1)."""
        if v is not None and (type(v) is not int or not 1 <= v <= MAX_N):
            raise ValueError(f"must be an integer from 1 to {MAX_N}, got {short(v)}")
        return v

    @field_validator("speculation")
    @classmethod
    def check_speculation(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError(f"must be an object {{\"mode\", \"k\"}} or a mode string, got {type_name(v)} {short(v)}")
        return v


class HttpBody(SamplingBody):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None              # the client's own label for its end user: nothing to do with it
    logit_bias: Any = None
    _trivial = field_validator("logit_bias")(check_trivial)


class ChatBody(HttpBody):
    messages: Any = Field(default=None, validate_default=True)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None                            # checked by serve/chat.py against the template
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None      # several calls in one turn are parsed either way
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def check_top(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be in 0..{MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("parallel_tool_calls")
    @classmethod
    def check_parallel(cls, v: bool | None) -> bool | None:
        if v is False:
            raise ValueError("false is not supported: every call the model writes in a turn is returned")
        return v

    @field_validator("messages")
    @classmethod
    def check_messages(cls, v: Any) -> list[dict[str, Any]]:
        return _required(v, parse_messages)


def check_logprobs(v: int | None) -> int | None:
    if v is not None and not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"must be in 0..{MAX_LOGPROBS} (the most likely tokens returned per token), got {v}")
    return v


class CompletionBody(HttpBody):
    prompt: Any = Field(default=None, validate_default=True)
    logprobs: int | None = None
    echo: bool | None = None
    _logprobs = field_validator("logprobs")(check_logprobs)

    @field_validator("prompt")
    @classmethod
    def check_prompt(cls, v: Any) -> str | list[int]:
        return _required(v, parse_prompt)


class GenerateMessage(SamplingBody):
    """The daemon's `generate`: exactly one of prompt / messages (checked by the daemon)."""

    type: Any = None
    id: Any = None

    @field_validator("n")
    @classmethod
    def check_one_choice(cls, v: Any) -> Any:
        if v is not None and v != 1:
            raise ValueError(f"must be 1: the daemon's events carry one completion (send {v} requests), got {v}")
        return v
    attempt_id: Any = None              # checked by the daemon
    prompt: Any = None
    messages: Any = None
    chat_template_kwargs: dict[str, Any] | None = None     # with messages, as the chat endpoint's
    tools: Any = None
    tool_choice: Any = None
    _no_tools = field_validator("tools", "tool_choice")(check_trivial)
    logprobs: int | None = None
    echo: bool | None = None             # only false: the prompt is not sent back
    _logprobs = field_validator("logprobs")(check_logprobs)

    @field_validator("echo")
    @classmethod
    def check_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("true is not supported: the daemon does not send the prompt back (gen_start's "
                             "prompt_tokens counts it; /v1/completions echoes it)")
        return v

    @field_validator("messages")
    @classmethod
    def check_messages(cls, v: Any) -> list[dict[str, Any]] | None:
        return None if v is None else parse_messages(v)

    @field_validator("prompt")
    @classmethod
    def check_prompt(cls, v: Any) -> str | list[int] | None:
        return None if v is None else parse_prompt(v)


def _required(v: Any, check: Any) -> Any:
    if v is None:
        raise ValueError("is required")
    return check(v)


KINDS = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "a boolean",
         "dict_type": "an object", "model_type": "an object", "list_type": "an array",
         "finite_number": "a finite number", "int_from_float": "an integer"}


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """`model` over `body`, or a RequestError naming the first bad field (`param`)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ""
        for part in err["loc"]:
            param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
        param = param or None
        if err["type"] == "extra_forbidden":
            why = NOT_BUILT.get(param or "")
            raise RequestError(f"'{param}' is not supported{': ' + why if why else ' (not a field of this request)'}"
                               f"; specfire refuses a field rather than ignore it", param) from None
        if err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
            if msg.startswith("'"):        # the message names a nested field itself
                raise RequestError(msg, msg[1:msg.index("'", 1)]) from None
            raise RequestError(f"'{param}' {msg}", param) from None
        kind = KINDS.get(err["type"])
        got = err.get("input")
        if kind is not None:
            raise RequestError(f"'{param}' must be {kind}, got {type_name(got)} {short(got)}", param) from None
        raise RequestError(f"'{param}': {err['msg']}", param) from None


# ---- typed values ---------------------------------------------------------------------------------

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p") + PENALTIES
ENDS = ("min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")   # vLLM's fields


def sampling_params(b: SamplingBody, default_max_tokens: int, default_temperature: float = 1.0,
                    defaults: dict[str, Any] | None = None, room: int | None = None) -> SamplingParams:
    """SamplingParams from a validated body; `max_completion_tokens` (the newer name) wins over
    `max_tokens`; top_k -1 means no top-k (vLLM). A field the body leaves out takes `defaults`
    (the serve flags over the model's generation_config.json values; any of max_tokens,
    temperature, top_p, top_k, min_p and the penalties), else the built-in default
    (`default_max_tokens`, `default_temperature`, SamplingParams'). A default max_tokens is
    capped at `room` (what the context leaves). Range errors name the field as the client wrote it."""
    d = defaults or {}
    mt_name = "max_completion_tokens" if b.max_completion_tokens is not None else "max_tokens"
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    if max_tokens is None:
        max_tokens = d.get("max_tokens", default_max_tokens)
        if room is not None:
            max_tokens = min(max_tokens, room)
    kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=default_temperature, seed=b.seed,
                              stop=b.stop or [], ignore_eos=bool(b.ignore_eos))
    for name in ENDS:
        if getattr(b, name) is not None:
            kw[name] = getattr(b, name)
    for name in SAMPLING_FIELDS:
        v = getattr(b, name)
        if v is None:
            v = d.get(name)
        if v is not None:
            kw[name] = 0 if name == "top_k" and v == -1 else v
    kw["structured_outputs"] = structured(b)
    kw["logprobs"], kw["prompt_logprobs"] = logprobs_of(b)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0]
        if field == "max_tokens":
            field, msg = mt_name, mt_name + msg[len("max_tokens"):]
        raise RequestError(msg, field) from None


def structured(b: SamplingBody) -> GrammarSpec | None:
    """The body's one structured-output constraint (response_format, guided_*, structured_outputs)."""
    try:
        return spec_from_fields(b.response_format, b.guided_json, b.guided_regex, b.guided_choice, b.guided_grammar,
                                b.structured_outputs)
    except GrammarError as e:
        raise RequestError(str(e), e.param) from None


def logprobs_of(b: SamplingBody) -> tuple[int | None, int | None]:
    """(SamplingParams.logprobs, prompt_logprobs): chat's `logprobs: true` + `top_logprobs` N, the
    completions' and the daemon's `logprobs` N (with completions' `echo`, the prompt's too)."""
    if isinstance(b, ChatBody):
        if b.top_logprobs and not b.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return ((b.top_logprobs or 0) if b.logprobs else None), None
    n = getattr(b, "logprobs", None)
    return n, (n if n is not None and getattr(b, "echo", None) else None)


def spec_policy(v: Any, default: SpecPolicy, name: str = "speculation") -> SpecPolicy:
    """`"speculation": {"mode": ..., "k": ...}` (or a bare mode string) over the server's default."""
    if v is None:
        return default
    try:
        return SpecPolicy.coerce(v, default)
    except ValueError as e:
        msg = str(e).replace("spec.", f"{name}.", 1).replace("spec has", f"{name} has", 1)
        field = msg.split(" ", 1)[0]
        raise RequestError(msg, field if field.startswith(name) else name) from None


def encode(llm: "LLM", prompt: str | list[int], name: str) -> list[int]:
    """Token ids of a prompt through the LLM's one prompt check; a refusal names `name`."""
    try:
        return llm.prompt_ids(prompt)
    except PromptError as e:
        raise RequestError(f"'{name}': {e}", name, code="context_length_exceeded" if e.too_long else None) from None


def check_route(llm: "LLM", sp: SamplingParams, policy: SpecPolicy, name: str = "speculation") -> "RoutePlan":
    """The request's route, decided once (it goes with the request to the engine); refused before
    queueing: a stop token id outside the vocabulary, a speculation mode the model cannot serve."""
    vocab = llm.cfg.vocab_size
    for i, t in enumerate(sp.stop_token_ids):
        if t >= vocab:
            raise RequestError(f"'stop_token_ids[{i}]' is {t}, outside the vocabulary [0, {vocab})",
                               "stop_token_ids")
    try:
        return llm.plan_route(sp, policy)
    except GrammarError as e:
        raise RequestError(str(e), e.param) from None
    except SpecfireError as e:
        raise RequestError(str(e), f"{name}.mode") from None
