"""How close specfire's greedy choices are to a float32 reference, beside transformers' bf16.

Random weights make near-ties common, so "tokens equal until the first difference" between two
bf16 engines says little on its own. This bench asks a sharper question at every generated
position: is the engine's token the float32 reference's argmax, and if not, by how much does the
reference prefer its own (the logit gap)? The reference is transformers in float32 on the same
bf16 weights, teacher-forced on each engine's own sequence, so one early flip does not hide the
rest. A real shape's widths with fewer layers (all kernels, every layer kind) keeps it to a minute.

    python bench/accuracy.py --shape 27B --layers 8 --prompt 256 --tokens 64
    python bench/accuracy.py --shape tiny            # CPU smoke
    python bench/accuracy.py --shape mid --logits    # CPU: logits error vs float32, prefill and decode

`--logits` adds teacher-forced logits on one random sequence (prefill of every position, and decode
one token at a time after half of it) for specfire and transformers in bf16, as relative error /
largest error / argmax agreement against transformers in float32.
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


MID = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
           num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=False)


@torch.no_grad()
def hf_decode(model, ids: list[int], p: int, dev: str) -> torch.Tensor:
    """Logits of positions p..T-1, each from a one-token step on the cache of what precedes it."""
    o = model(torch.tensor([ids[:p]], device=dev), use_cache=True)
    cache, out = o.past_key_values, []
    for t in range(p, len(ids)):
        o = model(torch.tensor([[ids[t]]], device=dev), past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        out.append(o.logits[0, -1].float())
    return torch.stack(out)


def sf_decode(llm, ids: list[int], p: int) -> torch.Tensor:
    """The same through the engine's trunk: prefill, then one verify row and its commit a token."""
    tr = llm.engine.trunk
    tr.begin()
    tr.prefill(torch.tensor(ids[:p], device=tr.device))
    out = []
    for t in range(p, len(ids)):
        out.append(tr.verify(torch.tensor([ids[t]], device=tr.device), t).logits[0])
        tr.commit(0)
    return torch.stack(out)


def logit_error(x: torch.Tensor, ref: torch.Tensor) -> dict:
    x, ref = x.float().to(ref.device), ref.float()
    return {"rel_err": round(((x - ref).norm() / ref.norm()).item(), 5), "max_err": round((x - ref).abs().max().item(), 4),
            "argmax_agree": round((x.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)}


def logits_stage(path: str, vocab: int, n: int, dev: str, rep: dict) -> None:
    from specfire import LLM
    ids = torch.randint(2, vocab - 1, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    p = n // 2
    ref = hf_model(path, torch.float32, dev)
    r_all = hf_logits(ref, ids, dev)
    r_dec = r_all[p:]
    out = {"ref decode vs ref prefill": logit_error(hf_decode(ref, ids, p, dev), r_dec)}
    del ref
    hf16 = hf_model(path, torch.bfloat16, dev)
    out["transformers bf16 prefill"] = logit_error(hf_logits(hf16, ids, dev), r_all)
    out["transformers bf16 decode"] = logit_error(hf_decode(hf16, ids, p, dev), r_dec)
    del hf16
    with LLM(path, device=dev, dtype="bfloat16") as llm:
        out["specfire bf16 prefill"] = logit_error(llm.score(ids), r_all)
        out["specfire bf16 decode"] = logit_error(sf_decode(llm, ids, p), r_dec)
    rep["logits"] = out
    for k, v in out.items():
        print(json.dumps({"logits": k, **v}), flush=True)


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
    ap.add_argument("--logits", action="store_true", help="also the teacher-forced logits errors")
    ap.add_argument("--seq", type=int, default=200, help="--logits: sequence length (decode the second half)")
    args = ap.parse_args()
    from common import cfg_for, make_prompts
    from decode import build
    from synthetic import random_head

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.train.export import export_checkpoint

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shape == "mid":
        from decode import SHAPES
        SHAPES.setdefault("mid", MID)
        cfg = dataclasses.replace(cfg_for("mid"), vocab_size=4096, head_dim=64, linear_key_head_dim=64,
                                  linear_value_head_dim=64)
    else:
        cfg = cfg_for(args.shape)
    if args.shape not in ("tiny", "mid"):
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
    if args.logits:
        logits_stage(path, cfg.vocab_size, args.seq, dev, rep)
    seqs: dict[str, list[list[int]]] = {}
    # candidates: greedy sequences from each engine / mode
    hf16 = hf_model(path, torch.bfloat16, dev)
    seqs["transformers bf16"] = [hf_greedy(hf16, p, args.tokens, dev) for p in prompts]
    del hf16
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    modes = [("specfire bf16 (default kernels)", "off"), ("specfire bf16 MTP k=3", "mtp")]
    for name, spec in modes:
        with LLM(path, device=dev, dtype="bfloat16") as llm:
            llm.generate(prompts[0][:64], SamplingParams(max_tokens=8), spec=SpecPolicy(mode=spec, k=3))
            seqs[name] = [llm.generate(p, sp, spec=SpecPolicy(mode=spec, k=3)).token_ids for p in prompts]
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
