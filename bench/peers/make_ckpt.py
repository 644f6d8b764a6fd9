"""Random-weight checkpoints for the peer benchmark, in the HF Qwen3.5 text layout with an MTP head.

Two directories per shape, sharing the weight shards:
  peers_<shape>       normal random weights (bench/common.py write_checkpoint, with an MTP head):
                      logits do not tie, so engines' greedy tokens can be compared.
  peers_<shape>_tied  symbolic links to the same shards, except `model-norms.safetensors`, whose
                      trunk and MTP final norms are -1 (the norms are zero-centred): every logit
                      is 0, greedy picks token 0 and every MTP draft is accepted (best case).
The two final norms live in their own shard so the second variant costs no second copy of the
weights (a 27B-shape checkpoint is ~54 GB). A word-level tokenizer.json with one token per id is
written too (ExLlamaV3's generator needs a tokenizer; prompts are token ids everywhere).

    python -m bench.peers.make_ckpt --shape 4B --root /dev/shm
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch

from bench.common import tied_copy, write_checkpoint, write_tokenizer
from bench.peers.common import cfg_for


def make(shape: str, root: str, device: str, dtype: torch.dtype = torch.bfloat16,
         max_shard_bytes: int = 2 << 30, tokenizer: bool = True) -> dict:
    """Write peers_<shape> and peers_<shape>_tied under `root`; returns their paths and timings."""
    cfg = cfg_for(shape)
    normal = os.path.join(root, f"peers_{shape}")
    tied = normal + "_tied"
    for d in (normal, tied):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    write_checkpoint(normal, cfg, dtype, device, shard_bytes=max_shard_bytes)
    if tokenizer:
        write_tokenizer(normal, cfg.vocab_size)
    t_normal = time.perf_counter() - t0
    tied_copy(normal, tied)
    total = sum(os.path.getsize(os.path.join(normal, f)) for f in os.listdir(normal) if f.endswith(".safetensors"))
    return {"shape": shape, "normal": normal, "tied": tied, "bytes": total, "dtype": str(dtype),
            "seconds": time.perf_counter() - t0, "normal_seconds": t_normal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4B")
    ap.add_argument("--root", default="/dev/shm")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    print(json.dumps(make(args.shape, args.root, dev, dtype)))


if __name__ == "__main__":
    main()
