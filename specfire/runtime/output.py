"""Turning accepted tokens into output: EOS, stop strings, max_tokens, streaming text deltas.

Tokens go through `add` one at a time whatever route produced them, so speculative output ends
exactly where AR output would."""
from __future__ import annotations

from ..config import SamplingParams
from ..tokenizer import Detokenizer, Tokenizer


class OutputBuilder:
    def __init__(self, sp: SamplingParams, eos_ids: set[int], tok: Tokenizer | None, max_new: int):
        self.sp = sp
        self.eos = set() if sp.ignore_eos else eos_ids
        self.detok = Detokenizer(tok) if tok is not None else None
        self.max_new = max_new
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.sent = 0                      # characters of the text already released
        self._text = ""
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
        if token in self.eos:
            self.finish_reason = "stop"
            if self.detok is not None:      # a dangling partial character is released, not dropped
                self._text += self.detok.flush()
            return self._release(len(self._text))
        if self.detok is not None:
            self._text += self.detok.push(token)
        if self.sp.stop:
            start = max(0, self.sent - self._max_stop)
            hits = [i for i in (self._text.find(s, start) for s in self.sp.stop) if i >= 0]
            if hits:
                self.finish_reason = "stop"
                return self._release(min(hits))
        if len(self.token_ids) >= self.max_new:
            self.finish_reason = "length"
            if self.detok is not None:
                self._text += self.detok.flush()
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_back())

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
