"""Which weights of an unlikelihood phase to keep: the repetition and perplexity of each snapshot,
and the rule that picks one, fixed before the run.

The rule (`choose`): among the snapshots whose perplexity on the validation files (training-corpus
files set aside from the phase by a salted path hash: corpus.split_validation) is within `ppl_budget`
of the starting model's, the one with the lowest guarded repeated-line share (the model card's
target measure, bench/bundled_loops.py) on prompts cut at `def` / `class` lines of those same
validation files (plus `ul_select_phrase` x their phrase-loop line share, unlikelihood.phrase_loop_lines,
when set: loops inside a line, which the line figure cannot see); ties go to the lower perplexity. No snapshot within the budget: none is chosen
(the phase keeps its last weights and says so). The benchmark's LOOP_PROMPTS and the held-out
packages' prompts and text are only logged beside it, never used by the rule (until 2026-11-30 the
rule pooled LOOP_PROMPTS with held-out prompts and used held-out perplexity: selection on the test).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rollout import greedy_rollout
from .unlikelihood import line_stats, phrase_loop_lines

# Written for the repetition check (not taken from the standard library or the training corpus);
# bench/bundled_loops.py measures the shipped model on exactly these.
LOOP_PROMPTS = (
    'def moving_average(values, window):\n    """Return the moving averages of `values` over `window` items."""\n',
    "class Stack:\n    \"\"\"A last-in, first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
    "def parse_key_value_file(path):\n    \"\"\"Read `key = value` lines into a dict, skipping comments.\"\"\"\n",
    "import os\n\n\ndef find_largest_files(root, count=10):\n",
    "class Temperature:\n    def __init__(self, celsius):\n        self.celsius = celsius\n\n    def to_fahrenheit(self):\n",
    "def merge_sorted(left, right):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    result = []\n",
    "def word_frequencies(text):\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n",
    "def flatten(nested):\n    \"\"\"Yield the items of arbitrarily nested lists.\"\"\"\n",
    "def retry(func, attempts=3, delay=1.0):\n",
    "class Matrix:\n    def __init__(self, rows, cols):\n        self.rows = rows\n        self.cols = cols\n",
    "def validate_email(address: str) -> bool:\n",
)


def guarded(n: int, rep: int, junk: bool = False) -> tuple[int, int]:
    """(lines, repeated lines) as the guarded figure counts them: fewer than 2 lines, or junk, is 2 of 2
    (a model that ends the text at once or writes no line does not escape the measure)."""
    return (2, 2) if n < 2 or junk else (n, rep)


def completion_figures(prompt: str, text: str, ended: bool) -> dict:
    """One completion's line counts as bench/bundled_loops.py takes them (a completion cut by the
    token limit drops its partial last line)."""
    n, rep, _ = line_stats(prompt, text, cut=not ended)
    gn, gr = guarded(n, rep)
    _, loops = phrase_loop_lines(text, cut=not ended)
    return {"lines": n, "repeated": rep, "g_lines": gn, "g_repeated": gr, "ended": ended, "phrase_loops": loops}


def summarize(rows: list[dict]) -> dict:
    tot = {k: sum(r[k] for r in rows) for k in ("lines", "repeated", "g_lines", "g_repeated", "ended", "phrase_loops")}
    return {"repeated_line_frac": tot["repeated"] / max(1, tot["lines"]),
            "phrase_loop_line_frac": tot["phrase_loops"] / max(1, tot["lines"]),
            "repeated_line_frac_guarded": tot["g_repeated"] / max(1, tot["g_lines"]),
            "lines": tot["lines"], "ended": tot["ended"], "prompts": len(rows),
            "under_2_lines": sum(r["lines"] < 2 for r in rows)}


@torch.no_grad()
def loop_figures(trunk, tok, prompts: dict[str, list[list[int]]], new_tokens: int,
                 eos_ids: tuple[int, ...]) -> dict:
    """Greedy continuations of several named prompt sets in ONE batched rollout (prompts of any
    length), stopping each at end-of-text: {set name: summarize(...)}, plus "all" (every set's
    completions pooled) when there are several sets."""
    names = [k for k, v in prompts.items() for _ in v]
    rows_ids = [p for v in prompts.values() for p in v]
    if not rows_ids:
        return {}
    dev = next(trunk.parameters()).device
    lens = [len(p) for p in rows_ids]
    pad = torch.zeros(len(rows_ids), max(lens), dtype=torch.long)
    for i, p in enumerate(rows_ids):
        pad[i, :len(p)] = torch.tensor(p)
    was = trunk.training
    trunk.eval()
    seq = greedy_rollout(trunk, pad.to(dev), new_tokens, lengths=lens).cpu()
    trunk.train(was)
    per: dict[str, list[dict]] = {k: [] for k in prompts}
    for name, p, row in zip(names, rows_ids, seq):
        cont = row[len(p):len(p) + new_tokens].tolist()
        ended = False
        for j, t in enumerate(cont):
            if t in eos_ids:
                cont, ended = cont[:j], True
                break
        per[name].append(completion_figures(tok.decode(p), tok.decode(cont), ended))
    out = {k: summarize(v) for k, v in per.items()}
    if len(per) > 1:
        out["all"] = summarize([r for v in per.values() for r in v])
    return out


@dataclass
class Candidate:
    """One snapshot's figures: `rep` the rule's repetition figure on the validation prompts, `ppl_ratio`
    its validation perplexity over the starting model's (same windows)."""
    step: int
    rep: float
    ppl_ratio: float


def choose(cands: list[Candidate], ppl_budget: float) -> Candidate | None:
    """The rule of the module docstring: the lowest `rep` with ppl_ratio <= 1 + ppl_budget (ties:
    lower ppl_ratio, then the earlier step), or None when no snapshot is within the budget."""
    ok = [c for c in cands if c.ppl_ratio <= 1.0 + ppl_budget]
    return min(ok, key=lambda c: (c.rep, c.ppl_ratio, c.step)) if ok else None
