"""Token log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries (token, logprob,
bytes, top_logprobs) and the completions' `logprobs` object (tokens, token_logprobs, top_logprobs,
text_offset). A log-probability of -inf (a token the distribution gives 0: masked by a grammar,
cut by top-k / top-p) is written -9999.0, as vLLM does: JSON has no infinity."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ..runtime.output import TokenLogprobs
    from ..tokenizer import Tokenizer

FLOOR = -9999.0


def finite(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


class LogprobFormat:
    """Turns TokenLogprobs into OpenAI's entries with one tokenizer (token text and bytes)."""

    def __init__(self, tok: "Tokenizer | None"):
        self.tok = tok

    def text(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok is not None else f"<{t}>"

    def bytes(self, t: int) -> list[int]:
        return list(self.tok.token_bytes(t)) if self.tok is not None else list(self.text(t).encode())

    def _one(self, t: int, lp: float) -> dict[str, Any]:
        return {"token": self.text(t), "logprob": finite(lp), "bytes": self.bytes(t)}

    def chat(self, lps: Sequence["TokenLogprobs"]) -> list[dict[str, Any]]:
        """chat.completion `choices[].logprobs.content` entries."""
        return [{**self._one(x.token, x.logprob), "top_logprobs": [self._one(t, v) for t, v in x.top]} for x in lps]

    def completion(self, lps: Sequence["TokenLogprobs | None"], tokens: Sequence[int], offset: int = 0
                   ) -> dict[str, Any]:
        """A text_completion `logprobs` object for `tokens` (an entry None: the prompt's first token,
        which has no distribution); text offsets count from `offset` characters."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = offset
        for t, x in zip(tokens, lps):
            s = self.text(t)
            out["tokens"].append(s)
            out["text_offset"].append(pos)
            pos += len(s)
            out["token_logprobs"].append(None if x is None else finite(x.logprob))
            out["top_logprobs"].append(None if x is None else {self.text(i): finite(v) for i, v in x.top})
        return out


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Completions logprobs objects one after the other (the prompt's, then the answer's)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
