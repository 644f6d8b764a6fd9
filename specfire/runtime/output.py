"""Turning accepted tokens into output: EOS and stop token ids, stop strings, min_tokens,
max_tokens, special tokens, streaming text deltas.

Tokens go through `add` one at a time whatever route produced them, so speculative output ends
exactly where AR output would. The ends follow vLLM: a stop token (EOS unless ignore_eos, or one
of stop_token_ids) is counted in `token_ids` but its text is left out unless
include_stop_str_in_output; a stop string cuts the text before it (after it with
include_stop_str_in_output); no end but the length falls on the first `min_tokens` tokens (the
engine masks the stop tokens out of their distribution, so none is generated there)."""
from __future__ import annotations

from dataclasses import dataclass

from ..params import SamplingParams
from ..tokenizer import Detokenizer, Tokenizer


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the most likely alternatives at its position, as
    (token id, log-probability), most likely first; -inf where the distribution gives 0."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_row(cls, token: int, row: list[float]) -> "TokenLogprobs":
        """From a `sampling.token_logprobs` row: [chosen, N values, N ids]."""
        n = (len(row) - 1) // 2
        return cls(token, row[0], tuple((int(i), v) for v, i in zip(row[1:1 + n], row[1 + n:])))


class OutputBuilder:
    def __init__(self, sp: SamplingParams, eos_ids: set[int], tok: Tokenizer | None, max_new: int):
        self.sp = sp
        # the token ids that end the output (the engine masks the same set before min_tokens)
        self.eos = (set() if sp.ignore_eos else set(eos_ids)) | set(sp.stop_token_ids)
        self.detok = Detokenizer(tok) if tok is not None else None
        self.skip = tok.special_ids if tok is not None and sp.skip_special_tokens else frozenset()
        self.max_new = max_new
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.sent = 0                      # characters of the text already released
        self._text = ""
        self._checked = 0                  # no stop string may end at or before this character
        self._max_stop = max((len(s) for s in sp.stop), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.token_ids)

    @property
    def text(self) -> str:
        return self._text[:self.sent] if self.done else self._text

    def add(self, token: int) -> str:
        """Append one token; return the text that can be released now ('' while held back)."""
        if self.done:
            return ""
        self.token_ids.append(token)
        may_end = len(self.token_ids) > self.sp.min_tokens
        if may_end and token in self.eos:
            self.finish_reason = "stop"
            if self.sp.include_stop_str_in_output:
                self._push(token)
            if self.detok is not None:      # a dangling partial character is released, not dropped
                self._text += self.detok.flush()
            return self._release(len(self._text))
        self._push(token)
        if self.sp.stop:
            end = self._stop_end() if may_end else None
            if end is not None:
                self.finish_reason = "stop"
                return self._release(end)
            self._checked = len(self._text)
        if len(self.token_ids) >= self.max_new:
            self.finish_reason = "length"
            if self.detok is not None:
                self._text += self.detok.flush()
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_back())

    def end(self, reason: str) -> str:
        """End the output after the tokens added so far (a grammar that is complete); the text held
        back (a partial stop string, a partial character) is released."""
        if self.done:
            return ""
        self.finish_reason = reason
        if self.detok is not None:
            self._text += self.detok.flush()
        return self._release(len(self._text))

    def _push(self, token: int) -> None:
        if self.detok is not None and token not in self.skip:
            self._text += self.detok.push(token)

    def _stop_end(self) -> int | None:
        """Where the text ends if a stop string completed in the newest text: the earliest one
        (the shorter at a tie), cut before it or, with include_stop_str_in_output, after it."""
        best: tuple[int, int] | None = None
        for s in self.sp.stop:
            i = self._text.find(s, max(0, self._checked - len(s) + 1))
            if i >= 0 and (best is None or (i, len(s)) < best):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + best[1] if self.sp.include_stop_str_in_output else best[0]

    def _held_back(self) -> int:
        """Length of the text tail that could still grow into a stop string."""
        for n in range(min(self._max_stop - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self.sp.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        delta = self._text[self.sent:end]
        self.sent = end
        if self.done:
            self._text = self._text[:end]
        return delta
