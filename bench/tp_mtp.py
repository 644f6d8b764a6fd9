"""The MTP cycle on a 2-GPU mesh (the head's layer sharded over the ranks, parallel/mtp.py, vs
whole on rank 0) and 4-bit weights on the mesh: tp1 vs tp2 speed and the identity hashes.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=$PWD python bench/tp_mtp.py --shape 27B --jobs ckpt,cycle2 --budget-s 110 --out $OUT
    PYTHONPATH=$PWD python bench/tp_mtp.py --shape 27B --jobs q4ckpt,q4tp2,q4tp1 --budget-s 280 --out $OUT
    PYTHONPATH=$PWD python bench/tp_mtp.py --smoke       # every job on the CPU, tiny shapes

Jobs (the driver and helpers are bench/tp.py's: one process per job with a time limit, skipped
when the budget left is below its estimate; one JSON line per result in OUT/tp.jsonl):

  ckpt     bf16 random weights + MTP head, and the "tied" copy whose every draft is accepted
  q4ckpt   a 4-bit checkpoint of the shape in `specfire quantize`'s format (group 128, the
           projections `specfire quantize` rounds; random codes written directly: reading and
           rounding 54 GB would not fit the call), plus the bytes an AR step reads
  cycle2   tied bf16 on 2 ranks: AR step, MTP k=3 / k=1 cycle with the head sharded (the job sets
           SPECFIRE_TP_MTP=shard: the ranks load their shards) and k=3 with the head whole on rank 0 (the drafter
           before it), rows and draft graphs replayed alone
  q4tp1    (on a fresh machine the 4-bit kernels compile first: a 60 s limit was not enough)
           4-bit on one GPU: AR / MTP k=3 tok/s (default one-GPU mode), then AR / MTP k=3 hashes
           in the canonical mode (the bits a mesh computes)
  q4tp2    4-bit on 2 ranks: AR / MTP k=3 tok/s and hashes
  long     bf16 identity at a long context (--long): AR tp1 (canonical) vs AR / MTP k=3 tp2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tp import CEILING, Log, _time_graph, drive, job_ckpt, md5, smoke_shapes, step_bytes, write_safetensors  # noqa: E402

# job -> (estimated seconds, time limit seconds) on the GPU at the 27B shape
JOBS = {"ckpt": (55, 80), "q4ckpt": (16, 45), "cycle2": (45, 75), "q4tp1": (60, 120), "q4tp2": (60, 120),
        "long": (40, 120)}
GROUP = 128


def _generate(llm, ids, sp, spec):
    r = llm.generate(ids, sp, spec=spec)
    return r, r.stats["decode_s"] / max(1, r.stats.get("cycles") or len(r.token_ids))


# ---- 4-bit checkpoint ---------------------------------------------------------------------------------

def job_q4ckpt(cfg, d: str, device: str, log: Log) -> None:
    """d/q4: every tensor a random one (seeded); the projections `specfire quantize` rounds stored
    as 4-bit codes (uniform, so weights of std ~ K^-0.5), scales and zeros."""
    from concurrent.futures import ThreadPoolExecutor

    from specfire.model.qwen35 import MtpHead, Qwen35Trunk
    from specfire.kernels.q4 import pick_group, quant_config
    from specfire.quantize import _quantizable
    from specfire.train import export

    t0 = time.perf_counter()
    out = os.path.join(d, "q4")
    os.makedirs(out, exist_ok=True)
    with torch.device("meta"):
        trunk, head = Qwen35Trunk(cfg), MtpHead(cfg)
    g = torch.Generator(device=device).manual_seed(3)
    dt = torch.bfloat16
    shards, cur, size = [], {}, 0
    step = 0                                             # bytes an AR step reads (the embedding: one row)
    for prefix, mod in (("model.", trunk), ("mtp.", head)):
        for n, p in mod.named_parameters():
            name = n if n == "lm_head.weight" else prefix + n
            shape = tuple(p.shape)
            grp = pick_group(shape[1], GROUP) if len(shape) == 2 and _quantizable(name, shape, False) else None
            if grp is not None:
                rows, k = shape
                base = name[:-len("weight")]
                s = torch.full((rows, k // grp), k ** -0.5 / 4.6, dtype=dt, device=device)
                part = {base + "qweight": torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device=device,
                                                        generator=g),
                        base + "scales": s, base + "zeros": -7.5 * s}
            else:
                scale = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
                part = {name: torch.randn(shape, generator=g, device=device, dtype=dt) * scale}
            nb = sum(t.numel() * t.element_size() for t in part.values())
            if prefix == "model." and n != "embed_tokens.weight":
                step += nb
            cur.update(part)
            size += nb
            if size > 2 << 30:
                shards.append(cur)
                cur, size = {}, 0
    shards.append(cur)
    meta = {"format": "pt", "quantization_config": json.dumps(quant_config(GROUP, False))}
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(write_safetensors, sh, os.path.join(out, fn), meta) for sh, fn in zip(shards, files)]:
            f.result()
    wm = {k: fn for sh, fn in zip(shards, files) for k in sh}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    # config.json / generation_config.json as export_checkpoint writes them, plus the quantization
    c = dataclasses.replace(cfg, mtp_num_hidden_layers=1, eos_token_ids=(cfg.vocab_size - 1,))
    body = c.to_hf_text_dict()
    body.update(dtype="bfloat16", full_attention_interval=export._interval(c), attn_output_gate=True,
                pad_token_id=cfg.vocab_size - 1, quantization_config=quant_config(GROUP, False))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(body, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [cfg.vocab_size - 1], "pad_token_id": cfg.vocab_size - 1, "do_sample": False}, f)
    with open(os.path.join(d, "q4_step.json"), "w") as f:
        json.dump({"weights_per_step": step}, f)
    log("q4ckpt", files=len(files), weights_gb=sum(sum(t.numel() * t.element_size() for t in s.values())
                                                   for s in shards) / 1e9, step_weights_gb=step / 1e9,
        write_s=time.perf_counter() - t0)


def q4_step_bytes(cfg, d: str, tp: int, ctx: int) -> float:
    with open(os.path.join(d, "q4_step.json")) as f:
        w = json.load(f)["weights_per_step"]
    kv = cfg.n_full * 2 * ctx * cfg.num_key_value_heads * cfg.head_dim * 2
    st = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return (w + kv + st) / tp


# ---- the MTP cycle on 2 ranks -------------------------------------------------------------------------

def _draft_graph_ms(trunk, drafter, tp: int) -> dict:
    """Each captured greedy chain graph replayed 20 times, the peers replaying their side."""
    out = {}
    dg = drafter.graphs
    if dg is None or not torch.cuda.is_available():
        return out
    for key, gr in sorted(dg.graphs.items(), key=lambda kv: str(kv[0])):
        if key[2] not in (None, "after"):
            continue
        if tp > 1 and drafter.mesh is not None:
            trunk.draft_rounds(key[1], 0, 21, now=True, chain=(key[0], False, drafter.feed))
        elif tp > 1 and trunk.draft_sharded:
            trunk.draft_rounds(key[1], 0, 21, now=True)
        out["_".join(map(str, key))] = _time_graph(gr, 20) * 1e3
    return out


def job_cycle(cfg, path: str, tp: int, device: str, log: Log, prompt: int, tokens: int, shape: str) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.runtime.drafters import MtpDrafter
    from specfire.runtime.graphs import DraftGraphs

    os.environ.setdefault("SPECFIRE_TP_MTP", "shard")     # every rank loads its shard of the head (parallel/mtp.py)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(path, tp=tp, device=device, progress=False, max_seq_len=prompt + 2 * tokens + 64) as llm:
        trunk = llm.engine.trunk
        sharded = llm.engine.drafters["mtp"]
        row = dict(shape=shape, tp=tp, load_s=time.perf_counter() - t0, head_sharded=sharded.mesh is not None)
        emulate = device == "cpu"
        if emulate:                                       # smoke: the draft chain's graph flow, emulated
            sharded.graphs = DraftGraphs(sharded._chain_for, sharded.head.fc.weight.device, emulate=True)
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()
        llm.generate(ids, warm, spec="off")
        ar, ar_step = _generate(llm, ids, sp, "off")
        row.update(ar_tok_s=ar.stats["decode_tok_s"], ar_step_ms=ar_step * 1e3)
        nb = step_bytes(llm.cfg, tp, prompt + tokens // 2)
        row["ar_bw_frac"] = nb * ar.stats["decode_tok_s"] / CEILING
        whole = MtpDrafter(sharded.given_head, trunk, sharded.state.layers[0].k.dtype, mesh_head=False)
        if emulate:
            whole.graphs = DraftGraphs(whole._chain_for, whole.head.fc.weight.device, emulate=True)
        for name, d, ks in (("shard", sharded, (3, 1)), ("whole", whole, (3,))):
            llm.engine.drafters["mtp"] = d
            for k in ks:
                llm.generate(ids, warm, spec=SpecPolicy("mtp", k=k))
                r, cyc = _generate(llm, ids, sp, SpecPolicy("mtp", k=k))
                row[f"{name}_k{k}_tok_s"] = r.stats["decode_tok_s"]
                row[f"{name}_k{k}_tau"] = r.stats["mean_accept_len"]
                row[f"{name}_k{k}_cycle_ms"] = cyc * 1e3
                row[f"{name}_k{k}_cycle_vs_ar"] = cyc / ar_step
                row[f"{name}_k{k}_equals_ar"] = r.token_ids == ar.token_ids
            log("cycle", **row)
        llm.engine.drafters["mtp"] = sharded
        probe = dict(shape=shape, tp=tp)
        for rows in (1, 4):
            t = trunk.rank_time(rows, 20) if tp > 1 else [float("nan")]
            probe[f"replay_r{rows}_ms"] = [v * 1e3 for v in t]
        for name, d in (("shard", sharded), ("whole", whole)):
            probe[f"{name}_draft_graph_ms"] = _draft_graph_ms(trunk, d, tp)
            dg = probe[f"{name}_draft_graph_ms"].get("4_3_after")
            if dg is not None and probe["replay_r4_ms"]:
                probe[f"{name}_k3_gap_ms"] = row[f"{name}_k3_cycle_ms"] - max(probe["replay_r4_ms"]) - dg
        log("cycle_probe", **probe)


# ---- 4-bit: speed and identity ------------------------------------------------------------------------

def job_q4(cfg, d: str, tp: int, device: str, log: Log, prompt: int, tokens: int, shape: str) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.kernels import canonical

    path = os.path.join(d, "q4")
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    modes = [False, True] if tp == 1 else [True]        # tp1: its default mode for speed, canonical for bits
    for canon in modes:
        canonical.set_enabled(True if canon else None)
        t0 = time.perf_counter()
        with LLM(path, tp=tp, device=device, progress=False, max_seq_len=prompt + 2 * tokens + 64) as llm:
            g = torch.Generator().manual_seed(prompt)         # the same prompt in every run
            ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()
            row = dict(shape=shape, tp=tp, canonical=canon, weights="4-bit", load_s=time.perf_counter() - t0,
                       context=prompt, tokens=tokens)
            log("progress", job=f"q4tp{tp}", canonical=canon, loaded_s=time.perf_counter() - t0)
            llm.generate(ids, warm, spec="off")
            log("progress", job=f"q4tp{tp}", canonical=canon, warm_s=time.perf_counter() - t0)
            ar, ar_step = _generate(llm, ids, sp, "off")
            row.update(ar_tok_s=ar.stats["decode_tok_s"], ar_step_ms=ar_step * 1e3, ar_md5=md5(ar.token_ids),
                       distinct=len(set(ar.token_ids)))
            row["ar_bw_frac"] = q4_step_bytes(llm.cfg, d, tp, prompt + tokens // 2) * ar.stats["decode_tok_s"] / CEILING
            llm.generate(ids, warm, spec=SpecPolicy("mtp", k=3))
            r, cyc = _generate(llm, ids, sp, SpecPolicy("mtp", k=3))
            row.update(mtp3_tok_s=r.stats["decode_tok_s"], mtp3_cycle_vs_ar=cyc / ar_step, mtp3_md5=md5(r.token_ids),
                       mtp3_equals_ar=r.token_ids == ar.token_ids, mtp3_drafted=r.stats["drafted"],
                       mtp3_accepted=r.stats["accepted"])
            log("q4", **row)
    canonical.set_enabled(None)


def job_long(cfg, d: str, device: str, log: Log, ctx: int, tokens: int, shape: str, deadline: float) -> None:
    """tp1 (canonical) AR on GPU 0 first, then tp2 AR and MTP k=3: one hash at a long context."""
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.kernels import canonical

    path = os.path.join(d, "normal")
    canonical.set_enabled(True)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for tp in (2, 1):
        if time.monotonic() > deadline:
            log("skipped", job="long", tp=tp, why="time budget")
            continue
        with LLM(path, tp=tp, device=device, progress=False, max_seq_len=ctx + 2 * tokens + 64) as llm:
            g = torch.Generator().manual_seed(ctx)            # the same prompt on both degrees
            body = torch.randint(0, llm.cfg.vocab_size - 1, (ctx,), generator=g).tolist()
            row = dict(shape=shape, tp=tp, context=ctx, tokens=tokens)
            for name, spec in (("ar", "off"), ("mtp3", SpecPolicy("mtp", k=3))):
                if tp == 1 and name != "ar":
                    continue
                t1 = time.perf_counter()
                r = llm.generate(body, sp, spec=spec)
                row[name] = md5(r.token_ids)
                row[name + "_s"] = time.perf_counter() - t1
                if name != "ar":
                    row[name + "_accepted"] = r.stats["accepted"]
            log("long_identity", **row)
    canonical.set_enabled(None)


# ---- driver -------------------------------------------------------------------------------------------

def run_job(job: str, args) -> None:
    log = Log(args.out, job)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        global GROUP
        import decode
        smoke_shapes()
        decode.SHAPES["tiny"] = {**decode.SHAPES["tiny"], "intermediate_size": 128}   # tp2 shards on 32-column groups
        GROUP = 32
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    d = args.ckpt_dir
    t0 = time.perf_counter()
    if job == "ckpt":
        job_ckpt(cfg, d, device, log)
    elif job == "q4ckpt":
        job_q4ckpt(cfg, d, device, log)
    elif job == "cycle2":
        job_cycle(cfg, os.path.join(d, "tied"), 2, device, log, args.prompt, args.tokens, args.shape)
    elif job in ("q4tp1", "q4tp2"):
        job_q4(cfg, d, int(job[-1]), device, log, args.prompt, args.tokens, args.shape)
    elif job == "long":
        job_long(cfg, d, device, log, args.long, args.tokens, args.shape, time.monotonic() + args.job_limit_s - 30)
    else:
        raise SystemExit(f"unknown job {job!r}; jobs: {', '.join(JOBS)}")
    log("job_time", job=job, seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--long", type=int, default=33000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--jobs", default="ckpt+q4ckpt,cycle2,q4tp2,q4tp1,long",
                    help="groups in order (,); a+b: lanes at once, lane i on GPU i; a>b: one after another")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--job-limit-s", type=float, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.prompt, args.tokens, args.long = "tiny", min(args.prompt, 60), 8, min(args.long, 120)
    if args.job:
        run_job(args.job, args)
        return
    drive(args, JOBS, os.path.abspath(__file__), "tpmtp-")


if __name__ == "__main__":
    main()
