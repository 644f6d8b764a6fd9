"""Random-weight checkpoints for the peer benchmark, in the HF Qwen3.5 text layout with an MTP head.

Two directories per shape, sharing the weight shards:
  peers_<shape>       normal random weights (bench/decode.py `build`, head drawn the same way):
                      logits do not tie, so engines' greedy tokens can be compared.
  peers_<shape>_tied  symbolic links to the same shards, except `model-norms.safetensors`, whose
                      trunk and MTP final norms are -1 (the norms are zero-centred): every logit
                      is 0, greedy picks token 0 and every MTP draft is accepted (best case).
The two final norms live in their own shard so the second variant costs no second copy of the
weights (a 27B-shape checkpoint is ~54 GB). A word-level tokenizer.json with one token per id is
written too (ExLlamaV3's generator needs a tokenizer; prompts are token ids everywhere).

    python bench/peers/make_ckpt.py --shape 4B --root /dev/shm
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch

from common import NORM_KEYS, NORMS_FILE, cfg_for


def write_tokenizer(path: str, vocab: int) -> None:
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.save(os.path.join(path, "tokenizer.json"))


def make(shape: str, root: str, device: str, dtype: torch.dtype = torch.bfloat16,
         max_shard_bytes: int = 2 << 30, tokenizer: bool = True) -> dict:
    """Write peers_<shape> and peers_<shape>_tied under `root`; returns their paths and timings."""
    from decode import build
    from synthetic import random_head, shard_by_shard

    from specfire.train import export
    from specfire.train.export import export_checkpoint

    cfg = cfg_for(shape)
    normal = os.path.join(root, f"peers_{shape}")
    tied = normal + "_tied"
    for d in (normal, tied):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    trunk = build(cfg, device, dtype)
    head = random_head(cfg, device, dtype)
    norms: dict[str, torch.Tensor] = {}
    with shard_by_shard():                 # weights go to host memory one shard at a time
        inner = export.save_file

        def save(shard, fn, metadata=None):   # the two final norms go to their own shard
            for k in NORM_KEYS:
                if k in shard:
                    norms[k] = shard.pop(k).to("cpu").contiguous()
            inner(shard, fn, metadata=metadata)
        export.save_file = save
        export_checkpoint(trunk, head, normal, eos_ids=[cfg.vocab_size - 1], dtype=dtype,
                          max_shard_bytes=max_shard_bytes)
    del trunk, head
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    single = os.path.join(normal, "model.safetensors")
    if os.path.exists(single):       # with an index beside it, loaders must find the index first
        os.replace(single, os.path.join(normal, "model-00001-of-00001.safetensors"))
    from safetensors import safe_open
    from safetensors.torch import save_file
    if sorted(norms) != sorted(NORM_KEYS):
        raise RuntimeError(f"export wrote norms {sorted(norms)}, expected {NORM_KEYS}")
    save_file(norms, os.path.join(normal, NORMS_FILE), metadata={"format": "pt"})
    weight_map, total = {}, 0
    for fn in sorted(os.listdir(normal)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(normal, fn), "pt") as h:
                for k in h.keys():
                    weight_map[k] = fn
                    s = h.get_slice(k)
                    n = 1
                    for d in s.get_shape():
                        n *= d
                    total += n * dtype.itemsize
    with open(os.path.join(normal, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    if tokenizer:
        write_tokenizer(normal, cfg.vocab_size)
    t_normal = time.perf_counter() - t0
    os.makedirs(tied)
    for fn in os.listdir(normal):
        src = os.path.join(normal, fn)
        if fn == NORMS_FILE:
            save_file({k: torch.full_like(v, -1.0) for k, v in norms.items()}, os.path.join(tied, fn),
                      metadata={"format": "pt"})
        elif fn.endswith(".safetensors"):
            os.symlink(src, os.path.join(tied, fn))
        else:
            shutil.copy(src, os.path.join(tied, fn))
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
