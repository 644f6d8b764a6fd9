"""How close specfire's greedy choices are to a float32 reference, beside transformers' bf16.

Random weights make near-ties common, so "tokens equal until the first difference" between two
bf16 engines says little on its own. This bench asks a sharper question at every generated
position: is the engine's token the float32 reference's argmax, and if not, by how much does the
reference prefer its own (the logit gap)? The reference is transformers in float32 on the same
bf16 weights, teacher-forced on each engine's own sequence, so one early flip does not hide the
rest. A real shape's widths with fewer layers (all kernels, every layer kind) keeps it to a minute.

    python bench/accuracy.py --shape 27B --layers 8 --prompt 256 --tokens 64
    python bench/accuracy.py --shape tiny            # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))


def hf_model(path: str, dtype: torch.dtype, dev: str):
    from transformers import AutoModelForCausalLM
    kw = {"device_map": dev} if dev == "cuda" else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int, dev: str) -> list[int]:
    ids = torch.tensor([prompt], device=dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model, seq: list[int], dev: str) -> torch.Tensor:
    return model(torch.tensor([seq], device=dev)).logits[0].float()


def judge(ref: torch.Tensor, prompt_len: int, gen: list[int]) -> dict:
    """Per generated position t: ref logits row prompt_len-1+t scored the token gen[t]."""
    rows = ref[prompt_len - 1: prompt_len - 1 + len(gen)]
    tok = torch.tensor(gen, device=rows.device)
    best = rows.max(-1).values
    gap = best - rows.gather(1, tok[:, None])[:, 0]
    top2 = rows.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    agree = gap == 0
    first = next((i for i, a in enumerate(agree.tolist()) if not a), None)
    return {"argmax_agree": round(agree.float().mean().item(), 4), "first_miss": first,
            "max_gap": round(gap.max().item(), 4), "mean_gap": round(gap.mean().item(), 5),
            "median_ref_margin": round(margin.median().item(), 4),
            "logit_std": round(rows.std().item(), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--layers", type=int, default=8, help="layers kept (a multiple of 4: 3 GDN : 1 attention)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from common import cfg_for, make_prompts
    from decode import build
    from synthetic import random_head

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.ops import fusion
    from specfire.train.export import export_checkpoint

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = cfg_for(args.shape)
    if args.shape != "tiny":
        n = args.layers
        cfg = dataclasses.replace(cfg, num_hidden_layers=n, layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)))
    path = os.path.join(args.root, f"accuracy_{args.shape}")
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    trunk, head = build(cfg, dev, torch.bfloat16), random_head(cfg, dev, torch.bfloat16)
    export_checkpoint(trunk, head, path, eos_ids=[cfg.vocab_size - 1], dtype=torch.bfloat16,
                      max_shard_bytes=2 << 30)
    del trunk, head
    prompts = make_prompts(cfg.vocab_size, args.prompts, args.prompt)["prompts"]
    rep = {"bench": "accuracy", "shape": args.shape, "layers": cfg.num_hidden_layers,
           "vocab": cfg.vocab_size, "prompt": args.prompt, "tokens": args.tokens, "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else None,
           "write_s": round(time.perf_counter() - t0, 1), "engines": {}}
    seqs: dict[str, list[list[int]]] = {}
    # candidates: greedy sequences from each engine / mode
    hf16 = hf_model(path, torch.bfloat16, dev)
    seqs["transformers bf16"] = [hf_greedy(hf16, p, args.tokens, dev) for p in prompts]
    del hf16
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    modes = [("specfire bf16 (default kernels)", None, "off"), ("specfire bf16 MTP k=3", None, "mtp")]
    if dev == "cuda":
        modes.append(("specfire bf16 (fusion off)", False, "off"))
    for name, fuse, spec in modes:
        fusion.set_enabled(fuse)
        with LLM(path, device=dev, dtype="bfloat16") as llm:
            llm.generate(prompts[0][:64], SamplingParams(max_tokens=8), spec=SpecPolicy(mode=spec, k=3))
            seqs[name] = [llm.generate(p, sp, spec=SpecPolicy(mode=spec, k=3)).token_ids for p in prompts]
    fusion.set_enabled(None)
    with LLM(path, device=dev, dtype="float32") as llm:
        seqs["specfire float32"] = [llm.generate(p, sp, spec=SpecPolicy(mode="off")).token_ids for p in prompts]
    ref = hf_model(path, torch.float32, dev)
    seqs["transformers float32"] = [hf_greedy(ref, p, args.tokens, dev) for p in prompts]
    for name, gens in seqs.items():
        per = [judge(hf_logits(ref, p + g, dev), len(p), g) for p, g in zip(prompts, gens)]
        rep["engines"][name] = per
        print(json.dumps({"engine": name, "per_prompt": per}), flush=True)
    base = seqs["transformers float32"]
    rep["equal_prefix_vs_fp32_ref"] = {
        name: [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g)) for g, r in zip(gens, base)]
        for name, gens in seqs.items()}
    print(json.dumps(rep["equal_prefix_vs_fp32_ref"]))
    if args.out:
        with open(os.path.join(args.out, "accuracy.json"), "w") as f:
            json.dump(rep, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
