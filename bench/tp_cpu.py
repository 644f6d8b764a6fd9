"""CPU decode speed on one device and on a gloo mesh (tp = 1, 2), plus the cost of the MTP drafter's
calls through the mesh (embed / lm_logits) against a whole copy of the weights on rank 0.

    PYTHONPATH=$PWD python bench/tp_cpu.py [--model bundled|PATH] [--tokens 64] [--tp 1 2] [--threads 1]

Without --model: random weights of a small Qwen3.5 shape built by transformers (no draft is ever
accepted); `--model bundled` takes the bundled trained model and a text prompt. Greedy, float32.
Prints a table and one JSON line last."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="'bundled' or a checkpoint path (default: random weights)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for tp=1 (default: torch's); a mesh gives each rank cores // tp")
    args = ap.parse_args()

    from tinymodels import make_checkpoint

    from specfire import LLM, SamplingParams, SpecPolicy

    if args.model is None:
        path = make_checkpoint(os.path.join(tempfile.mkdtemp(prefix="tpbench-"), "m"), "base", seed=3, **SHAPE)
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
        with LLM(path, tp=tp, progress=False) as llm:
            llm.generate(ids, SamplingParams(max_tokens=4), spec="off")        # warm-up
            for route in ("off", "mtp", "ngram"):
                res = llm.generate(ids, sp, spec=SpecPolicy(route, k=3))
                tokens.setdefault(route, {})[tp] = res.token_ids
                rows.append(dict(tp=tp, route=res.stats["route"], decode_tok_s=res.stats["decode_tok_s"],
                                 mean_accept_len=res.stats["mean_accept_len"],
                                 threads=torch.get_num_threads()))
            # the MTP drafter's per-step calls: through the mesh vs a whole copy on rank 0
            trunk = llm.engine.trunk
            hidden, vocab = llm.cfg.hidden_size, llm.cfg.vocab_size
            g = torch.Generator().manual_seed(2)
            h = torch.randn(1, hidden, generator=g)
            one = torch.tensor([5])
            w = torch.randn(vocab, hidden, generator=g)
            t0 = time.perf_counter()
            lm = getattr(trunk, "mesh_lm_logits", trunk.lm_logits)
            emb = getattr(trunk, "mesh_embed", trunk.embed)
            for _ in range(args.calls):
                lm(h)
            t1 = time.perf_counter()
            for _ in range(args.calls):
                emb(one)
            t2 = time.perf_counter()
            for _ in range(args.calls):
                F.linear(h, w)
            t3 = time.perf_counter()
            rows[-1].update(lm_logits_us=(t1 - t0) / args.calls * 1e6, embed_us=(t2 - t1) / args.calls * 1e6,
                            local_full_lm_us=(t3 - t2) / args.calls * 1e6)
    same = {r: len(set(map(tuple, v.values()))) == 1 for r, v in tokens.items()}
    print(f"{'tp':>3} {'route':>6} {'decode tok/s':>13} {'accept len':>10} {'threads':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['route']:>6} {r['decode_tok_s']:>13.1f} {r['mean_accept_len']:>10.2f} {r['threads']:>7}")
    for r in rows:
        if "lm_logits_us" in r:
            print(f"tp={r['tp']}: drafter lm_logits {r['lm_logits_us']:.0f} us, embed {r['embed_us']:.0f} us "
                  f"(whole lm_head on rank 0: {r['local_full_lm_us']:.0f} us)")
    print(f"greedy tokens identical across tp: {same}")
    print(json.dumps({"model": args.model or SHAPE, "tokens": args.tokens, "rows": rows, "identical": same,
                      "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
