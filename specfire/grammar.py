"""Constrained decoding through llguidance: a request's structured-output field compiled into a
matcher that gives the token mask for the next position and walks forward and back over tokens.

llguidance over xgrammar (bench/grammar_mask.py, the 248k vocabulary): schema compilation is lazy
(no per-request vocabulary pass), the mask's tail latency is lower, and `try_consume_tokens` +
`rollback` is the speculative step's shape: advance over the k drafts, learn how many the grammar
allows, roll back to the accepted prefix."""
from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GrammarError
from .params import GRAMMAR_KINDS as KINDS
from .params import GrammarSpec

if TYPE_CHECKING:
    import torch

    from .tokenizer import Tokenizer

__all__ = ["KINDS", "GrammarSpec", "GrammarError", "GrammarCompiler", "Matcher", "spec_from_fields", "grammar_source",
           "think_first"]
# whitespace between JSON tokens: free in form (pretty-printed or compact) but bounded, at most one
# line break and 20 spaces or tabs per gap, so a model cannot spin in whitespace until max_tokens
JSON_WHITESPACE = r"(\r?\n)?[ \t]{0,20}"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_LEAD = r"/[ \n]{0,4}/"     # the layout a think block's end leaves before the answer ("</think>\n\n")


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar text of `spec`."""
    import llguidance

    if spec.kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if spec.kind == "json_object" else spec.value
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if spec.kind == "regex":
        return llguidance.grammar_from("regex", spec.value)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.value))
    return llguidance.grammar_from("grammar", spec.value)


def think_first(src: str, open_: str, close: str | None) -> str:
    """The grammar `src` (llguidance text) after an optional think block: `open_` (a Lark
    expression), free text, the block's end (`close`: a Lark expression of one special token, which
    text cannot contain; None: the literal text, which the free text then cannot contain), then at
    most four spaces or line breaks. The answer is `src` itself as a sub-grammar: its constraint is
    unchanged, with or without the block."""
    sub = _answer(src)
    if close is None:       # the text and its end as one terminal: the lexer knows where the text stops
        block = f"THINK\nTHINK: (/(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/) {json.dumps(THINK_CLOSE)}"
    else:
        block = f"THINK {close}\nTHINK: /(?s:.*)/"
    main = f"start: (think LEAD)? @answer\nthink: {open_} {block}\nLEAD: {THINK_LEAD}\n"
    return json.dumps({"grammars": [{"name": "think_first", "lark_grammar": main}] + sub})


def led(src: str) -> str:
    """The grammar `src` after at most four spaces or line breaks: a JSON answer that starts after
    a think block's end ("</think>\n\n{...}"; JSON allows the leading layout, llguidance's JSON
    grammar does not). The answer is `src` itself as a sub-grammar, its constraint unchanged."""
    return json.dumps({"grammars": [{"name": "led", "lark_grammar": f"start: LEAD @answer\nLEAD: {THINK_LEAD}\n"}]
                       + _answer(src)})


def _answer(src: str) -> list[dict]:
    """The grammars of `src` (llguidance text) with its first one named `answer`, to be referenced
    as `@answer` from a grammar around it."""
    sub = json.loads(src)["grammars"] if src.lstrip().startswith("{") else [{"lark_grammar": src}]
    return [dict(sub[0], name="answer")] + sub[1:]


def spec_from_fields(response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                     guided_choice: Any = None, guided_grammar: Any = None,
                     structured_outputs: Any = None) -> GrammarSpec | None:
    """The one constraint a request asks for (OpenAI's response_format, vLLM's guided_* and
    structured_outputs), None for none; two at once, or a malformed one, is a GrammarError."""
    found: list[GrammarSpec] = []
    if response_format is not None:
        found += _response_format(response_format)
    for name, kind, v in (("guided_json", "json_schema", guided_json), ("guided_regex", "regex", guided_regex),
                          ("guided_choice", "choice", guided_choice), ("guided_grammar", "grammar", guided_grammar)):
        if v is not None:
            found.append(_typed(kind, v, name))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise GrammarError("'structured_outputs' must be an object", "structured_outputs")
        for key, kind in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            if structured_outputs.get(key) is not None:
                found.append(_typed(kind, structured_outputs[key], f"structured_outputs.{key}"))
        if structured_outputs.get("json_object"):
            found.append(GrammarSpec("json_object", None, "structured_outputs.json_object"))
    if len(found) > 1:
        raise GrammarError(f"'{found[1].param}' and '{found[0].param}' both constrain the output; give one",
                           found[1].param)
    return found[0] if found else None


def _response_format(v: Any) -> list[GrammarSpec]:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise GrammarError("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                           "response_format.type")
    if v["type"] == "text":
        return []
    if v["type"] == "json_object":
        return [GrammarSpec("json_object", None, "response_format")]
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
        raise GrammarError("'response_format.json_schema' must be an object with a 'schema' object",
                           "response_format.json_schema")
    return [_typed("json_schema", js.get("schema", {}), "response_format.json_schema.schema")]


def _typed(kind: str, v: Any, param: str) -> GrammarSpec:
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise GrammarError(f"'{param}' is not valid JSON: {e}", param) from None
        if not isinstance(v, (dict, bool)):
            raise GrammarError(f"'{param}' must be a JSON schema object", param)
    elif kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise GrammarError(f"'{param}' must be a non-empty array of strings", param)
    elif not isinstance(v, str) or not v:
        raise GrammarError(f"'{param}' must be a non-empty string", param)
    return GrammarSpec(kind, v, param)


class GrammarCompiler:
    """One per tokenizer: llguidance's view of the vocabulary, built once (a second or more on a
    large vocabulary), shared by every request's matcher."""

    def __init__(self, tokenizer: "Tokenizer", eos_ids: list[int] | set[int], vocab_size: int | None = None):
        self.tokenizer, self.eos_ids = tokenizer, sorted(eos_ids)
        self.vocab_size = vocab_size or tokenizer.vocab_size

    @cached_property
    def lltok(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self.eos_ids or None)

    @cached_property
    def executor(self) -> Any:
        """Computes a verify's row masks in one call (one thread: a request has one matcher)."""
        import llguidance

        return llguidance.LLExecutor(num_threads=1)

    def check(self, spec: GrammarSpec) -> str:
        """The grammar text of `spec`, or a GrammarError naming its field when llguidance refuses it."""
        import llguidance

        try:
            src = grammar_source(spec)
            if spec.think:
                src = think_first(src, self.tag(THINK_OPEN) or json.dumps(THINK_OPEN), self.tag(THINK_CLOSE))
            elif spec.after is not None and spec.kind in ("json_schema", "json_object"):
                src = led(src)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"'{spec.param}' cannot be compiled: {e}", spec.param) from None
        err = llguidance.LLMatcher.validate_grammar(src, self.lltok)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"'{spec.param}' cannot be compiled: {err}", spec.param)
        return src

    def tag(self, text: str) -> str | None:
        """`text` as a Lark reference to its token where the vocabulary has it as one special token
        (llguidance never matches those as text), else None."""
        i = self.tokenizer.tok.token_to_id(text)
        if i is None or i >= self.vocab_size or not self.lltok.is_special_token(i):
            return None
        return f"<[{i}]>"

    def matcher(self, spec: GrammarSpec) -> "Matcher":
        import llguidance

        m = llguidance.LLMatcher(self.lltok, self.check(spec), log_level=0)
        if m.is_error():
            raise GrammarError(f"'{spec.param}' cannot be compiled: {m.get_error()}", spec.param)
        return Matcher(m, self.vocab_size, self.executor)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level piece of a character included)."""
        return bytes(self.lltok.decode_bytes([token]))


class Matcher:
    """A grammar's position in one output: `mask` for the next token, `advance` over tokens (it stops
    at the first the grammar forbids and says how many it took), `rollback(n)` undoes the last n."""

    def __init__(self, m: Any, vocab_size: int, executor: Any = None):
        self.m, self.vocab_size, self.executor = m, vocab_size, executor
        self.words = (vocab_size + 31) // 32

    def new_bitmask(self) -> np.ndarray:
        return np.zeros(self.words, dtype=np.int32)

    def mask(self, into: "np.ndarray | torch.Tensor") -> None:
        """Fill `into` (int32, `words` entries, contiguous, host memory) with the allowed-token bits:
        token t allowed iff bit t % 32 of word t // 32 is set."""
        ptr, n = (into.ctypes.data, into.nbytes) if isinstance(into, np.ndarray) else \
            (into.data_ptr(), into.numel() * into.element_size())
        if n != 4 * self.words:
            raise ValueError(f"mask buffer has {n} bytes; this vocabulary needs {4 * self.words}")
        self.m.unsafe_compute_mask_ptr(ptr, n)

    def masks(self, into: "torch.Tensor", drafts: list[int]) -> None:
        """Rows 0..len(drafts) of `into` ([rows, words] int32, contiguous, host memory): row i the
        mask after drafts[:i], as a verify's row i needs it; the rows after the first draft the
        grammar forbids allow every token (they are never emitted). The matcher ends where it began.
        llguidance leaves those rows as they were (zeros, or an earlier step's masks), so they are set
        to all ones first: a row of zeros masks every id, and its target is no token at all."""
        r = len(drafts) + 1
        if into.dim() != 2 or into.shape[0] < r or into.shape[1] != self.words or not into.is_contiguous():
            raise ValueError(f"masks: need a contiguous [>= {r}, {self.words}] buffer, got {tuple(into.shape)}")
        if not drafts:
            self.mask(into[0])
            return
        into[1:r].fill_(-1)
        self.executor.unsafe_compute_mask_ptr_with_draft_token([(self.m, 0, list(drafts))], into.data_ptr(),
                                                               4 * self.words, r)

    def allowed(self) -> np.ndarray:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        bits = self.new_bitmask()
        self.mask(bits)
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def advance(self, tokens: list[int]) -> int:
        """Consume the longest allowed prefix of `tokens`; the number consumed."""
        return int(self.m.try_consume_tokens(list(tokens)))

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self.m.get_error()}")

    def is_accepting(self) -> bool:
        """The output may end here (EOS is allowed)."""
        return bool(self.m.is_accepting())

    def is_done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return bool(self.m.is_stopped())

    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None
