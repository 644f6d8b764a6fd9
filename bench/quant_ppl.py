"""Quality cost of 4-bit quantization, on the CPU: perplexity and MTP acceptance.

Quantizes a checkpoint with `specfire quantize` for several group sizes (with and without the
Hadamard rotation) and scores the same token windows with every variant (teacher forcing,
windows of --window tokens, each scored from an empty context). With --accept-prompts N it also
runs greedy MTP decoding (k = --k) on N held-out prompts with the unquantized and every 4-bit
variant and reports mean_accept_len (tokens committed per verify cycle) beside the perplexity.

Sources of text:
  --bundled      the bundled model on its held-out text (never trained on: --source packages,
                 the held-out site-packages distributions, or stdlib, the held-out stdlib
                 modules; specfire/train/corpus.py), prompts as in bench/bundled_accept.py
  --model/--text any checkpoint and text file
  (neither)      a tiny random checkpoint (bench/common.py) on a sequence it sampled itself

    python -m bench.quant_ppl --bundled [--tokens 16384] [--accept-prompts 10]
Prints a table and one JSON line last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from bench.common import held_out_prompts, model_config, write_checkpoint
from specfire import LLM, SamplingParams
from specfire.params import SpecPolicy
from specfire.quantize import quantize_checkpoint


def nll_windows(llm: LLM, windows: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of every next token in every window, and the count."""
    total, count = 0.0, 0
    for ids in windows:
        logits = llm.score(ids)
        lp = torch.log_softmax(logits[:-1].float(), -1)
        total += float(-lp.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return total, count


def accept(llm: LLM, prompts: list[str], max_tokens: int, k: int) -> dict:
    """Greedy MTP vs AR on the prompts: mean_accept_len and whether MTP output == AR output."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    cycles = accepted = 0
    same = True
    for p in prompts:
        ar = llm.generate(p, sp, spec="off")
        r = llm.generate(p, sp, spec=SpecPolicy(mode="mtp", k=k))
        same &= ar.token_ids == r.token_ids
        cycles += r.stats["cycles"]
        accepted += r.stats["accepted"]
    return {"mean_accept_len": 1 + accepted / max(cycles, 1), "cycles": cycles, "mtp_equals_ar": same}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundled", action="store_true", help="the bundled model on its held-out text")
    ap.add_argument("--source", default="packages", choices=("packages", "stdlib"),
                    help="held-out text of the bundled model")
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens scored per variant (in windows)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--no-hadamard", action="store_true", help="skip the rotated variants")
    ap.add_argument("--accept-prompts", type=int, default=0, help="held-out prompts for MTP acceptance")
    ap.add_argument("--accept-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gates", action="store_true", help="quantize the GDN gate projections in_proj_a / in_proj_b "
                    "as well (`specfire quantize --gates`)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp()
    prompts: list[str] = []
    if args.bundled:
        from specfire.api import BUNDLED_MODEL
        from specfire.train.corpus import held_out_sources
        src = BUNDLED_MODEL
        texts = [t for _, t in held_out_sources()[args.source]]
        if args.accept_prompts:
            prompts = [p for _, p in held_out_prompts(args.accept_prompts, 24, args.source)]
        name = f"bundled (held-out {args.source} files)"
    elif args.model is None:
        src = write_checkpoint(os.path.join(root, "src"), model_config("tiny", hidden_size=128, intermediate_size=256),
                               torch.float32, "cpu", seed=5)
        texts = None
        name = "tiny-random(h128,i256,v512)"
    else:
        src = args.model
        texts = [open(args.text, encoding="utf-8").read()] if args.text else None
        name = args.model
    with LLM(src, device="cpu", dtype="float32", spec="auto", progress=False) as llm:
        if texts is not None:
            ids: list[int] = []
            for t in texts:  # files concatenated in corpus order, cut into windows
                ids += llm.tokenizer.encode(t)
                if len(ids) >= args.tokens:
                    break
            ids = ids[:args.tokens]
        else:
            ids = llm.generate([1, 2, 3], SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0)).token_ids
            ids = [1, 2, 3] + ids
        windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window) if len(ids[i:i + args.window]) > 1]
        t0 = time.time()
        nll, cnt = nll_windows(llm, windows)
        base = math.exp(nll / cnt)
        acc0 = accept(llm, prompts, args.accept_tokens, args.k) if prompts and llm.mtp_loaded else None
        print(f"# unquantized scored in {time.time() - t0:.0f} s", file=sys.stderr)
    rows = [{"variant": "unquantized (bf16 weights)", "ppl": base, "change": 0.0, "bits_per_weight": 16.0,
             **({"accept": acc0} if acc0 else {})}]
    print(f"{'variant':<28} {'bits/w':>6} {'ppl':>9} {'change':>8} {'accept_len':>10} {'mtp==ar':>7}")

    def show(r):
        a = r.get("accept")
        print(f"{r['variant']:<28} {r['bits_per_weight']:6.3f} {r['ppl']:9.4f} {r['change']:+8.2%} "
              f"{(a['mean_accept_len'] if a else float('nan')):10.3f} {str(a['mtp_equals_ar']) if a else '-':>7}")

    show(rows[0])
    for g in (int(x) for x in args.groups.split(",")):
        for had in ((False,) if args.no_hadamard else (False, True)):
            dst = os.path.join(root, f"q{g}{'h' if had else ''}")
            summary = quantize_checkpoint(src, dst, group=g, hadamard=had, device="cpu", gates=args.gates)
            with LLM(dst, device="cpu", dtype="float32", spec="auto", progress=False) as llm:
                nll, cnt = nll_windows(llm, windows)
                p = math.exp(nll / cnt)
                acc = accept(llm, prompts, args.accept_tokens, args.k) if prompts and llm.mtp_loaded else None
            r = {"variant": f"q4 g{g}{' hadamard' if had else ''}", "ppl": p, "change": p / base - 1,
                 "bits_per_weight": 4 + 32 / g, "mean_weight_rel_error": summary["mean_weight_rel_error"],
                 "tensors_quantized": summary["tensors_quantized"], **({"accept": acc} if acc else {})}
            rows.append(r)
            show(r)
    print(json.dumps({"model": name, "tokens": cnt, "windows": len(windows), "window": args.window,
                      "accept_prompts": len(prompts), "accept_tokens": args.accept_tokens, "k": args.k,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
