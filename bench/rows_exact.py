"""End-to-end exactness on the GPU with the rows kernels: a tiny random model (tests/tinymodels.py),
bf16 weights, greedy MTP (k = 3) vs AR for each KV kind. Reports whether the token streams match;
a mismatch can come from any op that is not row-invariant, not only attention or Gated DeltaNet.

    python bench/rows_exact.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> int:
    from tinymodels import make_checkpoint
    from specfire import LLM, SamplingParams, SpecPolicy
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(os.path.join(tmp, "m"), "mha", seed=5)
        prompt = [(7 * i + 3) % 250 for i in range(300)]
        sp = SamplingParams(max_tokens=64, temperature=0.0)
        for kv in ("bf16", "q8"):
            with LLM(path, device="cuda", dtype=torch.bfloat16, kv_dtype=kv, progress=False) as llm:
                ar = llm.generate(prompt, sp, spec=SpecPolicy(mode="off"))
                mtp = llm.generate(prompt, sp, spec=SpecPolicy(mode="mtp", k=3))
                first = next((i for i, (a, b) in enumerate(zip(ar.token_ids, mtp.token_ids)) if a != b), None)
                res[kv] = dict(equal=ar.token_ids == mtp.token_ids, first_diff=first, n=len(ar.token_ids),
                               mean_accept_len=mtp.stats.get("mean_accept_len"))
                print(kv, res[kv])
    print(json.dumps(dict(bench="rows_exact", results=res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
