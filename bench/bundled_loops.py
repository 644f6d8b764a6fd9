"""Does the bundled model loop? Greedy completions of short function / class prompts.

The prompts below were written for this check (none is taken from the standard library or from
the training corpus). For each, greedy AR decoding writes up to --max-tokens tokens (stopping at
the end-of-text token, as `specfire run` does, unless --ignore-eos); the figures are:
- repeated lines: the share of the completion's complete, non-blank lines whose stripped text
  equals an earlier non-blank line of the completion (the loop symptom); `with prompt` also counts
  a repeat of a prompt line;
- distinct 4-grams: distinct token 4-grams / all token 4-grams of the completion.

    PYTHONPATH=. python bench/bundled_loops.py [--model DIR] [--max-tokens 160] [--show 3] [--temperature T]
Prints a per-prompt table, sample completions, and one JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specfire.api import LLM                         # noqa: E402
from specfire.config import SamplingParams           # noqa: E402

PROMPTS = (
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


def distinct_4grams(ids: list[int]) -> tuple[int, int]:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)), len(grams)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=3, help="print this many completions")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the target's setting)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="write all --max-tokens tokens even past the end-of-text token (default: stop there, "
                         "as `specfire run` does)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype="float32", progress=False)
    rows = []
    tot = {"lines": 0, "rep": 0, "rep_all": 0, "g_distinct": 0, "g_all": 0}
    for i, p in enumerate(PROMPTS):
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed + i, ignore_eos=args.ignore_eos)
        r = llm.generate(p, sp, spec="off")
        n, rep, rep_all = line_stats(p, r.text, cut=r.finish_reason == "length")
        gd, ga = distinct_4grams(r.token_ids)
        for k, v in zip(tot, (n, rep, rep_all, gd, ga)):
            tot[k] += v
        rows.append({"prompt": p.split("\n")[0], "lines": n, "repeated": rep, "repeated_with_prompt": rep_all,
                     "distinct_4grams": gd / max(1, ga), "tokens": len(r.token_ids),
                     "finish": r.finish_reason, "text": r.text})
    llm.close()
    print(f"{'prompt':<44} {'tokens':>6} {'finish':>6} {'lines':>5} {'rep':>4} {'rep+p':>5} {'4gram':>6}")
    for r in rows:
        print(f"{r['prompt'][:44]:<44} {r['tokens']:>6} {r['finish']:>6} {r['lines']:>5} {r['repeated']:>4} "
              f"{r['repeated_with_prompt']:>5} {r['distinct_4grams']:>6.2f}")
    summary = {"repeated_line_frac": tot["rep"] / max(1, tot["lines"]),
               "repeated_line_frac_with_prompt": tot["rep_all"] / max(1, tot["lines"]),
               "distinct_4gram_frac": tot["g_distinct"] / max(1, tot["g_all"]), "lines": tot["lines"]}
    print(f"\nrepeated lines {100 * summary['repeated_line_frac']:.1f}% (counting prompt lines "
          f"{100 * summary['repeated_line_frac_with_prompt']:.1f}%), distinct 4-grams "
          f"{100 * summary['distinct_4gram_frac']:.1f}%, over {tot['lines']} lines of {len(PROMPTS)} completions")
    for r in rows[:args.show]:
        print("\n" + "-" * 60 + "\n" + PROMPTS[rows.index(r)] + "\u2502" + r["text"])
    print(json.dumps({"bench": "bundled_loops", "model": args.model or "bundled", "max_tokens": args.max_tokens,
                      "temperature": args.temperature, "top_p": args.top_p, "ignore_eos": args.ignore_eos, "prompts": len(PROMPTS), **summary,
                      "per_prompt": [{k: v for k, v in r.items() if k != "text"} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
