"""4-bit decode end to end on one GPU through LLM.generate: grouped vs ungrouped projections.

The 27B shape's projections (`specfire quantize`'s policy, specfire/quantize.py `_quantizable`: every
projection matrix, the MTP head's `fc` and the lm_head, not the GDN gate projections in_proj_a /
in_proj_b; before commit 5a14188 it also left the GDN in_proj_qkv / in_proj_z bf16, and so did the
first run of this script, which took the rule by name) are quantized on the GPU
from seeded random bf16 weights (kernels/q4 quantize_tensor, group 128, clip search), the rest
random bf16; the model and its MTP head are handed to `LLM` through the engine builder's trunk
factory (the weights are the only thing that does not come from a checkpoint), then:

1. kernels: the projections of one input as one grouped launch (kernels/q4/gemv.py q4_group)
   against one launch per weight, M = 1, 2, 4, 8, 16, and the single weights (down, o / out,
   lm_head), each checked first (grouped bits == each weight's own launch, every prefix M = 1..16
   == the 16-row call):
   time (CUDA-graph replay over rotating weight copies larger than L2) and bytes read / time as a
   fraction of 4.17 TB/s;
2. end to end, for grouped (the default) and ungrouped (SPECFIRE_GEMV_GROUP=0's path) projections:
   LLM.generate AR (spec off) and MTP k=3 over 512-token random prompts, 64 new tokens, greedy:
   AR tok/s with its fraction of 4.17 TB/s (= of the 4-bit ceiling, 4.17 TB/s / bytes per step),
   the MTP cycle (decode time / cycles) over the AR step, and greedy MTP == AR token for token;
   then (grouped) every draft accepted (final norms -1: all logits 0) for the cycle at full
   acceptance, and the AR step's device time by kernel (profiler over the 1-row CUDA graph).
Kernels are compiled first by worker processes running a 4-layer model of the same dimensions
through the same calls, while the main process quantizes. Results go to $OUT/quant_e2e.json after
every stage.

    python bench/quant_e2e.py [--shape 27B] [--budget 120] [--out DIR]
    BENCH_SMOKE=1 TRITON_INTERPRET=1 python bench/quant_e2e.py   # the logic on the CPU, tiny shape
    --gates4: the GDN gate projections in_proj_b / in_proj_a 4-bit too (`specfire quantize --gates`)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from specfire.kernels.gemv import kernel as triton_gemv  # noqa: E402
from specfire.kernels.q4 import QuantWeight, pick_group, quantize_tensor  # noqa: E402

PEAK = 4.17e12
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
DT = torch.float32 if SMOKE else torch.bfloat16
GROUP = 64 if SMOKE else 128
T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f} s] {msg}", flush=True)


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


# ---- the model ------------------------------------------------------------------------------

def model_cfg(shape: str, layers: int = 0):
    from decode import make_cfg
    from specfire.config import ModelConfig

    if SMOKE:
        cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                          layer_types=("linear_attention",) * 3 + ("full_attention",), tie_word_embeddings=False)
    else:
        cfg = make_cfg(shape)
    if layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
    return cfg


def quantized_weight(n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """Seeded random bf16 [n, k] (scale 1/sqrt(k)) quantized on the device, 16384 rows at a time
    (bounded temporary memory for the lm_head)."""
    g = pick_group(k, GROUP)
    parts = []
    for i in range(0, n, 16384):
        w = torch.randn(min(16384, n - i), k, generator=gen, device=DEV, dtype=DT) * k ** -0.5
        parts.append(quantize_tensor(w, g))
    q, s, z = (torch.cat(t) for t in zip(*parts))
    return QuantWeight.from_stored(q, s, z, False, DT, DEV)


GATES4 = False    # --gates4: the GDN gate projections in_proj_b / in_proj_a 4-bit too (`specfire quantize --gates`)


def build(module_cls, cfg, seed: int):
    """module_cls(cfg) on the device: projections 4-bit (quantized here), the rest random bf16.
    Returns (module, 4-bit bytes, dense bytes a decode step reads)."""
    from specfire.layers import Linear
    from specfire.quantize import _quantizable as policy

    def _quantizable(name, shape, keep):          # --gates4: what `specfire quantize --gates` writes
        return policy(name, shape, keep, gates=GATES4)

    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.device("meta"):
        m = module_cls(cfg)
    qbytes = 0
    for name, mod in list(m.named_modules()):
        if isinstance(mod, Linear) and _quantizable(name + ".weight", tuple(mod.weight.shape), False):
            n, k = mod.weight.shape
            if pick_group(k, GROUP) is None:
                continue
            del mod.weight
            mod.weight = quantized_weight(n, k, gen)
            qbytes += mod.weight.nbytes()
    m = m.to(DT).to_empty(device=DEV)
    dense = 0
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=DEV, dtype=DT) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
            if "embed_tokens" not in name:
                dense += p.numel() * p.element_size()
    return m, qbytes, dense


def write_config(cfg, path: str) -> None:
    """config.json + generation_config.json for `LLM` (the weights come from the factory below)."""
    body = cfg.to_hf_text_dict()
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    body.update(dtype="bfloat16" if DT == torch.bfloat16 else "float32", attn_output_gate=True,
                full_attention_interval=full[0] + 1 if full else 1, pad_token_id=cfg.vocab_size - 1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(body, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [cfg.vocab_size - 1]}, f)


def open_llm(path: str, trunk_model, head, max_seq: int):
    """LLM over the models in memory: the engine builder's one-device trunk factory is swapped for
    one that wraps them (everything from LLM.generate down is the product's code)."""
    from specfire import LLM
    from specfire.runtime import build as B
    from specfire.runtime.trunk import LocalTrunk

    def factory(opts):
        return B.BuiltTrunk(LocalTrunk(trunk_model, opts.max_seq_len, opts.kv_dtype, opts.cuda_graphs), head, "single")

    saved = B.local_trunk
    B.local_trunk = factory
    try:
        return LLM(path, device=DEV, dtype=DT, progress=False, max_seq_len=max_seq, spec="auto")
    finally:
        B.local_trunk = saved


def step_bytes(cfg, qbytes: int, dense: int, ctx: int) -> int:
    """Bytes one AR step reads: weights once, KV up to ctx, GDN state read and written."""
    kv = cfg.n_full * 2 * ctx * cfg.num_key_value_heads * cfg.head_dim * torch.tensor([], dtype=DT).element_size()
    st = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return qbytes + dense + kv + st


# ---- 1. kernels -----------------------------------------------------------------------------

def random_q4(n: int, k: int) -> QuantWeight:
    q = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
    s = (torch.rand(k // GROUP, n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    return QuantWeight(q, s, (-8 * s.float()).to(torch.bfloat16), False, DT)


def bench_kernels(res: dict, cfg, budget: float) -> None:
    """Grouped launch vs one launch per weight for the projections of one input, and the single
    weights, at M = 1 / 4 / 16; the floor of a call (a 64 x 512 weight: what every call pays
    whatever its size) and the sum(x) kernel alone."""
    from timing import graph_time

    from specfire.kernels.q4 import gemv as tq
    from specfire.kernels.q4 import q4_rows

    timer = graph_time if not SMOKE else _cpu_time
    tiny = random_q4(64, 512)
    x1 = torch.randn(1, 5120 if not SMOKE else 512, device=DEV, dtype=DT)
    xs = torch.empty(1, x1.shape[1] // GROUP, device=DEV, dtype=torch.float32)
    res["call_floor_us"] = {
        "q4 64x512 M1": timer([lambda: q4_rows(x1[:, :512], [tiny], [None])]) * 1e6,
        "sum(x) K=5120 M1": timer([lambda: tq._xsum_kernel[(1, -(-xs.shape[1] // 16))](x1, xs, x1.shape[1], x1.stride(0),
                                                                                      G=GROUP, GB=16)]) * 1e6}
    log("  call floor (us): " + ", ".join(f"{k} {v:.2f}" for k, v in res["call_floor_us"].items()))

    h, kd = cfg.hidden_size, cfg.linear_key_head_dim
    qkv = 2 * cfg.linear_num_key_heads * kd + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    z = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    att_q, att_kv = 2 * cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    groups = {"MLP gate+up": [(cfg.intermediate_size, h)] * 2, "GDN qkv+z": [(qkv, h), (z, h)],
              "attn q+gate,k,v": [(att_q, h), (att_kv, h), (att_kv, h)],
              "MLP down": [(h, cfg.intermediate_size)], "attn o / GDN out": [(h, z)], "lm_head": [(cfg.vocab_size, h)]}
    out = {}
    x = torch.randn(16, max(h, cfg.intermediate_size, z), device=DEV, dtype=DT)
    for name, shapes in groups.items():
        if elapsed() > budget:
            out[name] = {"skipped": "time budget"}
            continue
        k = shapes[0][1]
        nbytes = sum(n * k // 2 + 4 * n * (k // GROUP) for n, _ in shapes)
        copies = 1 if SMOKE else max(2, -(-int(120e6) // nbytes))       # rotate past the 60 MB L2
        sets = [[random_q4(n, k) for n, _ in shapes] for _ in range(copies)]
        rec = {"shapes": shapes, "bytes": nbytes}
        # bits first: the grouped launch gives each weight the bits of its own launch with the
        # group's settings, and every prefix M = 1..16 the bits of the 16-row call
        ws, cfgg = sets[0], tq.group_config([n for n, _ in shapes], k, GROUP)
        x16 = x[:16, :k].contiguous()
        full = tq.q4_group(x16, ws, cfgg)
        same = all(torch.equal(a, tq.q4_group(x16, [w], cfgg)[0]) for a, w in zip(full, ws))
        prefix = all(all(torch.equal(a, b[:m]) for a, b in zip(tq.q4_group(x16[:m], ws, cfgg), full)) for m in range(1, 17))
        rec.update(config=cfgg.__dict__, grouped_equals_own_launches=same, row_invariant=prefix)
        if not (same and prefix):
            log(f"  {name}: BITS DIFFER: grouped == own launches {same}, every prefix == the 16-row call {prefix}")
        for m in (1, 2, 4, 8, 16):
            xm = x[:m, :k].contiguous()
            fns = {"grouped": [lambda ws=ws: q4_rows(xm, ws, [None] * len(ws)) for ws in sets]}
            if len(shapes) > 1:
                fns["separate"] = [lambda ws=ws: [q4_rows(xm, [w], [None]) for w in ws] for ws in sets]
            for mode, f in fns.items():
                t = timer(f)
                rec[f"{mode}_M{m}_us"] = t * 1e6
                rec[f"{mode}_M{m}_frac"] = nbytes / t / PEAK
        out[name] = rec
        sep = f", separate {rec['separate_M1_us']:.1f} us ({rec['separate_M1_frac']:.1%})" if len(shapes) > 1 else ""
        log(f"  {name:<18} M1 {rec['grouped_M1_us']:7.1f} us {rec['grouped_M1_frac']:6.1%} of 4.17 TB/s{sep}; "
            f"M4 {rec['grouped_M4_frac']:6.1%}; M16 {rec['grouped_M16_us']:7.1f} us {rec['grouped_M16_frac']:6.1%}; "
            f"bits: grouped == own launches {same}, row-invariant {prefix}")
        del sets
    res["kernels"] = out


def _cpu_time(fns) -> float:
    t = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t) / len(fns)


# ---- 2. end to end --------------------------------------------------------------------------

def generate_runs(llm, prompts: list, tokens: int, spec, per_cycle: bool) -> dict:
    from specfire import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True), spec=spec)   # captures, warm-up
    n_tok, dec_s, cycles, ids, tau = 0, 0.0, 0, [], []
    for p in prompts:
        r = llm.generate(p, sp, spec=spec)
        st = r.stats
        n_tok += st["generated_tokens"] - 1
        dec_s += st["decode_s"]
        cycles += st["cycles"] or 0
        tau.append(st["mean_accept_len"])
        ids.append(r.token_ids)
    return {"tok_s": n_tok / dec_s, "decode_s": dec_s, "tokens": n_tok, "cycles": cycles, "mean_accept_len": tau,
            "step_ms": dec_s / (cycles if per_cycle else n_tok) * 1e3, "ids": ids}


def e2e_variant(llm, prompts: list, tokens: int, nbytes: int) -> dict:
    from specfire import SpecPolicy

    ar = generate_runs(llm, prompts, tokens, "off", False)
    mtp = generate_runs(llm, prompts, tokens, SpecPolicy("mtp", 3), True)
    rec = {"ar_tok_s": ar["tok_s"], "ar_step_ms": ar["step_ms"], "ar_bw_frac": ar["tok_s"] * nbytes / PEAK,
           "mtp3_tok_s": mtp["tok_s"], "mtp3_cycle_ms": mtp["step_ms"], "mtp3_cycle_over_ar": mtp["step_ms"] / ar["step_ms"],
           "mtp3_mean_accept_len": mtp["mean_accept_len"], "mtp_equals_ar": mtp["ids"] == ar["ids"],
           "ar_tokens": ar["tokens"], "mtp_cycles": mtp["cycles"]}
    return rec


def all_accepted(llm, trunk_model, head, prompts: list, tokens: int) -> dict:
    """Final norms -1 (gain 0): every logit 0, so the head's drafts (token 0) are always accepted."""
    from specfire import SpecPolicy

    saved = trunk_model.norm.weight.clone(), head.norm.weight.clone()
    with torch.no_grad():
        trunk_model.norm.weight.fill_(-1.0)
        head.norm.weight.fill_(-1.0)
    try:
        ar = generate_runs(llm, prompts[:1], tokens, "off", False)
        mtp = generate_runs(llm, prompts[:1], tokens, SpecPolicy("mtp", 3), True)
    finally:
        with torch.no_grad():
            trunk_model.norm.weight.copy_(saved[0])
            head.norm.weight.copy_(saved[1])
    return {"ar_step_ms": ar["step_ms"], "mtp3_cycle_ms": mtp["step_ms"], "mtp3_cycle_over_ar": mtp["step_ms"] / ar["step_ms"],
            "mtp3_tok_s": mtp["tok_s"], "mtp3_over_ar_tok_s": mtp["tok_s"] / ar["tok_s"],
            "mean_accept_len": mtp["mean_accept_len"], "mtp_equals_ar": mtp["ids"] == ar["ids"]}


def profile_step(llm, ctx: int) -> dict:
    """Device time of the 1-row CUDA graph (an AR step without the host) and, under the profiler,
    its kernels by name (per step), bucketed."""
    trunk = llm.engine.trunk
    if SMOKE or trunk.graphs is None or 1 not in trunk.graphs.graphs:
        return {}
    g = trunk.graphs.graphs[1]
    trunk.graphs.pos.fill_(ctx)
    g.graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        g.graph.replay()
    e1.record()
    sync()
    out = {"graph_ms": e0.elapsed_time(e1) / 10}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(4):
            g.graph.replay()
        sync()
    kern = {}
    for e in p.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        if us > 0:
            kern[e.key] = {"us": us / 4, "calls": e.count / 4}
    buckets = {"q4 GEMV": ("_q4_kernel",), "q4 sum(x)": ("_xsum",), "split-K sum": ("_splitk_sum",),
               "bf16 GEMV": ("_gemv",), "norm": ("norm",), "GDN": ("gdn", "conv"), "attention": ("attn", "flash")}
    b = {k: 0.0 for k in buckets}
    b["other"] = 0.0
    for name, v in kern.items():
        key = next((k for k, pats in buckets.items() if any(pt in name for pt in pats)), "other")
        b[key] += v["us"]
    out["buckets_us"] = b
    out["kernels"] = dict(sorted(kern.items(), key=lambda kv: -kv[1]["us"])[:25])
    return out


def build_models(res: dict, cfg) -> tuple:
    """The 4-bit trunk and MTP head of `cfg` on the device, quantized here."""
    from specfire.model.qwen35 import MtpHead, Qwen35Trunk

    t = time.time()
    trunk_model, qb, db = build(Qwen35Trunk, cfg, 0)
    head, hq, _ = build(MtpHead, cfg, 1)
    sync()
    res["model"] = {"layers": cfg.num_hidden_layers, "quantize_s": time.time() - t, "weights_4bit_bytes": qb,
                    "dense_bytes": db, "head_4bit_bytes": hq}
    return trunk_model, head


def run_variants(res: dict, cfg, args, models: tuple, warm: bool = False, only: str = "") -> None:
    trunk_model, head = models
    info = res["model"]
    qb, db = info["weights_4bit_bytes"], info["dense_bytes"]
    ctx = args.prompt + args.tokens // 2
    nbytes = step_bytes(cfg, qb, db, ctx)
    info.update(step_bytes=nbytes, ceiling_tok_s=PEAK / nbytes)
    log(f"built + quantized {cfg.num_hidden_layers} layers in {info['quantize_s']:.1f} s: 4-bit {qb / 2**30:.2f} GiB, "
        f"dense {db / 2**30:.2f} GiB, step {nbytes / 1e9:.2f} GB, ceiling {info['ceiling_tok_s']:.0f} tok/s")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (args.prompt,), generator=g).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as path:
        write_config(cfg, path)
        # ungrouped first: the grouped variant ends with a torch.profiler session, which leaves every later
        # host launch of the process several times slower (measured on torch 2.11), so nothing is timed after it;
        # ungrouped starts only while most of the budget is left, so the grouped variant is never starved
        for name, grouped, share in (("ungrouped", False, 0.4), ("grouped", True, 0.85)):
            if (only and name != only) or name in args.skip.split(","):
                continue
            if not warm and elapsed() > args.budget * share:
                res.setdefault("skipped", []).append(name)
                continue
            triton_gemv.GROUP = grouped
            try:
                with open_llm(path, trunk_model, head, args.prompt + args.tokens + 64) as llm:
                    rec = e2e_variant(llm, prompts, args.tokens, nbytes)
                    if not warm:
                        log(f"  {name}: AR {rec['ar_tok_s']:.1f} tok/s ({rec['ar_bw_frac']:.1%} of 4.17 TB/s = of the "
                            f"4-bit ceiling {info['ceiling_tok_s']:.0f}), step {rec['ar_step_ms']:.2f} ms; MTP k=3 cycle "
                            f"{rec['mtp3_cycle_ms']:.2f} ms = {rec['mtp3_cycle_over_ar']:.3f} x AR (tau "
                            f"{rec['mtp3_mean_accept_len']}); MTP == AR: {rec['mtp_equals_ar']}")
                    if grouped and (warm or elapsed() < args.budget * 0.7):
                        rec["all_accepted"] = all_accepted(llm, trunk_model, head, prompts, args.tokens)
                        if not warm:
                            a = rec["all_accepted"]
                            log(f"  {name}, every draft accepted: cycle {a['mtp3_cycle_ms']:.2f} ms = "
                                f"{a['mtp3_cycle_over_ar']:.3f} x AR step; MTP {a['mtp3_tok_s']:.1f} tok/s = "
                                f"{a['mtp3_over_ar_tok_s']:.2f} x AR")
                    if grouped and not warm:
                        rec["profile"] = profile_step(llm, ctx)
                        if rec["profile"]:
                            pr = rec["profile"]
                            log(f"  AR step graph {pr['graph_ms']:.2f} ms; by kernel (us): " +
                                ", ".join(f"{k} {v:.0f}" for k, v in pr["buckets_us"].items()))
                    res[name] = rec
            finally:
                triton_gemv.GROUP = True
            save(res, args)
    if "grouped" in res and "ungrouped" in res:
        res["grouped_over_ungrouped_ar"] = res["grouped"]["ar_tok_s"] / res["ungrouped"]["ar_tok_s"]


def save(res: dict, args) -> None:
    if args.out:
        with open(os.path.join(args.out, "quant_e2e.json" if not args.warm else "quant_e2e_warm.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--warm", default="", help="worker: a 4-layer model through the calls of this variant")
    ap.add_argument("--skip", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--gates4", action="store_true", help="the GDN gate projections in_proj_b / in_proj_a 4-bit "
                    "as well (`specfire quantize --gates`; they then join the 4-bit qkv + z launch)")
    ap.add_argument("--q4-configs", default="", help="JSON {'N,K': Q4Config fields, 'bf16:N,K': GemvConfig fields} "
                    "(bench/linear.py --adopt) taking the place of the committed settings for those shapes, in this run only")
    args = ap.parse_args()
    global GATES4
    GATES4 = args.gates4
    torch.manual_seed(0)
    if args.q4_configs:
        from specfire.kernels.q4 import gemv as tq
        with open(args.q4_configs) as f:
            table = json.load(f)
        patch = {tuple(int(v) for v in key.split(",")): tq.Q4Config(**c) for key, c in table.items() if ":" not in key}
        tq._MEASURED.update(patch)
        dense = {tuple(int(v) for v in key[5:].split(",")): triton_gemv.GemvConfig(**c)
                 for key, c in table.items() if key.startswith("bf16:")}
        triton_gemv._MEASURED.update(dense)
        log(f"q4 configs from {args.q4_configs}: {len(patch)} 4-bit shapes, {len(dense)} bf16 shapes")
    if args.warm:   # compile every kernel the run will launch (the 27B dims on 4 layers, few tokens)
        args.tokens, args.prompts = 8, 1
        cfg = model_cfg(args.shape, 4)
        res: dict = {}
        run_variants(res, cfg, args, build_models(res, cfg), warm=True, only=args.warm)
        return 0
    import triton
    res = {"gpu": "cpu-smoke" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "shape": args.shape, "prompt": args.prompt, "tokens": args.tokens, "gates4": args.gates4}
    log(f"{res['gpu']} torch {res['torch']} triton {res['triton']}")
    procs = []
    if not SMOKE and "warm" not in args.skip:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        logf = open(os.path.join(args.out or ".", "quant_e2e_warm.log"), "w")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", v, "--shape", args.shape,
                                   "--prompt", "64", "--out", "", "--q4-configs", args.q4_configs]
                                 + (["--gates4"] if args.gates4 else []),
                                  env=env, stdout=logf, stderr=subprocess.STDOUT)
                 for v in ("grouped", "ungrouped") if v not in args.skip.split(",")]
    cfg = model_cfg(args.shape)
    models = build_models(res, cfg)        # while the worker compiles (nothing is timed here)
    for p in procs:
        try:
            rc = p.wait(timeout=max(1.0, args.budget * 0.55 - elapsed()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "killed"
        res.setdefault("warmup_rc", []).append(rc)
        log(f"warm-up worker: {rc}")
    if "e2e" not in args.skip:
        log(f"== end to end: {args.shape}, 4-bit, LLM.generate, prompt {args.prompt}, {args.tokens} new tokens ==")
        run_variants(res, cfg, args, models)
        save(res, args)
    del models
    if "kernels" not in args.skip and elapsed() < args.budget * 0.9:
        log("== kernels: grouped launch vs one launch per weight (4-bit, group 128) ==")
        bench_kernels(res, cfg, args.budget)
    save(res, args)
    summary(res)
    return 0


def summary(res: dict) -> None:
    print("\n== summary ==")
    for name, r in res.get("kernels", {}).items():
        if "skipped" in r:
            continue
        sep = (f" | separate M1 {r['separate_M1_frac']:.1%} ({r['separate_M1_us']:.1f} us), grouped/separate "
               f"{r['separate_M1_us'] / r['grouped_M1_us']:.2f}x") if "separate_M1_us" in r else ""
        print(f"  {name}: M1 {r['grouped_M1_frac']:.1%} M4 {r['grouped_M4_frac']:.1%} M16 {r['grouped_M16_frac']:.1%}{sep}")
    m = res.get("model")
    for name in ("grouped", "ungrouped"):
        r = res.get(name)
        if r:
            print(f"  {name}: AR {r['ar_tok_s']:.1f} tok/s ({r['ar_bw_frac']:.1%} of 4.17 TB/s; ceiling "
                  f"{m['ceiling_tok_s']:.0f}); MTP k=3 cycle {r['mtp3_cycle_over_ar']:.3f} x AR; MTP == AR {r['mtp_equals_ar']}")
    print(f"[done at {elapsed():.0f} s]", flush=True)


if __name__ == "__main__":
    sys.exit(main())
