"""CPU decode speed on one device and on a gloo mesh (tp = 1, 2), and whether greedy output is identical.

    python -m bench.tp_cpu [--model bundled|PATH] [--tokens 64] [--tp 1 2] [--threads 1] [--tp-invariant]

Without --model: random weights of a small Qwen3.5 shape (bench/common.py; no draft is ever
accepted); `--model bundled` takes the bundled trained model and a text prompt. Greedy, float32.
Tokens are identical across tp by design only with --tp-invariant (tp 1 then computes the mesh's
bits; without it tp 1 runs its faster plain products). Prints a table and one JSON line last."""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from bench.common import model_config, write_checkpoint
from specfire import LLM, SamplingParams, SpecPolicy

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="'bundled' or a checkpoint path (default: random weights)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for tp=1 (default: torch's); a mesh gives each rank cores // tp")
    ap.add_argument("--tp-invariant", action="store_true", help="load every degree with LLM(tp_invariant=True)")
    args = ap.parse_args()

    if args.model is None:
        path = write_checkpoint(os.path.join(tempfile.mkdtemp(prefix="tpbench-"), "m"), model_config("tiny", **SHAPE),
                                torch.float32, "cpu", seed=3)
        ids = torch.randint(0, SHAPE["vocab_size"] - 1, (48,), generator=torch.Generator().manual_seed(0)).tolist()
        ids = ids + ids[:24]
    else:
        path = None if args.model == "bundled" else args.model
        ids = "Once upon a time there was a little robot who"
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rows, tokens = [], {}
    for tp in args.tp:
        if tp == 1 and args.threads is not None:
            torch.set_num_threads(args.threads)
        with LLM(path, tp=tp, progress=False, tp_invariant=args.tp_invariant) as llm:
            llm.generate(ids, SamplingParams(max_tokens=4), spec="off")        # warm-up
            for route in ("off", "mtp", "ngram"):
                res = llm.generate(ids, sp, spec=SpecPolicy(route, k=3))
                tokens.setdefault(route, {})[tp] = res.token_ids
                rows.append(dict(tp=tp, route=res.stats["route"], decode_tok_s=res.stats["decode_tok_s"],
                                 mean_accept_len=res.stats["mean_accept_len"],
                                 threads=torch.get_num_threads()))
    same = {r: len(set(map(tuple, v.values()))) == 1 for r, v in tokens.items()}
    print(f"{'tp':>3} {'route':>6} {'decode tok/s':>13} {'accept len':>10} {'threads':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['route']:>6} {r['decode_tok_s']:>13.1f} {r['mean_accept_len']:>10.2f} {r['threads']:>7}")
    print(f"greedy tokens identical across tp: {same}")
    print(json.dumps({"model": args.model or SHAPE, "tokens": args.tokens, "rows": rows, "identical": same,
                      "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
