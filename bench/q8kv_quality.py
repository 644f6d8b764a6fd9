"""What the Q8 KV cache costs in quality on the bundled model: teacher-forced NLL per token and
the logits' relative error against the unquantized cache, for the cache's format (one scale per
position and KV head) and the grouped format (one scale per 32 elements), on held-out text.

    python bench/q8kv_quality.py --windows 4 --len 1024
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from specfire import LLM
from specfire.kernels import attention as A
from specfire.train.corpus import held_out_sources


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--len", type=int, default=1024)
    a = ap.parse_args()
    token_group = A.q8_group
    rows = {}
    for name, kv, group in (("unquantized", "auto", None), ("q8 per token", "q8", None), ("q8 group 32", "q8", 32)):
        A.q8_group = (lambda d, g=None, _grp=group: token_group(d, g if g is not None else _grp))
        try:
            with LLM(device="cpu", kv_dtype=kv, max_seq_len=a.len + 8, progress=False) as llm:
                texts = [t for docs in held_out_sources().values() for _, t in docs]
                ids = [i for t in texts for i in llm.tokenizer.encode(t)]
                wins = [ids[i * a.len:(i + 1) * a.len] for i in range(a.windows)]
                logits = [llm.score(w) for w in wins]
        finally:
            A.q8_group = token_group
        nll = sum(float(torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(w[1:]), reduction="sum"))
                  for lg, w in zip(logits, wins)) / sum(len(w) - 1 for w in wins)
        rows[name] = dict(nll=nll, ppl=math.exp(nll), logits=logits)
    base = rows["unquantized"]["logits"]
    out = {}
    for name, r in rows.items():
        err = max(float((lg - b).norm() / b.norm()) for lg, b in zip(r["logits"], base))
        top1 = sum(int((lg.argmax(-1) == b.argmax(-1)).sum()) for lg, b in zip(r["logits"], base)) / sum(
            b.shape[0] for b in base)
        out[name] = dict(ppl=round(r["ppl"], 4), ppl_vs_unquantized=round(r["ppl"] / rows["unquantized"]["ppl"] - 1, 5),
                         max_logits_rel_err=err, top1_agreement=top1)
        print(f"{name:14} ppl {r['ppl']:.4f} ({100 * out[name]['ppl_vs_unquantized']:+.3f}%)  "
              f"logits rel err {err:.2e}  top-1 agreement {100 * top1:.2f}%")
    print(json.dumps(dict(bench="q8kv_quality", windows=a.windows, len=a.len, results=out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
