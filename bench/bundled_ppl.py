"""Held-out perplexity of several checkpoints on the SAME text, whatever their tokenizers.

Text: the held-out packages of the bundled model's corpus (specfire/train/corpus.py
HELD_OUT_PACKAGES, whole distributions never trained on, as installed in this interpreter) and the
held-out standard-library modules (HELD_OUT). Each model tokenizes the text with its own tokenizer
(files joined by its end-of-text token) and scores every token after the first exactly once
(windows of --seq-len tokens overlapping by one token). Since the models cut the text into
different tokens, the comparable figures are the total negative log-likelihood of the text: per
byte, and as a perplexity over the FIRST model's token count (for the first model this is its own
perplexity). Also reports the MTP chained-agreement acceptance proxy on full windows.

    python -m bench.bundled_ppl --models OLD_DIR,NEW_DIR [--device cuda] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from specfire.api import BUNDLED_MODEL
from specfire.train.corpus import held_out_sources
from specfire.train.evaluate import evaluate, token_stream, total_nll, windows
from specfire.train.export import load_checkpoint


def load(path: str, device: torch.device):
    from tokenizers import Tokenizer

    _, trunk, head = load_checkpoint(path, device)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    return trunk.eval(), head.eval(), tok, eot


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bundled", help="comma-separated checkpoint dirs ('bundled': the shipped one); "
                                                         "the first is the reference for the token-normalised perplexity")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-bytes", type=int, default=0, help="cap each held-out set at whole files totalling this (0: all)")
    ap.add_argument("--accept-windows", type=int, default=64, help="windows for the MTP acceptance proxy (0: skip)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sets = held_out_sources()
    if args.max_bytes:
        for k, docs in sets.items():
            keep, n = [], 0
            for rel, t in docs:
                if n + len(t.encode()) > args.max_bytes and keep:
                    break
                keep.append((rel, t))
                n += len(t.encode())
            sets[k] = keep
    nbytes = {k: sum(len(t.encode()) for _, t in d) for k, d in sets.items()}
    pkgs = sorted({r.split("/")[0] for r, _ in sets["packages"]})
    print(f"held-out text: packages {pkgs} {len(sets['packages'])} files {nbytes['packages'] / 1e6:.2f} MB; "
          f"stdlib modules {len(sets['stdlib'])} files {nbytes['stdlib'] / 1e6:.2f} MB")
    paths = [BUNDLED_MODEL if m == "bundled" else m for m in args.models.split(",")]
    results = []
    ref_tokens: dict[str, int] = {}
    for path in paths:
        t0 = time.time()
        trunk, head, tok, eot = load(path, device)
        row = {"model": path, "params": sum(p.numel() for p in trunk.parameters()), "vocab": trunk.cfg.vocab_size}
        for name, docs in sets.items():
            if not docs:
                continue
            ids = token_stream(tok, eot, docs)
            nll, _ = total_nll(trunk, ids, args.seq_len, device, args.batch)
            ref_tokens.setdefault(name, ids.numel() - 1)
            r = {"tokens": ids.numel(), "bytes": nbytes[name], "bytes_per_token": nbytes[name] / ids.numel(),
                 "nats_per_token": nll / (ids.numel() - 1), "ppl": math.exp(nll / (ids.numel() - 1)),
                 "bits_per_byte": nll / nbytes[name] / math.log(2),
                 "ppl_ref_tokens": math.exp(nll / ref_tokens[name])}
            if args.accept_windows and ids.numel() > args.seq_len:
                ev = evaluate(trunk, head, windows(ids, args.seq_len, args.accept_windows, spread=True), 3, device,
                              device.type == "cuda", batch=args.batch)
                r.update({k: ev[k] for k in ("mtp_chain1", "mtp_chain2", "mtp_chain3", "expected_accept_len")})
            row[name] = r
        row["seconds"] = time.time() - t0
        results.append(row)
        del trunk, head
    print(f"{'model':<40} {'set':<9} {'tokens':>8} {'B/tok':>6} {'ppl(own)':>9} {'ppl(ref tok)':>12} {'bits/B':>7} {'E[acc]@3':>8}")
    for row in results:
        for name in sets:
            if name in row:
                r = row[name]
                print(f"{os.path.basename(row['model'].rstrip('/')) or row['model']:<40} {name:<9} {r['tokens']:>8} "
                      f"{r['bytes_per_token']:>6.2f} {r['ppl']:>9.2f} {r['ppl_ref_tokens']:>12.2f} "
                      f"{r['bits_per_byte']:>7.4f} {r.get('expected_accept_len', float('nan')):>8.3f}")
    if len(results) > 1:
        for name in sets:
            if name in results[0] and name in results[-1]:
                a, b = results[0][name]["ppl_ref_tokens"], results[-1][name]["ppl_ref_tokens"]
                print(f"{name}: last model's perplexity (reference tokens) is {100 * (1 - b / a):.1f}% below the first's")
    out = {"bench": "bundled_ppl", "device": args.device, "seq_len": args.seq_len, "packages": pkgs,
           "bytes": nbytes, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
