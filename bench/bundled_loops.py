"""Does the bundled model loop? Greedy completions of short function / class prompts.

The prompts (specfire/train/select.py LOOP_PROMPTS) were written for this check (none is taken
from the standard library or from the training corpus). For each, greedy AR decoding writes up to --max-tokens tokens (stopping at
the end-of-text token, as `specfire run` does, unless --ignore-eos); the figures are:
- repeated lines: the share of the completion's complete, non-blank lines whose stripped text
  equals an earlier non-blank line of the completion (the loop symptom); `with prompt` also counts
  a repeat of a prompt line;
- distinct 4-grams: distinct token 4-grams / all token 4-grams of the completion;
- long lines only: the repeated share among lines of at least 8 non-blank characters (so `else:`,
  `pass`, `return`, closing quotes or `)` never count), beside the main figure;
- prompt names reused: of the identifiers in the prompt (3+ characters; not keywords, builtins
  or `self`), the share the completion mentions again, summed over prompts (does it still write
  about what it was asked? a repetition penalty, which counts the prompt, pushes these away;
  added with the penalty options, 2026-12-01);
- phrase-loop lines: the share of complete non-blank lines in which a run of 3 words occurs twice
  (`a directory of the directory of the directory`, `all all all`): loops inside a line, which the
  repeated-line figure cannot see (measured beside it since 2026-12-01).
A low figure alone does not mean good code: a model that ends the text at once, or writes long
lines of junk, repeats nothing (measured on a degenerate fine-tune, MODEL_CARD.md), so the lines
written, the prompts with no complete line and those ended early are printed beside it, and a
guarded figure closes both exits: a completion of fewer than 2 complete non-blank lines counts as
2 lines, both repeated; with --ref-model, so does one whose perplexity under that reference model
(a model the checked one was not trained from scratch against, e.g. the previous weights) exceeds
--junk-ppl (word salad; the default 40 is several times what real code and the shipped model's
completions score, see MODEL_CARD.md).
`--repetition-penalty R --frequency-penalty F --presence-penalty P` decode with those penalties
(SamplingParams; vLLM's semantics, neutral by default): greedy with penalties is NOT plain greedy,
so its figures answer "what would a penalised default give", not the plain-greedy target.
`--natural N` applies the same measure to real code instead of the model's completions: N
definitions (`def` / `class` lines) of the held-out packages and stdlib modules, each followed by
the next --max-tokens tokens of its file (what repetition real code has: the measure's floor).

    python -m bench.bundled_loops [--model DIR] [--max-tokens 160] [--show 3] [--temperature T]
    python -m bench.bundled_loops --model NEW --ref-model OLD     # + the junk guard
    python -m bench.bundled_loops --natural 400
    python -m bench.bundled_loops --cut-block-end     # as if the model ended after the definition
    python -m bench.bundled_loops --repetition-penalty 1.2 --ref-model specfire/bundled
Prints a per-prompt table, sample completions, and one JSON line last.
"""
from __future__ import annotations

import argparse
import builtins
import json
import keyword
import os
import re
import sys

import torch

from specfire.api import LLM
from specfire.params import SamplingParams
from specfire.train.select import LOOP_PROMPTS as PROMPTS, guarded   # the prompts, the guard
from specfire.train.unlikelihood import line_stats, phrase_loop_lines   # the measures

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "os"}


def prompt_names(prompt: str, text: str) -> tuple[int, int]:
    """(identifiers of the prompt, those the completion uses again)."""
    names = {w for w in NAME.findall(prompt) if len(w) >= 3 and w not in COMMON}
    return len(names), len(names & set(NAME.findall(text)))


def distinct_4grams(ids: list[int]) -> tuple[int, int]:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)), len(grams)


def long_line_stats(text: str, cut: bool, min_chars: int = 8) -> tuple[int, int]:
    """(complete lines of >= min_chars non-blank characters, those repeating an earlier such line)."""
    lines = text.split("\n")[:-1] if cut else text.split("\n")
    seen: set[str] = set()
    n = rep = 0
    for ln in lines:
        s = ln.strip()
        if len(s) < min_chars:
            continue
        n += 1
        rep += s in seen
        seen.add(s)
    return n, rep


def cut_block_end(smp: dict, tok) -> dict:
    """The sample cut where the prompt's definition ends: before the first line (after the completion's
    first) that starts at column 0 with anything but a closing bracket or quote, counted as ended there
    (finish "stop"; ids = the cut text re-tokenized, for the 4-gram figure)."""
    lines = smp["text"].split("\n")
    for i, ln in enumerate(lines[1:], 1):
        if ln and not ln[0].isspace() and not ln.startswith((")", "]", "}", '"', "'")):
            text = "\n".join(lines[:i]).rstrip() + "\n"
            return {**smp, "text": text, "finish": "stop", "ids": tok.encode(text, add_special_tokens=False).ids}
    return smp


@torch.no_grad()
def reference_ppl(path: str, samples: list[dict]) -> list[float]:
    """Perplexity of each completion (tokens after the prompt's) under the checkpoint at `path`,
    teacher-forced on prompt + completion re-tokenized with its own tokenizer; nan if empty."""
    import math

    from tokenizers import Tokenizer

    from specfire.train import model as tm
    from specfire.train.export import load_checkpoint

    _, trunk, _ = load_checkpoint(path, "cpu")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    out = []
    for smp in samples:
        p = len(tok.encode(smp["prompt"], add_special_tokens=False).ids)
        ids = tok.encode(smp["prompt"] + smp["text"], add_special_tokens=False).ids
        if len(ids) <= p or p == 0:
            out.append(float("nan"))
            continue
        x = torch.tensor([ids])
        logp = tm.lm_logits(trunk, tm.trunk_hidden(trunk, x)).float().log_softmax(-1)[0, :-1]
        nll = -logp.gather(-1, x[0, 1:, None])[p - 1:, 0]
        out.append(math.exp(nll.mean().item()))
    return out


def model_samples(args) -> list[dict]:
    llm = LLM(args.model, device="cpu", dtype="float32", progress=False)
    out = []
    for i, p in enumerate(PROMPTS):
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed + i, ignore_eos=args.ignore_eos, **penalties(args))
        r = llm.generate(p, sp, spec="off")
        out.append({"prompt": p, "text": r.text, "ids": r.token_ids, "finish": r.finish_reason})
    llm.close()
    return out


def penalties(args) -> dict[str, float]:
    return {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty}


def natural_samples(args) -> list[dict]:
    """Real code: held-out definitions, each followed by the next max_tokens tokens of its file."""
    import random

    from tokenizers import Tokenizer

    from specfire.api import BUNDLED_MODEL
    from specfire.train.corpus import held_out_sources
    from specfire.train.unlikelihood import definition_starts

    tok = Tokenizer.from_file(os.path.join(args.model or BUNDLED_MODEL, "tokenizer.json"))
    src = held_out_sources()
    starts = definition_starts(src["packages"] + src["stdlib"])
    random.Random(args.seed).shuffle(starts)
    out = []
    for text, a, b in starts[:args.natural]:
        ids = tok.encode(text[b:b + 40 * args.max_tokens], add_special_tokens=False).ids[:args.max_tokens]
        out.append({"prompt": text[a:b], "text": tok.decode(ids), "ids": ids, "finish": "length"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=3, help="print this many completions")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the target's setting)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off (the target's setting)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="0: off (the target's setting)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off (the target's setting)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="write all --max-tokens tokens even past the end-of-text token (default: stop there, "
                         "as `specfire run` does)")
    ap.add_argument("--ref-model", default=None,
                    help="junk guard: score each completion's perplexity under this checkpoint")
    ap.add_argument("--junk-ppl", type=float, default=40.0,
                    help="with --ref-model: a completion above this perplexity counts as fully repeated")
    ap.add_argument("--cut-block-end", action="store_true",
                    help="what a model that ENDS after the definition it completes would score: cut each completion "
                         "before its first non-indented line after the first (a new top-level statement, e.g. the "
                         "same `def` again) and count it as ended there")
    ap.add_argument("--natural", type=int, default=0,
                    help="measure N real held-out definitions + their next tokens instead of the model (0: off)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    samples = natural_samples(args) if args.natural else model_samples(args)
    if args.cut_block_end:
        from tokenizers import Tokenizer

        from specfire.api import BUNDLED_MODEL

        tok = Tokenizer.from_file(os.path.join(args.model or BUNDLED_MODEL, "tokenizer.json"))
        samples = [cut_block_end(smp, tok) for smp in samples]
    refs = reference_ppl(args.ref_model, samples) if args.ref_model else [float("nan")] * len(samples)
    rows = []
    tot = {"lines": 0, "rep": 0, "rep_all": 0, "g_distinct": 0, "g_all": 0, "long": 0, "rep_long": 0,
           "g_lines": 0, "g_rep": 0, "p_lines": 0, "p_loops": 0, "names": 0, "names_used": 0}
    for smp, ref in zip(samples, refs):
        cut = smp["finish"] == "length"
        n, rep, rep_all = line_stats(smp["prompt"], smp["text"], cut=cut)
        gd, ga = distinct_4grams(smp["ids"])
        nl, rl = long_line_stats(smp["text"], cut)
        gn, gr = guarded(n, rep, ref > args.junk_ppl)     # nan (no reference) is never junk
        pn, pl = phrase_loop_lines(smp["text"], cut)
        nn, nu = prompt_names(smp["prompt"], smp["text"])
        for k, v in zip(tot, (n, rep, rep_all, gd, ga, nl, rl, gn, gr, pn, pl, nn, nu)):
            tot[k] += v
        rows.append({"prompt": smp["prompt"].split("\n")[0].strip(), "lines": n, "repeated": rep,
                     "repeated_with_prompt": rep_all, "long_lines": nl, "long_repeated": rl,
                     "distinct_4grams": gd / max(1, ga), "tokens": len(smp["ids"]), "finish": smp["finish"],
                     "ref_ppl": ref, "phrase_loop_lines": pl, "prompt_names": nn, "prompt_names_used": nu,
                     "text": smp["text"]})
    if not args.natural:
        print(f"{'prompt':<44} {'tokens':>6} {'finish':>6} {'lines':>5} {'rep':>4} {'rep+p':>5} {'long':>4} "
              f"{'rep':>4} {'4gram':>6} {'refppl':>6}")
        for r in rows:
            print(f"{r['prompt'][:44]:<44} {r['tokens']:>6} {r['finish']:>6} {r['lines']:>5} {r['repeated']:>4} "
                  f"{r['repeated_with_prompt']:>5} {r['long_lines']:>4} {r['long_repeated']:>4} "
                  f"{r['distinct_4grams']:>6.2f} {r['ref_ppl']:>6.1f}")
    summary = {"repeated_line_frac": tot["rep"] / max(1, tot["lines"]),
               "repeated_line_frac_with_prompt": tot["rep_all"] / max(1, tot["lines"]),
               "repeated_long_line_frac": tot["rep_long"] / max(1, tot["long"]),
               "repeated_line_frac_guarded": tot["g_rep"] / max(1, tot["g_lines"]),
               "phrase_loop_line_frac": tot["p_loops"] / max(1, tot["p_lines"]),
               "prompt_names_reused_frac": tot["names_used"] / max(1, tot["names"]),
               "junk_guard": args.ref_model, "junk_ppl": args.junk_ppl,
               "junk_completions": sum(r["ref_ppl"] > args.junk_ppl for r in rows),
               "distinct_4gram_frac": tot["g_distinct"] / max(1, tot["g_all"]), "lines": tot["lines"],
               "long_lines": tot["long"], "prompts_without_a_line": sum(r["lines"] == 0 for r in rows),
               "stopped_early": sum(r["finish"] == "stop" for r in rows)}
    what = f"{len(samples)} real held-out definitions" if args.natural else f"{len(PROMPTS)} completions"
    print(f"\nrepeated lines {100 * summary['repeated_line_frac']:.1f}% (counting prompt lines "
          f"{100 * summary['repeated_line_frac_with_prompt']:.1f}%; lines of >= 8 characters only "
          f"{100 * summary['repeated_long_line_frac']:.1f}% of {tot['long']}), distinct 4-grams "
          f"{100 * summary['distinct_4gram_frac']:.1f}%, over {tot['lines']} lines of {what}; "
          f"{summary['prompts_without_a_line']} wrote no complete line, {summary['stopped_early']} ended "
          f"(end-of-text) before --max-tokens; phrase-loop lines {100 * summary['phrase_loop_line_frac']:.1f}%; "
          f"prompt names reused {100 * summary['prompt_names_reused_frac']:.0f}% of {tot['names']}")
    guard = (f"; {summary['junk_completions']} over perplexity {args.junk_ppl:g} under {args.ref_model}"
             if args.ref_model else " (no --ref-model: no junk guard)")
    print(f"guarded: {100 * summary['repeated_line_frac_guarded']:.1f}% (a completion of < 2 lines counts as 2 "
          f"repeated lines{guard})")
    for smp in samples[:args.show]:
        print("\n" + "-" * 60 + "\n" + smp["prompt"] + "\u2502" + smp["text"])
    print(json.dumps({"bench": "bundled_loops", "model": args.model or "bundled", "natural": args.natural,
                      "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                      "ignore_eos": args.ignore_eos, **penalties(args), "prompts": len(samples), **summary,
                      "per_prompt": [] if args.natural else [{k: v for k, v in r.items() if k != "text"}
                                                            for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
