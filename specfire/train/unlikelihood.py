"""Unlikelihood losses against repetition (Welleck et al. 2019) and the repetition measure.

Greedy decoding of a small code model copies its own context (it rewrites the function it just
wrote). Likelihood training alone does not penalise that; unlikelihood does, at two levels:
* token level, on corpus text: at each position, push down the probability of tokens that already
  occurred in the context but are not the next token;
* sequence level, on the model's own greedy continuations: push down the probability of each
  generated token that completes or lies inside an n-gram the sequence already contained;
and `kl_to_teacher` holds the corpus distribution where the starting model had it.
`line_stats` is the measure the model card's repetition target uses (bench/bundled_loops.py).
"""
from __future__ import annotations

import re

import torch

_EPS = 1e-5


def token_unlikelihood(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T-1, V] (row t predicts ids[:, t+1]), ids [B, T] -> mean over rows of
    -sum_{c in context(t), c != target} log(1 - p(c)), context(t) = ids[:, :t+1]."""
    b, t = ids.shape
    v = logits.shape[-1]
    pos = torch.arange(t, device=ids.device)
    first = torch.full((b, v), t, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(1, ids, pos.expand(b, t), reduce="amin")     # first position of each token
    cand = first[:, None, :] <= pos[:t - 1, None]                      # [B, T-1, V] seen in the context
    cand.scatter_(2, ids[:, 1:, None], False)                          # the true next token is not penalised
    one_minus = (1.0 - logits.float().softmax(-1)).clamp_min(_EPS)
    return -(one_minus.log() * cand).sum(-1).mean()


def ngram_repeat_mask(seq: torch.Tensor, start: int, n: int, with_prompt: bool = True) -> torch.Tensor:
    """seq [B, L] -> bool [B, L]: positions >= start that lie inside an n-gram which already
    occurred earlier in the sequence (from position 0 if with_prompt, else from `start`)."""
    b, length = seq.shape
    if length < n:
        return torch.zeros_like(seq, dtype=torch.bool)
    # eq[b, i, j]: the n-grams ending at i and at j are equal
    eq = torch.ones(b, length, length, dtype=torch.bool, device=seq.device)
    for d in range(n):
        s = seq[:, : length - d] if d else seq
        e = s[:, :, None] == s[:, None, :]
        eq[:, d:, d:] &= e
    idx = torch.arange(length, device=seq.device)
    first_end = n - 1 + (0 if with_prompt else start)
    valid_j = (idx[None, :] < idx[:, None]) & (idx[None, :] >= first_end)   # j earlier than i, a full n-gram
    rep_end = (eq & valid_j[None]).any(-1) & (idx >= max(n - 1, start))[None]  # [B, L] n-gram ending at i repeats
    mark = rep_end.clone()
    for d in range(1, n):                                              # every token of a repeated n-gram
        mark[:, : length - d] |= rep_end[:, d:]
    mark[:, :start] = False
    return mark


def sequence_unlikelihood(logits: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor,
                          alive: torch.Tensor) -> torch.Tensor:
    """logits [B, L-1, V] for seq [B, L]; mask / alive bool [B, L] over the continuation:
    sum of -log(1 - p(seq_t)) over masked positions / number of alive positions."""
    logp = logits.float().log_softmax(-1).gather(-1, seq[:, 1:, None])[..., 0]   # [B, L-1] log p(seq_t)
    one_minus = (1.0 - logp.exp()).clamp_min(_EPS)
    m = (mask & alive)[:, 1:]
    return -(one_minus.log() * m).sum() / alive[:, 1:].sum().clamp_min(1)


def anchored_unlikelihood(logits: torch.Tensor, teacher_logits: torch.Tensor, seq: torch.Tensor,
                          mask: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """Sequence-level unlikelihood anchored to a frozen teacher (the model before the phase):
    cross-entropy to the teacher's distribution, from which each masked (repeating) token's
    probability is removed and the rest renormalised; unmasked positions keep the teacher's.
    At the teacher's own distribution its gradient is the plain loss's, -log(1 - p(token)); the
    anchor keeps every other position where it was, which the plain loss does not (measured: it
    drove the distributions on the model's own text towards uniform, see MODEL_CARD.md)."""
    q = teacher_logits.float().softmax(-1)
    q_rm = q.scatter(-1, seq[:, 1:, None], 0.0)
    q_rm = q_rm / q_rm.sum(-1, keepdim=True).clamp_min(_EPS)
    target = torch.where(mask[:, 1:, None], q_rm, q)
    ce = -(target * logits.float().log_softmax(-1)).sum(-1)
    a = alive[:, 1:]
    return (ce * a).sum() / a.sum().clamp_min(1)


def word_edges(tok, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts_ident, ends_ident), bool [vocab]: whether each token's text begins / ends with an
    identifier character (letter, digit, `_`); ids the tokenizer lacks are False on both."""
    starts = torch.zeros(vocab, dtype=torch.bool)
    ends = torch.zeros(vocab, dtype=torch.bool)
    for i in range(min(vocab, tok.get_vocab_size())):
        t = tok.decode([i], skip_special_tokens=False)
        if t:
            starts[i] = t[0].isalnum() or t[0] == "_"
            ends[i] = t[-1].isalnum() or t[-1] == "_"
    return starts, ends


def repeat_continuations(seq: torch.Tensor, start: int, n: int, vocab: int,
                         edges: tuple[torch.Tensor, torch.Tensor] | None = None,
                         newline: torch.Tensor | None = None) -> torch.Tensor:
    """seq [B, L] -> bool [B, L, V]: at position i >= start, the tokens c for which seq[i-n+1:i] + c
    repeats an n-gram that ended earlier in the sequence (prompt included): what may follow the
    last n-1 tokens without completing a repeat is everything else. `edges` (word_edges): a token
    that would continue a word (the previous token ends with an identifier character and c begins
    with one) is never banned, so a repeat is refused only where a new word or symbol starts and
    cannot be escaped by misspelling the rest of a name. `newline` (newline_tokens: the tokens that
    end a line): only repeats of an n-gram that begins in position i's own line count."""
    b, length = seq.shape
    m = n - 1
    ban = torch.zeros(b, length, vocab, dtype=torch.bool, device=seq.device)
    if length <= m:
        return ban
    eq = torch.ones(b, length, length, dtype=torch.bool, device=seq.device)
    for d in range(1, m + 1):       # eq[b, i, j]: seq[i-d] == seq[j-d] for d = 1..m (the contexts agree)
        s = seq[:, : length - d]
        eq[:, d:, d:] &= s[:, :, None] == s[:, None, :]
    idx = torch.arange(length, device=seq.device)
    valid = (idx[None, :] < idx[:, None]) & (idx[None, :] >= m) & (idx[:, None] >= max(m, start))
    eq &= valid[None]
    if newline is not None:
        nl = newline.to(seq.device)[seq].long()
        line = nl.cumsum(1) - nl                                       # line breaks strictly before each position
        first = torch.zeros_like(line)
        first[:, m:] = line[:, : length - m]                           # line of the n-gram's first token (j - m)
        eq &= first[:, None, :] == line[:, :, None]                    # [B, i, j]: it starts in i's line
    bi, ii, jj = eq.nonzero(as_tuple=True)
    c = seq[bi, jj]
    if edges is not None:
        starts, ends = (e.to(seq.device) for e in edges)
        word_start = ~(ends[seq[bi, ii - 1]] & starts[c])
        bi, ii, c = bi[word_start], ii[word_start], c[word_start]
    ban[bi, ii, c] = True
    return ban


def newline_tokens(tok, vocab: int) -> torch.Tensor:
    """bool [vocab]: whether each token's text holds a line break (it ends a line)."""
    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(min(vocab, tok.get_vocab_size())):
        out[i] = "\n" in tok.decode([i], skip_special_tokens=False)
    return out


def line_repeat_continuations(seq: torch.Tensor, start: int, n: int, vocab: int, newline: torch.Tensor,
                              edges: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """repeat_continuations for a short n-gram whose earlier occurrence lies wholly in position i's
    line: the phrase loops inside a line (`the directory of the directory of ...`, `all all all`)
    that a long n-gram ban reaches only after several words."""
    return repeat_continuations(seq, start, n, vocab, edges, newline)


def banned_anchored_unlikelihood(logits: torch.Tensor, teacher_logits: torch.Tensor, ban: torch.Tensor,
                                 alive: torch.Tensor) -> torch.Tensor:
    """logits / teacher_logits [B, L-1, V] for a sequence of L tokens, ban [B, L, V]
    (repeat_continuations), alive [B, L]: cross-entropy to the teacher's distribution with every
    banned token removed and the rest renormalised, averaged over alive continuation positions.
    Unlike anchored_unlikelihood, the target depends only on the context, not on the token the
    model happened to write: once the model avoids a repeat, the anchor does not pull it back."""
    q = teacher_logits.float().softmax(-1).masked_fill(ban[:, 1:], 0.0)
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-12)
    ce = -(q * logits.float().log_softmax(-1)).sum(-1)
    a = alive[:, 1:]
    return (ce * a).sum() / a.sum().clamp_min(1)


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) per position, averaged over positions (logits [..., V]): on corpus
    text it holds the fine-tuned model's whole next-token distribution where the starting model's
    was, which a one-hot likelihood term alone does not (the held-out perplexity guard)."""
    logq = teacher_logits.float().log_softmax(-1)
    logp = logits.float().log_softmax(-1)
    return (logq.exp() * (logq - logp)).sum(-1).mean()


def alive_mask(seq: torch.Tensor, start: int, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """bool [B, L]: continuation positions up to and including the first end-of-text token."""
    cont = torch.zeros_like(seq, dtype=torch.bool)
    cont[:, start:] = True
    is_eos = torch.zeros_like(cont)
    for e in eos_ids:
        is_eos |= seq == e
    is_eos &= cont
    before = (is_eos.cumsum(1) - is_eos.long()) == 0                   # no eos strictly before
    return cont & before


# ---------------------------------------------------------------------------------------------
# The repetition measure (bench/bundled_loops.py) and prompts cut at definitions
# ---------------------------------------------------------------------------------------------

def line_stats(prompt: str, text: str, cut: bool = True) -> tuple[int, int, int]:
    """(complete non-blank lines, repeats of an earlier completion line, repeats of an earlier
    prompt-or-completion line). `cut`: the text ended at the token limit, so its last piece is a
    partial line and does not count."""
    lines = text.split("\n")
    if cut:
        lines = lines[:-1]
    seen, seen_all = set(), {ln.strip() for ln in prompt.split("\n") if ln.strip()}
    n = rep = rep_all = 0
    for ln in lines:
        s = ln.strip()
        if not s:
            continue
        n += 1
        rep += s in seen
        rep_all += s in seen_all
        seen.add(s)
        seen_all.add(s)
    return n, rep, rep_all


_WORD = re.compile(r"\w+")


def phrase_loop_lines(text: str, cut: bool = True, n: int = 3) -> tuple[int, int]:
    """(complete non-blank lines, lines in which some run of n words occurs twice or more): the loops
    inside a line (`the directory of the directory of the ...`, `all all all ...`) that line_stats
    cannot see. Words are runs of letters, digits and `_`; `cut` as in line_stats."""
    lines = text.split("\n")
    if cut:
        lines = lines[:-1]
    total = loops = 0
    for ln in lines:
        if not ln.strip():
            continue
        total += 1
        w = _WORD.findall(ln)
        grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
        loops += len(set(grams)) < len(grams)
    return total, loops


_DEF = re.compile(r"^[ \t]*(?:async def|def|class) .*\n", re.M)


def definition_starts(docs: list[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """(text, start, end of line) of every `def` / `class` line of the documents."""
    return [(text, m.start(), m.end()) for _, text in docs for m in _DEF.finditer(text)]
