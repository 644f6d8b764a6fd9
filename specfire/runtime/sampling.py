"""The one target distribution: penalties, then temperature, top-k, top-p, min-p, on float32 logits.

The AR route samples from `probs(...)`; the speculative accept rule tests drafts against exactly
the same distribution, so both routes produce the same output distribution.

Penalties (`penalize`, vLLM's definitions and order: before temperature and truncation, and
before the greedy argmax too) depend on the tokens before each row. A verify's row i conditions
on the prompt, the output so far and the drafts of rows 0..i-1, so it is penalised with exactly
those counts: when the drafts are accepted they are the counts AR decoding would have had at that
token, so greedy speculation still equals AR and sampled speculation still tests the drafts
against AR's (penalised) distribution. The counts live in device tensors (`Penalties`), updated
on the device after each step's accept; no host read.
"""
from __future__ import annotations

import torch

from ..params import SamplingParams
from .rng import DeviceRng, race_sample


class Penalties:
    """One request's token statistics on the device: `prompt` [V] bool (the ids in the prompt),
    `counts` [V] float32 (how often each id was generated so far; exact integers), `generated`
    (0-d float32, the tokens generated so far) and `ends` [V] bool (the ids that end the output,
    masked before min_tokens). `begin` resets them for a new request, so nothing carries over."""

    def __init__(self, vocab: int, device: torch.device | str):
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.generated = torch.zeros((), dtype=torch.float32, device=device)
        self.ends = torch.zeros(vocab, dtype=torch.bool, device=device)

    def begin(self, prompt: torch.Tensor, ends: list[int] | tuple[int, ...] = ()) -> "Penalties":
        self.prompt.zero_()
        self.prompt[prompt.to(self.prompt.device)] = True
        self.counts.zero_()
        self.generated.zero_()
        self.ends.zero_()
        if ends:
            self.ends[torch.tensor(list(ends), dtype=torch.long, device=self.ends.device)] = True
        return self

    def add(self, tokens: torch.Tensor, n: torch.Tensor | None = None) -> None:
        """Count generated tokens [m] (int64, on the device): all of them, or the first n + 1 (n a
        0-d device tensor, a step's accepted drafts; the rest were not emitted)."""
        w = torch.ones(tokens.shape[0], dtype=torch.float32, device=tokens.device)
        if n is not None:
            w = (torch.arange(tokens.shape[0], device=tokens.device) <= n).to(torch.float32)
        self.counts.index_add_(0, tokens, w)
        self.generated += w.sum()


def penalize(logits: torch.Tensor, pen: Penalties | None, sp: SamplingParams,
             draft: torch.Tensor | None = None, ends: bool = True) -> torch.Tensor:
    """logits [R, V] of rows conditioned on the request so far plus draft[:i] (row i; draft [R-1]
    int64 on the device, None or empty for one row) -> float32 penalised logits, a new tensor.
    For the ids seen in the prompt or in row i's output (counts + drafts before i): a positive
    logit is divided by repetition_penalty, a negative one multiplied; then, with c the output
    count, logit -= frequency_penalty * c and presence_penalty * [c > 0]. With min_tokens (and
    `ends`), a row whose token would be one of the first min_tokens gets -inf at every id that
    ends the output (vLLM's min_tokens), so no route can end early. Fixed shapes, no host read.
    The same function serves the first token, the AR step and every verify row, so a row's
    result depends only on its own context. Returns the logits as they are when `pen` is None or
    nothing applies."""
    masks = ends and sp.min_tokens > 0
    if pen is None or not (sp.penalized or masks):
        return logits
    x = logits.float()
    r, v = x.shape
    out = x
    k = 0 if draft is None else draft.shape[0]
    if k and k != r - 1:
        raise ValueError(f"penalize: {r} rows need {r - 1} drafts, got {k}")
    if sp.penalized:
        counts = pen.counts.view(1, v).expand(r, v)
        if k:
            rows = torch.arange(r, device=x.device).view(r, 1)
            before = (rows > torch.arange(k, device=x.device).view(1, k)).to(torch.float32)   # [R, k]: draft j precedes row i
            counts = counts.clone().scatter_add_(1, draft.view(1, k).expand(r, k), before)
        if sp.repetition_penalty != 1.0:
            seen = pen.prompt.view(1, v) | (counts > 0)
            rp = float(sp.repetition_penalty)
            out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
        if sp.frequency_penalty != 0.0:
            out = out - float(sp.frequency_penalty) * counts
        if sp.presence_penalty != 0.0:
            out = out - float(sp.presence_penalty) * (counts > 0).to(torch.float32)
    if masks:
        early = (pen.generated + torch.arange(r, device=x.device, dtype=torch.float32)) < sp.min_tokens   # [R]
        out = out.masked_fill(early.view(r, 1) & pen.ends.view(1, v), float("-inf"))
    return out


def penalize_draft(logits: torch.Tensor, pen: Penalties | None, sp: SamplingParams,
                   before: list[torch.Tensor]) -> torch.Tensor:
    """One draft step's logits [1, N] penalised as the verify will penalise its row: with the
    request's counts plus the drafts picked before it in this chain (`before`, [1] int64 each, on
    the device). N may be a draft vocabulary (ids 0..N-1 of V): the statistics are cut to it.
    The same arithmetic as `penalize` (counts are exact integers), so a draft step whose head
    agrees with the trunk picks what the verify row picks. min_tokens is left to the verify (a
    draft only changes what is accepted). Fixed shapes, no host read (capturable)."""
    if pen is None or not sp.penalized:
        return logits
    n = logits.shape[-1]
    counts = pen.counts[:n]
    if before:
        d = torch.cat(before)
        counts = counts.clone().index_add_(0, d, torch.ones(d.shape[0], dtype=torch.float32, device=d.device))
    view = Penalties.__new__(Penalties)
    view.prompt, view.counts = pen.prompt[:n], counts
    return penalize(logits, view, sp, ends=False)


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [R, V] float32 -> probabilities [R, V] after temperature, top-k, top-p and min-p
    (top-p keeps at least the most likely token, as vLLM's does)."""
    x = logits.float() / max(sp.temperature, 1e-6)
    v = x.shape[-1]
    if 0 < sp.top_k < v:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sp_sorted, idx = torch.sort(p, dim=-1, descending=True)
        before = sp_sorted.cumsum(-1) - sp_sorted          # mass strictly before each token
        drop_sorted = before >= sp.top_p                    # keep the smallest set reaching top_p
        drop_sorted[..., 0] = False     # and the top token always: a top_p below float32's range is 0 here
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        p = p.masked_fill(drop, 0.0)
    if sp.min_p > 0.0:
        p = p.masked_fill(p < sp.min_p * p.max(dim=-1, keepdim=True).values, 0.0)
    return p / p.sum(-1, keepdim=True)


def sample(p: torch.Tensor, rng: DeviceRng | None) -> torch.Tensor:
    """One token per row from probabilities [R, V] -> [R] int64, drawn from `rng` (runtime/rng.py:
    device-side state, graph-capturable); None draws from a fresh unseeded stream."""
    if rng is None:
        rng = DeviceRng(p.device).seed(None)
    return race_sample(p, rng)


def pick(logits: torch.Tensor, sp: SamplingParams, rng: DeviceRng | None) -> torch.Tensor:
    """The AR choice per row: argmax when greedy, else a sample of `probs`."""
    if sp.greedy:
        return logits.argmax(-1)
    return sample(probs(logits, sp), rng)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Rows [R, 1 + 2N] float32 (N = sp.logprobs): log p_i(tokens[i]), then row i's N largest
    log-probabilities and their ids (as floats: exact below 2**24). p_i is the distribution row i's
    token is drawn from: `probs` of the processed logits (penalised and masked), or for a greedy
    request the processed logits' softmax at temperature 1. Fixed shapes, no host read: the step
    sends it with its one read."""
    x = logits.float()
    lp = torch.log_softmax(x, -1) if sp.greedy else torch.log(probs(x, sp))
    chosen = lp.gather(1, tokens.view(-1, 1))
    n = int(sp.logprobs or 0)
    if not n:
        return chosen
    top = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values, top.indices.to(torch.float32)], 1)


def sampling_key(sp: SamplingParams) -> tuple | None:
    """What a captured sampling graph bakes in (None for greedy)."""
    return None if sp.greedy else (float(sp.temperature), int(sp.top_k), float(sp.top_p), float(sp.min_p))
