"""What both fine-tune phases share (finetune.py, snippet_phase.py): prompts cut at definitions,
the schedule fitted to the time left, and the guard that scores each snapshot by the rule of
select.py and keeps the best one's weights."""
from __future__ import annotations

import copy
import json
import math
import random
import time

import torch

from . import select as sel
from . import unlikelihood as ul
from .evaluate import token_stream, total_nll


class Prompts:
    """Token prompts cut at the start of `def` / `class` lines of some documents."""

    def __init__(self, tok, docs: list[tuple[str, str]], seed: int, limit: int = 40000, chars: int = 600):
        starts = ul.definition_starts(docs)
        rng = random.Random(seed)
        rng.shuffle(starts)
        self.snippets = [text[a:a + chars] for text, a, _ in starts[:limit]]
        self.tok, self.rng = tok, rng

    def batch(self, n: int, length: int, device) -> torch.Tensor:
        """[n, length] prompts of exactly `length` tokens (snippets too short are skipped)."""
        if not self.snippets:
            raise ValueError("no `def` / `class` line in the documents to cut rollout prompts from")
        rows: list[list[int]] = []
        while len(rows) < n:
            pick = [self.snippets[self.rng.randrange(len(self.snippets))] for _ in range(2 * (n - len(rows)))]
            for enc in self.tok.encode_batch(pick, add_special_tokens=False):
                if len(enc.ids) >= length and len(rows) < n:
                    rows.append(enc.ids[:length])
        return torch.tensor(rows, dtype=torch.long, device=device)

    def varied(self, n: int, lo: int, hi: int) -> list[list[int]]:
        """n prompts of lengths drawn from [lo, hi] (one rollout batch takes several lengths), from
        distinct snippets in the seeded order: the same documents and seed give the same prompts."""
        rows: list[list[int]] = []
        for snip in self.snippets:
            if len(rows) == n:
                break
            ids = self.tok.encode(snip, add_special_tokens=False).ids
            want = self.rng.randint(lo, hi)
            if len(ids) >= want:
                rows.append(ids[:want])
        return rows


def fit_schedule(step: int, per_step_s: float, left_s: float, cap: int) -> int:
    """The schedule length that ends when the time left does, at `per_step_s` a step (at least
    one more step, at most `cap`)."""
    return min(cap, step + max(1, int(left_s / per_step_s)))


class Guard:
    """Scores snapshots (select.py) and keeps the weights of the best one so far in memory."""

    def __init__(self, tc, trunk, head, tok, held_docs, val_docs, eos_ids, held_prompts, log, val_kind: str = "any"):
        self.tc, self.trunk, self.head, self.tok, self.eos, self.log = tc, trunk, head, tok, eos_ids, log
        self.dev = next(trunk.parameters()).device
        if val_kind == "top":     # a user's prompt: the first lines of a top-level definition, from position 0
            from .snippets import definition_prompts
            val = definition_prompts(val_docs, tc.ul_val_prompts, tc.seed + 2, tok)
        else:
            val = Prompts(tok, val_docs, tc.seed + 2).varied(tc.ul_val_prompts, tc.ul_prompt_min, tc.ul_prompt_max)
        if not val:
            raise ValueError(f"ul_select: the validation files ({len(val_docs)}, ul_val_permille "
                             f"{tc.ul_val_permille}) have no `def` / `class` line long enough for a prompt")
        # "val" decides (select.py); "bench" (bench/bundled_loops.py's prompts) and "held_out" (held-out
        # packages) are only logged: the figures the phase is judged on afterwards
        self.prompts = {"val": val, "bench": [tok.encode(p, add_special_tokens=False).ids for p in sel.LOOP_PROMPTS]}
        if held_prompts is not None:
            self.prompts["held_out"] = held_prompts.tolist()
        eot = eos_ids[0]
        self.stream = token_stream(tok, eot, val_docs) if val_docs else None
        if self.stream is not None and self.stream.numel() <= tc.seq_len:
            self.stream = None
        # logged only: held-out packages perplexity on every max(4, ul_ppl_every)th window (bench/bundled_ppl.py's documents and order)
        held_docs = sorted(held_docs, key=lambda d: (d[0].split("/", 1)[0], d[0]))
        self.held_stream = token_stream(tok, eot, held_docs) if held_docs else None
        if self.held_stream is not None and self.held_stream.numel() <= tc.seq_len:
            self.held_stream = None
        self.cands: list[sel.Candidate] = []
        self.rows: list[dict] = []
        self.best: tuple[sel.Candidate, dict] | None = None
        self.start = self._figures()
        self.ppl0 = self.start.get("ppl")
        self.prompt_text = {k: [tok.decode(p) for p in v] for k, v in self.prompts.items() if k != "bench"}
        log("UL guard, starting model: " + json.dumps(self.start))

    def _figures(self) -> dict:
        t = time.time()
        f = sel.loop_figures(self.trunk, self.tok, self.prompts, self.tc.ul_select_tokens, self.eos)
        self.trunk.eval()
        if self.stream is not None:
            nll, n = total_nll(self.trunk, self.stream, self.tc.seq_len, self.dev, 32, self.tc.ul_ppl_every)
            f["ppl"] = math.exp(nll / max(1, n))
            f["ppl_tokens"] = n
        if self.held_stream is not None:
            every = max(4, self.tc.ul_ppl_every)
            nll, n = total_nll(self.trunk, self.held_stream, self.tc.seq_len, self.dev, 32, every)
            f[f"held_out_ppl_every{every}"] = math.exp(nll / max(1, n))
        self.trunk.train()
        f["seconds"] = round(time.time() - t, 2)
        return f

    def score(self, step: int) -> dict:
        f = self._figures()
        ratio = f["ppl"] / self.ppl0 if self.ppl0 else 1.0
        v = f["val"]
        c = sel.Candidate(step, v["repeated_line_frac_guarded"] + self.tc.ul_select_phrase * v["phrase_loop_line_frac"],
                          ratio)
        self.cands.append(c)
        row = {"step": step, "rep": c.rep, "ppl_ratio": ratio, **f}
        self.rows.append(row)
        if sel.choose(self.cands, self.tc.ul_ppl_budget) is c:
            self.best = (c, (copy.deepcopy(self.trunk.state_dict()), copy.deepcopy(self.head.state_dict())))
        self.log(f"UL guard at step {step}: " + json.dumps(row))
        return row

    def finish(self, step: int, save, out: dict) -> dict:
        """Apply the rule: load the chosen snapshot's weights (the last weights are packed as
        last.tar first when they differ), or keep the last weights when none is within budget."""
        choice = sel.choose(self.cands, self.tc.ul_ppl_budget)
        res = {"rule": f"lowest guarded repetition + {self.tc.ul_select_phrase:g} x phrase-loop lines on "
                       f"{len(self.prompts['val'])} validation prompts, with validation "
                       f"ppl (every {self.tc.ul_ppl_every}th window) <= {1 + self.tc.ul_ppl_budget:.2f}x start",
               "start": self.start, "candidates": self.rows, "prompt_text": self.prompt_text,
               "chosen_step": choice.step if choice else None}
        if choice is None:
            self.log("UL guard: no snapshot within the perplexity budget; the last weights stay")
        elif choice.step != step:
            save(f"UL last weights, step {step} (not chosen)", "last.tar", {**out, "selection": res})
            trunk_sd, head_sd = self.best[1]
            self.trunk.load_state_dict(trunk_sd)
            self.head.load_state_dict(head_sd)
            self.log(f"UL guard: chose step {choice.step} (rep {choice.rep:.3f}, ppl x{choice.ppl_ratio:.3f})")
        else:
            self.log(f"UL guard: chose the last step {step} (rep {choice.rep:.3f}, ppl x{choice.ppl_ratio:.3f})")
        return res
