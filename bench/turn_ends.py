"""What a chat prompt's turn ends cost and save, on the CPU with the bundled model.

A chat prompt's prefill ends a forward at every earlier turn's prompt end (tokenizer.ChatIds,
runtime/prefix.py), so the next turn can resume there bit-exactly. This times, for a chat of
`--turns` turns at the default 1024-row piece: the cold prefill with those cuts against one cut at
piece multiples only (the extra forward per turn), the next turn's prefill resumed from the cache,
and computing the turn ends in `chat_ids` (one render and tokenization per earlier turn).

    python -m bench.turn_ends [--turns 2,8,16] [--words 60] [--reps 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specfire import LLM
from specfire.tokenizer import ChatIds

TEXT = ("the keeper of the lighthouse walked down to the shore every morning and wrote the tides into "
        "a book that nobody read while the gulls argued over the nets and the boats came home late").split()


def chat(turns: int, words: int) -> list[dict[str, str]]:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: " + " ".join(TEXT[(t + i) % len(TEXT)] for i in range(words))})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"Answer {t}: " + " ".join(TEXT[(3 * t + i) % len(TEXT)]
                                                                                      for i in range(words))})
    return msgs


def best(fns, reps: int) -> list[float]:
    """The fastest of `reps` runs of each of `fns`, taken in turn (a busy machine slows them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [min(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", default="2,8,16")
    ap.add_argument("--words", type=int, default=60, help="words per message")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    rows = []
    with LLM(device="cpu", progress=False, threads=a.threads, max_seq_len=16384) as llm:
        llm.enable_prefix_cache(1 << 30)
        trunk, cache = llm.engine.trunk, llm.engine.prefix
        for turns in map(int, a.turns.split(",")):
            msgs = chat(turns, a.words)
            ids = llm.chat_ids(msgs)
            prompt = torch.tensor(ids)

            def cold(ends: tuple[int, ...]) -> None:
                trunk.begin()
                trunk.prefill(prompt, ends=ends)
            cut, plain = best([lambda: cold(ids.ends), lambda: cold(())], a.reps)
            ends_s, = best([lambda: llm.chat_ids(msgs)], a.reps)
            prev = llm.chat_ids(msgs[:-2]) if turns > 1 else ChatIds()

            def resumed() -> None:
                cache.clear()
                if prev:
                    cache.prefill(prev, torch.tensor(prev), ends=prev.ends)
                t0 = time.perf_counter()
                cache.prefill(ids, prompt, ends=ids.ends)
                resumed.s = time.perf_counter() - t0
            warm = min((resumed(), resumed.s)[1] for _ in range(a.reps))
            n_cuts = len([e for e in ids.ends if e < len(ids) and e % trunk.piece])   # forwards added
            rows.append({"turns": turns, "prompt_tokens": len(ids), "turn_cuts": n_cuts,
                         "cold_cut_s": cut, "cold_plain_s": plain, "extra_s": cut - plain,
                         "extra_per_cut_ms": 1e3 * (cut - plain) / max(1, n_cuts),
                         "resumed_s": warm, "resumed_tokens": len(ids) - len(prev), "chat_ids_s": ends_s})
    print(f"{'turns':>5} {'tokens':>6} {'cuts':>4} {'cold cut s':>10} {'cold plain s':>12} {'extra ms/cut':>12} "
          f"{'resumed s':>9} {'chat_ids ms':>11}")
    for r in rows:
        print(f"{r['turns']:>5} {r['prompt_tokens']:>6} {r['turn_cuts']:>4} {r['cold_cut_s']:>10.3f} "
              f"{r['cold_plain_s']:>12.3f} {r['extra_per_cut_ms']:>12.1f} {r['resumed_s']:>9.3f} "
              f"{1e3 * r['chat_ids_s']:>11.1f}")
    print(json.dumps({"bench": "turn_ends", "threads": a.threads, "piece": 1024, "rows": rows}))


if __name__ == "__main__":
    main()
