"""4-bit GEMV sweep, adoption, Q8 attention sweep and 4-bit decode end to end on the GPU, in one call.

0. Warm-up: every candidate kernel is compiled in parallel worker processes (GEMVs on tiny
   shapes: the kernel specialises on no size, so these are the real calls' binaries; Q8 attention
   on the real cache sizes), and one more worker runs a 4-layer model of the 27B dimensions end to
   end, so the Triton cache is full before anything is timed.
1. 4-bit GEMV (kernels/q4/gemv.py), group 128, the 27B layer shapes and the lm_head (or, with
   `--shapes fused`, the projections that share an input concatenated): for every candidate
   (columns per CTA, warps, pipeline depth, codes as the A or B operand, split-K, codes stored as
   rows or in 64-row tiles), parity against the float32 product of the dequantised weight and
   bitwise row invariance (every prefix M = 1..16 and every single row equal the 16-row result),
   then the time at M = 1, 4, 16 (CUDA-graph replay over rotating weight copies > L2), beside
   torch's `_weight_int4pack_mm`; a table row is printed per candidate as it is measured.
   Bandwidth = bytes the call must read (codes + bf16 scales + zeros) / time, as a fraction of
   4.17 TB/s. The layout with the least step-weighted sum of per-shape best (t1 + t4 + t16) is
   chosen and its fastest row-invariant config per shape adopted for the rest of the run.
2. Q8 KV attention configs vs bf16 (defaults) at 33k positions, rows 1..5: parity, bitwise row
   invariance, time per row count.
3. End to end with the adopted configs: a random-weight 27B-shape trunk with 4-bit projections
   and a 4-bit MTP head built on the GPU, CUDA graphs: AR decode tok/s, verify 1 / 4 rows, the
   cost of an MTP k=3 cycle (draft 3 + verify 4 + accept) against an AR step, and where an AR
   step's device time goes (profiler, kernels by name).
A summary closes the output; everything also goes to $OUT/quant_gpu.json (written after every
section).

    python bench/quant_gpu.py [--budget 150] [--shapes 27b|fused] [--bases N] [--skip q4,q8,e2e] [--out DIR]
BENCH_SMOKE=1 TRITON_INTERPRET=1 runs the script's logic on the CPU on tiny shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from specfire.kernels.q4 import gemv as tq  # noqa: E402
from specfire.kernels.q4 import TILE, QuantWeight  # noqa: E402
from specfire.kernels.q4.gemv import Q4Config, q4_gemv  # noqa: E402

TILED = 64          # the tiled layout the sweep measures beside rows
LAYOUTS = (0, TILED)
ADOPT_TILE = [TILE]  # the code layout the end-to-end section builds its weights in (set by the sweep)

PEAK = 4.17e12
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
BF = torch.float32 if SMOKE else torch.bfloat16
SHAPES = [(17408, 5120, "MLP gate, up"), (5120, 17408, "MLP down"), (12288, 5120, "attn q+gate"),
          (10240, 5120, "GDN qkv"), (6144, 5120, "GDN z"), (5120, 6144, "attn o, GDN out"),
          (1024, 5120, "attn k, v"), (248320, 5120, "lm_head")]
if SMOKE:
    SHAPES = [(48, 512, "tiny"), (20, 256, "tiny2")]
GROUP = 128 if not SMOKE else 64
SMS = 132
# (block_n, num_warps, num_stages, wa) -> CTAs resident per SM (registers / shared memory of the
# sm_90 build: cuobjdump -res-usage of triton's output), which sets the split-K that fills the
# machine in one wave; wa = codes as the MMA's A operand (8-12% fewer instructions in the loop).
# Most promising first (the winners of the runs so far, then the rest); every base runs on both code
# layouts (rows, 64-row tiles) and at one wave, half a wave and (the first six) two waves.
BASES = {(64, 2, 3, True): 6, (128, 2, 3, True): 4, (64, 2, 4, True): 6, (32, 1, 4, True): 9,
         (64, 1, 3, True): 8, (128, 2, 4, True): 4, (64, 2, 4, False): 6, (64, 1, 3, False): 8,
         (32, 1, 4, False): 11, (128, 2, 4, False): 4, (32, 1, 3, True): 10, (64, 4, 4, True): 3,
         (16, 1, 4, True): 12, (64, 2, 5, True): 5}
# how often each shape runs in one 27B decode step (weights for choosing the code layout)
PER_STEP = {(17408, 5120): 128, (5120, 17408): 64, (12288, 5120): 16, (10240, 5120): 48, (6144, 5120): 48,
            (5120, 6144): 64, (1024, 5120): 32, (248320, 5120): 1}
# `--shapes fused`: the projections that read the same input as one weight (gate + up; GDN qkv + z;
# attention q + gate + k + v), i.e. one GEMV launch where the model now makes two or three
FUSED = [(34816, 5120, "MLP gate+up fused"), (16384, 5120, "GDN qkv+z fused"), (14336, 5120, "attn q+gate+k+v fused")]
T0 = time.time()
WARM_LOG = "/tmp/quant_gpu_warm.log"


def elapsed() -> float:
    return time.time() - T0


def graph_time(fns, iters: int = 20) -> float:
    """Seconds per call of fns[i % len(fns)]: bench/timing.py's CUDA-graph replay on the GPU, a plain
    loop under BENCH_SMOKE=1 on the CPU."""
    if SMOKE:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns)
    from timing import graph_time as replayed
    return replayed(fns, iters)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def random_q4(n: int, k: int, g: int = GROUP, tile: int = TILE) -> QuantWeight:
    """Random codes, scales and zeros (speed does not depend on the values); codes stored in tiles
    of `tile` rows (0: rows as they are, the earlier kernels' layout)."""
    q = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
    s = (torch.rand(k // g, n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (-8 * s.float()).to(torch.bfloat16)
    return QuantWeight(q, s, z, False, BF, tile)


def row_invariant(fn, x) -> bool:
    full = fn(x)
    ok = all(torch.equal(fn(x[:m]), full[:m]) for m in range(1, x.shape[0] + 1))
    return ok and all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(x.shape[0]))


# ---- candidates -----------------------------------------------------------------------------

def wave_split(n: int, k: int, base: tuple, waves: int = 1) -> int:
    bn = base[0]
    return max(1, min(k // GROUP, SMS * BASES[base] * waves // triton_cdiv(n, bn)))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cfg_of(base: tuple, split: int, sem: bool = True) -> Q4Config:
    bn, nw, ns, wa = base
    return Q4Config(block_n=bn, split_k=split, num_warps=nw, num_stages=ns, sem=sem, wa=wa)


def candidates(n: int, k: int) -> list[tuple]:
    """(config, code layout) pairs, most promising first: every base at the split that fills the
    machine in one wave, on rows and on 64-row tiles, then half a wave, then two waves (first six
    bases), then the second-launch combine for the two small-N winners of the first run."""
    c = []
    bases = list(BASES)
    for b in bases:
        c += [(cfg_of(b, wave_split(n, k, b)), t) for t in LAYOUTS]
    for b in bases:
        c += [(cfg_of(b, max(1, wave_split(n, k, b) // 2)), t) for t in LAYOUTS]
    for b in bases[:6]:
        c += [(cfg_of(b, wave_split(n, k, b, 2)), t) for t in LAYOUTS]
    for b in ((64, 2, 4, True), (32, 1, 4, True)):
        if b in BASES and wave_split(n, k, b) > 1:   # a second launch combined the splits faster at M = 16 on small-N shapes
            c += [(cfg_of(b, wave_split(n, k, b), False), t) for t in LAYOUTS]
    out = []
    for x in c:
        if x not in out:
            out.append(x)
    return out


def tag(cfg: Q4Config, tile: int) -> str:
    return (f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}{' wa' if cfg.wa else ''} split{cfg.split_k} "
            f"{'tiled' if tile else 'rows'}{'' if cfg.sem or cfg.split_k == 1 else ' 2launch'}")


# ---- 0. warm-up -----------------------------------------------------------------------------

def warm_kernels(part: int, parts: int, q8: bool = True) -> None:
    """Compile this worker's share of every candidate: 4-bit GEMVs on a tiny weight (split 1 and
    split 2: the kernel specialises on no size), Q8 attention configs on the real cache sizes (the
    position and row count are runtime values, but 1 may be specialised, so R = 1 and R = 5)."""
    jobs = [("q4", cfg_of(b, sp), tile) for b in BASES for tile in LAYOUTS for sp in (1, 2)]
    jobs += [("q4", cfg_of(b, 2, False), tile) for b in ((64, 2, 4, True), (32, 1, 4, True)) if b in BASES
             for tile in LAYOUTS]
    jobs += [("q8", kw, None) for kw in Q8_CONFIGS] if q8 else []
    mine = [j for i, j in enumerate(jobs) if i % parts == part]
    qws = {tile: random_q4(256, 2048, tile=tile) for tile in LAYOUTS}
    x = torch.randn(16, 2048, device=DEV, dtype=BF)
    caches = q8_caches(1) if any(j[0] == "q8" for j in mine) else None
    for kind, cfg, tile in mine:
        try:
            if kind == "q4":
                q4_gemv(x, qws[tile], cfg)
                q4_gemv(x[:1], qws[tile], cfg)
            else:
                seq, q, c = caches["seq"], caches["q"], caches["q8"][0]
                for r in (1, 5):
                    q8_call(q[:r], c, seq, cfg)
        except Exception as e:
            print(f"warm {kind} {cfg} {tile}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if not SMOKE:
        torch.cuda.synchronize()


def start_warmup(args) -> list:
    if SMOKE:
        return []
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    n = args.warm_procs
    log = open(WARM_LOG, "w")   # workers' output kept apart from the tables (tail in the JSON)
    for i in range(n):
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{i}/{n}",
                                       "--bases", str(args.bases), "--skip", args.skip], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-e2e"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT))
    return procs


def wait_warmup(procs: list, limit: float) -> dict:
    t = time.time()
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, limit - (time.time() - t))))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append("killed")
    print(f"[warm-up done at {elapsed():.0f} s: waited {time.time() - t:.0f} s, return codes {rcs}]", flush=True)
    with open(WARM_LOG) as f:
        tail = f.read()[-3000:]
    return {"warm_s": time.time() - t, "rcs": rcs, "log_tail": tail}


# ---- 1. GEMV sweep --------------------------------------------------------------------------

def torch_int4(n: int, k: int, g: int):
    try:
        w = torch.randint(0, 16, (n, k), device=DEV, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        sz = torch.rand(k // g, n, 2, device=DEV, dtype=torch.bfloat16)
        f = (lambda xm: torch.ops.aten._weight_int4pack_mm(xm, packed, g, sz))
        f(torch.randn(1, k, device=DEV, dtype=torch.bfloat16))
        return f
    except Exception as e:
        print(f"     torch int4 mm unavailable: {type(e).__name__}: {str(e)[:100]}")
        return None


def fmt_row(n: int, k: int, r: dict) -> str:
    if "us_M1" not in r:
        return f"  {n:>6}x{k:<6} {r['cfg']:<40} {r.get('error') or r.get('skipped')}"
    return (f"  {n:>6}x{k:<6} {r['cfg']:<40} M1 {r['us_M1']:7.1f} us {r['frac_M1']:6.1%} M4 {r['frac_M4']:6.1%} "
            f"M16 {r['us_M16']:7.1f} us {r['frac_M16']:6.1%} err {r['rel_err']:.1e} inv {r['row_invariant']}")


def usable(r: dict) -> bool:
    return "us_M16" in r and r["row_invariant"] and r["repeat_equal"] and r["rel_err"] < 1e-2


def bench_q4(res: dict, budget: float) -> dict:
    """Sweep every shape (a table row printed per candidate as it is measured); then choose the code
    layout with the least step-weighted sum of per-shape best times and adopt, per shape, the
    fastest bitwise row-invariant config on that layout. Returns {(n, k): Q4Config}."""
    print(f"\n== 4-bit GEMV, group {GROUP}: parity, bitwise row invariance, time (us, % of 4.17 TB/s) ==", flush=True)
    best = {}   # (n, k) -> {tile: row}
    for si, (n, k, what) in enumerate(SHAPES):
        nbytes = n * k // 2 + 2 * 2 * n * (k // GROUP)
        copies = max(1, min(8, math.ceil(400e6 / nbytes)))
        sets = {0: [random_q4(n, k, tile=0) for _ in range(copies)]}
        sets[TILED] = [QuantWeight(w.qtiled, w.scales_t, w.zeros_t, False, BF, TILED) for w in sets[0]]  # same codes
        qw0 = sets[0][0]
        x16 = torch.randn(16, k, device=DEV, dtype=BF)
        ref = x16.float() @ qw0.dequantize().t()
        cands = candidates(n, k)
        share = elapsed() + (budget - elapsed()) / (len(SHAPES) - si)   # this shape's share of the budget
        print(f"  -- {n} x {k} ({what}), {nbytes / 1e6:.1f} MB, {len(cands)} candidates", flush=True)
        rows = []
        for ci, (cfg, tile) in enumerate(cands):
            if ci >= 2 and elapsed() > share:
                rows.append({"cfg": tag(cfg, tile), "tile": tile, "skipped": "time budget"})
                continue
            qws = sets[tile]
            w0 = qws[0]
            rec = {"cfg": tag(cfg, tile), "tile": tile, "params": cfg.__dict__}
            try:
                y = q4_gemv(x16, w0, cfg)
                rec["rel_err"] = rel(y, ref)
                rec["row_invariant"] = row_invariant(lambda t: q4_gemv(t, w0, cfg), x16)
                rec["repeat_equal"] = torch.equal(q4_gemv(x16, w0, cfg), y)
                for m in (1, 4, 16):
                    t = graph_time([lambda w=w: q4_gemv(x16[:m], w, cfg) for w in qws])
                    rec[f"us_M{m}"] = t * 1e6
                    rec[f"frac_M{m}"] = nbytes / t / PEAK
            except Exception as e:  # a config the compiler refuses is reported, not fatal
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(rec)
            if "skipped" not in rec:
                print(fmt_row(n, k, rec), flush=True)
        skipped = sum("skipped" in r for r in rows)
        best[(n, k)] = {}
        for tile in LAYOUTS:
            ok = [r for r in rows if r.get("tile") == tile and usable(r)]
            if ok:
                b = min(ok, key=lambda r: r["us_M1"] + r["us_M4"] + r["us_M16"])
                t = graph_time([lambda w=w: q4_gemv(x16[:8], w, Q4Config(**b["params"])) for w in sets[tile]])
                b["us_M8"], b["frac_M8"] = t * 1e6, nbytes / t / PEAK
                best[(n, k)][tile] = b
                print(f"  best {'tiled' if tile else 'rows '}: {b['cfg']}  M1 {b['frac_M1']:.1%} M4 {b['frac_M4']:.1%} "
                      f"M8 {b['frac_M8']:.1%} M16 {b['frac_M16']:.1%}", flush=True)
        i4 = {}
        ti4 = torch_int4(n, k, GROUP) if not SMOKE else None
        if ti4 is not None:
            fns = [ti4] + [torch_int4(n, k, GROUP) for _ in range(3)]
            for m in (1, 16):
                t = graph_time([lambda f=f: f(x16[:m]) for f in fns])
                i4[f"us_M{m}"] = t * 1e6
                i4[f"frac_M{m}"] = (n * k // 2 + n * k // GROUP * 4) / t / PEAK
            print(f"  torch _weight_int4pack_mm: M1 {i4['us_M1']:.1f} us {i4['frac_M1']:.1%}  M16 {i4['us_M16']:.1f} us "
                  f"{i4['frac_M16']:.1%}", flush=True)
        res["q4"].append({"shape": [n, k], "what": what, "bytes": nbytes, "copies": copies, "configs": rows,
                          "skipped": skipped, "best_per_layout": {t: b["cfg"] for t, b in best[(n, k)].items()},
                          "torch_int4": i4})
        del sets, qws, w0, qw0
        if not SMOKE:
            torch.cuda.empty_cache()
        print(f"  [{elapsed():.0f} s, {skipped} skipped for time]", flush=True)

    def cost(tile):   # step-weighted sum of the best times on a layout (inf where a shape has none)
        return sum(PER_STEP.get(nk, 1) * (b[tile]["us_M1"] + b[tile]["us_M4"] + b[tile]["us_M16"]) if tile in b
                   else float("inf") for nk, b in best.items())
    costs = {t: cost(t) for t in LAYOUTS}
    tile = min(LAYOUTS, key=lambda t: (costs[t], t != TILE))
    ADOPT_TILE[0] = tile
    res["layout_cost_us"] = costs
    res["adopted_tile"] = tile
    adopted = {nk: Q4Config(**b[tile]["params"]) for nk, b in best.items() if tile in b}
    print(f"\nstep-weighted cost (sum of t1 + t4 + t16, us): rows {costs[0]:.0f}, tiled {costs[TILED]:.0f} -> "
          f"adopted layout: {'tiles of %d rows' % tile if tile else 'rows'}; configs (paste into q4_config):")
    for (n, k), c in adopted.items():
        print(f"  ({n}, {k}): {c}")
    return adopted


# Q8 attention sweep (kwargs of attention_rows_triton), the current default first. The first call
# of this session (docs/BENCHMARKS.md) measured spans of 128 / 256, 8 warps, no prefetch, mode 0
# and the folded-scale form (key scale on per-group scores, value scale on p; commit 5b07e61):
# all slower than this default; this list tries fewer warps per CTA (less duplicated conversion).
Q8_CONFIGS = [dict(q8_mode=2, split=512, block_n=32, num_warps=4, num_stages=3, prefetch=True)]
Q8_CONFIGS += [dict(q8_mode=2, split=sp, block_n=bn, num_warps=w, num_stages=st, prefetch=pf)
               for sp, bn, w, st, pf in ((512, 32, 2, 3, True), (256, 32, 2, 3, True), (512, 32, 2, 3, False),
                                         (256, 32, 1, 3, True), (128, 32, 1, 3, True), (512, 32, 2, 4, True),
                                         (512, 64, 2, 2, False))]
Q8_SEQ = 33014 if not SMOKE else 200
if SMOKE:   # the interpreter is slow: the default and one other
    Q8_CONFIGS = [Q8_CONFIGS[0], dict(q8_mode=0, split=64, block_n=32, num_warps=4, num_stages=2, prefetch=False)]


def q8_caches(copies: int) -> dict:
    from specfire.kernels import attention as A

    seq, hq, hkv, d = (Q8_SEQ, 24, 4, 256) if not SMOKE else (Q8_SEQ, 6, 2, 64)
    out = {"seq": seq, "d": d, "bf16": [], "q8": [],
           "q": torch.randn(5, hq, d, device=DEV, dtype=BF) * 2}
    for _ in range(copies):
        k = torch.randn(seq + 24, hkv, d, device=DEV, dtype=BF)
        v = torch.randn(seq + 24, hkv, d, device=DEV, dtype=BF)
        out["bf16"].append((k, v, None, None))
        (kq, ks), (vq, vs) = A.quantize_q8(k), A.quantize_q8(v)
        out["q8"].append((kq, vq, ks, vs))
    return out


def q8_call(q, c, pos0, kw=None):
    from specfire.kernels.attention.kernel import attention_rows_triton
    return attention_rows_triton(q, c[0], c[1], pos0, q.shape[-1] ** -0.5, c[2], c[3], **(kw or {}))



# ---- 2. end to end --------------------------------------------------------------------------

def quantized(module_cls, cfg, keep=("in_proj_a", "in_proj_b")):
    """A module of `cfg` on the device with every projection 4-bit (random codes), the rest bf16."""
    from specfire.layers import Linear

    with torch.device("meta"):
        m = module_cls(cfg)
    q_bytes = 0
    for name, mod in list(m.named_modules()):
        if isinstance(mod, Linear) and not name.endswith(keep):
            n, k = mod.weight.shape
            del mod.weight
            mod.weight = random_q4(n, k, tile=ADOPT_TILE[0])
            q_bytes += mod.weight.nbytes()
    m = m.to(BF).to_empty(device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    dense = 0
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV, dtype=BF) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
            if name != "embed_tokens.weight" or getattr(m, "lm_head", 1) is None:
                dense += p.numel() * p.element_size()
    return m, q_bytes, dense


def model_cfg(shape: str, layers: int | None = None):
    from decode import make_cfg
    from specfire.config import ModelConfig

    if SMOKE:
        return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                           layer_types=("linear_attention",) * 3 + ("full_attention",), tie_word_embeddings=False)
    cfg = make_cfg(shape)
    if layers:
        import dataclasses
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
    return cfg


def bench_e2e(res: dict, shape: str, layers: int | None, steps: int, cycles: int) -> None:
    from specfire.config import SamplingParams
    from specfire.model.qwen35 import MtpHead, Qwen35Trunk
    from specfire.runtime.drafters import MtpDrafter
    from specfire.runtime.spec import StepBuffers, finish, launch
    from specfire.runtime.trunk import LocalTrunk

    t0 = time.time()
    cfg = model_cfg(shape, layers)
    m, q_bytes, dense = quantized(Qwen35Trunk, cfg)
    head, hq, hd = quantized(MtpHead, cfg)
    build_s = time.time() - t0
    prompt = 16
    trunk = LocalTrunk(m, prompt + steps + 4 * cycles + 64, BF, cuda_graphs=not SMOKE)
    sync = torch.cuda.synchronize if not SMOKE else (lambda: None)
    sp = SamplingParams(temperature=0.0)
    bufs = StepBuffers(torch.device(DEV))
    ids = torch.randint(0, cfg.vocab_size, (prompt,), device=DEV)

    def start(drafter):
        trunk.begin()
        r = trunk.prefill(ids)
        first = r.logits[-1:].argmax(-1)
        if drafter is not None:   # as the engine does after a prefill
            drafter.begin(ids, r.hidden)
            drafter.commit([int(first)], r.hidden[:0], first)
        return int(first), first, prompt

    def run(drafter, k, n, state):
        last, last_dev, pos = state
        ts = []
        for _ in range(n):
            sync()
            t = time.perf_counter()
            st = launch(trunk, drafter, "mtp" if k else "ar", last, last_dev, pos, k, sp, None, bufs)
            acc, out = finish(st, trunk, [drafter] if drafter is not None else [])
            ts.append(time.perf_counter() - t)
            pos += acc + 1
            last = out[-1]
            last_dev = st.targets[acc:acc + 1]
        return sorted(ts)[len(ts) // 2], (last, last_dev, pos)

    st = start(None)
    _, st = run(None, 0, 3, st)                       # capture / warm
    ar_s, st = run(None, 0, steps, st)
    prof = {}
    if not SMOKE:   # where an AR step's device time goes (kernels by name, 4 steps, per step)
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                _, st = run(None, 0, 4, st)
                sync()
            for e in p.key_averages():
                us = getattr(e, "self_device_time_total", None)
                us = getattr(e, "self_cuda_time_total", 0) if us is None else us
                if us > 0:
                    prof[e.key] = prof.get(e.key, 0.0) + us / 4
        except Exception as e:
            prof = {"error": f"{type(e).__name__}: {e}"}
    pos = st[2]
    kv = cfg.n_full * 2 * pos * cfg.num_key_value_heads * cfg.head_dim * 2
    gdn = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    step = q_bytes + dense + kv + gdn
    rec = {"shape": shape, "layers": cfg.num_hidden_layers, "build_s": build_s, "weights_4bit_bytes": q_bytes,
           "ar_step_kernels_us": prof,
           "dense_bytes": dense, "step_bytes": step, "ar_ms": ar_s * 1e3, "ar_tok_s": 1 / ar_s,
           "ceiling_tok_s": PEAK / step, "bw_frac": step / ar_s / PEAK}
    for rr in (1, 4):
        idr = torch.randint(0, cfg.vocab_size, (rr,), device=DEV)
        trunk.verify(idr, pos)
        trunk.commit(0)
        sync()
        t = time.perf_counter()
        for _ in range(8):
            trunk.verify(idr, pos)
            trunk.commit(0)
        sync()
        rec[f"verify{rr}_ms"] = (time.perf_counter() - t) / 8 * 1e3
    drafter = MtpDrafter(head, trunk, BF)
    st = start(drafter)
    _, st = run(drafter, 3, 3, st)
    cyc_s, st = run(drafter, 3, cycles, st)
    rec.update({"mtp3_cycle_ms": cyc_s * 1e3, "mtp3_cycle_over_ar": cyc_s / ar_s, "head_4bit_bytes": hq,
                "mtp3_tok_s_all_accepted": 4 / cyc_s})
    res.setdefault("e2e", []).append(rec)
    if prof and "error" not in prof:
        tot = sum(prof.values())
        q4 = sum(v for k, v in prof.items() if "q4" in k or "xsum" in k or "splitk" in k)
        print(f"  AR step device time {tot:.0f} us: 4-bit GEMV kernels {q4:.0f} us ({q4 / tot:.0%}); top kernels:")
        for k_, v in sorted(prof.items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {v:8.1f} us  {k_[:90]}")
    elif prof:
        print(f"  profile: {prof}")
    print(f"  {shape} ({cfg.num_hidden_layers} layers): build {build_s:.0f} s, step {step / 1e9:.2f} GB, AR "
          f"{rec['ar_tok_s']:.1f} tok/s ({rec['bw_frac']:.1%} of 4.17 TB/s; ceiling {rec['ceiling_tok_s']:.0f}); "
          f"verify 1 / 4 rows {rec['verify1_ms']:.2f} / {rec['verify4_ms']:.2f} ms; MTP k=3 cycle "
          f"{rec['mtp3_cycle_ms']:.2f} ms = {rec['mtp3_cycle_over_ar']:.3f} x AR step", flush=True)
    del trunk, m, head, drafter
    if not SMOKE:
        torch.cuda.empty_cache()


def bench_q8(res: dict, budget: float) -> None:
    """Q8 KV attention configs vs bf16 (defaults) at 33k positions, rows R = 1..5: parity against
    the float32 reference of the dequantised cache (R = 5), bitwise row invariance (each row of the
    R = 5 call equals a one-row call at its position, and every prefix R), time per R."""
    from specfire.kernels import attention as A

    c = q8_caches(2)
    seq, d, q = c["seq"], c["d"], c["q"]
    print(f"\n== KV attention at {seq} positions, head_dim {d}: bf16 (defaults) vs Q8 configs, R = 1..5 (us) ==",
          flush=True)
    out = {"seq": seq, "configs": []}
    bf = {r: graph_time([lambda cc=cc: q8_call(q[:r], cc, seq) for cc in c["bf16"]]) * 1e6 for r in range(1, 6)}
    out["bf16_us"] = bf
    print("  bf16 defaults              " + "  ".join(f"R{r} {bf[r]:6.1f}" for r in bf), flush=True)
    kq, vq, ks, vs = c["q8"][0]
    n = seq + 5
    ref = A.attention_rows_ref(q.float(), A.dequantize_q8(kq[:n], ks[:n]), A.dequantize_q8(vq[:n], vs[:n]), seq,
                               d ** -0.5)
    for kw in Q8_CONFIGS:
        name = (f"mode{kw['q8_mode']} split{kw['split']} bn{kw['block_n']} w{kw['num_warps']} s{kw['num_stages']}"
                f"{' pf' if kw['prefetch'] else ''} ")
        if elapsed() > budget:
            out["configs"].append({"cfg": name, "skipped": "time budget"})
            continue
        rec = {"cfg": name, "params": kw}
        try:
            full = q8_call(q, c["q8"][0], seq, kw)
            rec["rel_err"] = rel(full, ref)
            inv = all(torch.equal(q8_call(q[i:i + 1], c["q8"][0], seq + i, kw)[0], full[i]) for i in range(5))
            rec["row_invariant"] = inv and all(torch.equal(q8_call(q[:r], c["q8"][0], seq, kw), full[:r])
                                               for r in range(1, 5))
            rec["us"] = {r: graph_time([lambda cc=cc: q8_call(q[:r], cc, seq, kw) for cc in c["q8"]]) * 1e6
                         for r in range(1, 6)}
            rec["le_bf16_all_rows"] = all(rec["us"][r] <= bf[r] for r in bf)
            print(f"  {name:<27}" + "  ".join(f"R{r} {rec['us'][r]:6.1f}" for r in rec["us"]) +
                  f"  err {rec['rel_err']:.1e} inv {rec['row_invariant']} <= bf16 all R: {rec['le_bf16_all_rows']}",
                  flush=True)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {name:<27}{rec['error']}", flush=True)
        out["configs"].append(rec)
    ok = [r for r in out["configs"] if "us" in r and r["row_invariant"] and r["rel_err"] < 1e-2]
    if ok:
        b = min(ok, key=lambda r: sum(r["us"].values()))
        out["best"] = b["cfg"]
        print(f"  fastest row-invariant Q8 (sum over R): {b['cfg']}; Q8/bf16 per R: " +
              "  ".join(f"R{r} {b['us'][r] / bf[r]:.3f}" for r in bf), flush=True)
    res["q8"] = out



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=185.0, help="seconds; later work is skipped past it")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--warm", default=None, help="worker: compile share i/n of the candidates")
    ap.add_argument("--warm-e2e", action="store_true", help="worker: a 4-layer 27B-dims model end to end")
    ap.add_argument("--warm-procs", type=int, default=14)
    ap.add_argument("--sweep-until", type=float, default=0.6, help="fraction of the budget for the GEMV sweep")
    ap.add_argument("--q8-until", type=float, default=0.72, help="the Q8 sweep stops at this fraction of the budget")
    ap.add_argument("--e2e-after", type=float, default=0.8, help="no end-to-end run past this fraction")
    ap.add_argument("--skip", default="")
    ap.add_argument("--warm-limit", type=float, default=0.0, help="seconds to wait for the warm-up (0: 0.3 x budget)")
    ap.add_argument("--shapes", default="27b", choices=("27b", "fused"), help="the GEMV shapes swept")
    ap.add_argument("--bases", type=int, default=0, help="sweep only the first N bases (0: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.bases:
        for b in list(BASES)[args.bases:]:
            del BASES[b]
    if args.shapes == "fused" and not SMOKE:
        SHAPES[:] = FUSED
    if args.warm:
        i, n = map(int, args.warm.split("/"))
        warm_kernels(i, n, "q8" not in args.skip.split(","))
        return 0
    if args.warm_e2e:
        bench_e2e({}, "27B", 4, 3, 2)
        return 0
    import triton
    res = {"gpu": "cpu-smoke" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "q4": [], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{res['gpu']} torch {res['torch']} triton {res['triton']}", flush=True)
    path = os.path.join(args.out, "quant_gpu.json")
    skip = set(args.skip.split(","))
    b = args.budget
    if not SMOKE:
        tq._locks(torch.device(DEV), 1 << 16)
    procs = start_warmup(args) if "warm" not in skip else []

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    res["warmup"] = wait_warmup(procs, args.warm_limit or 0.3 * b) if procs else None
    adopted = {}
    if "q4" not in skip:
        adopted = bench_q4(res, args.sweep_until * b)
        save()
    if adopted:  # the rest of the run uses the adopted configs
        base = tq.q4_config
        tq.q4_config = lambda n, k, g: adopted.get((n, k)) if g == GROUP and (n, k) in adopted else base(n, k, g)
        res["adopted"] = {f"{n}x{k}": c.__dict__ for (n, k), c in adopted.items()}
    if "q8" not in skip:
        try:
            bench_q8(res, args.q8_until * b)
        except Exception as e:
            import traceback
            traceback.print_exc()
            res["q8_error"] = f"{type(e).__name__}: {e}"
        save()
    if "e2e" not in skip and elapsed() < args.e2e_after * b:
        print("\n== end to end: 27B shape, 4-bit trunk + MTP head, CUDA graphs (adopted configs) ==", flush=True)
        try:
            bench_e2e(res, "27B", None, 24, 12)
        except Exception as e:
            import traceback
            traceback.print_exc()
            res["e2e_error"] = f"{type(e).__name__}: {e}"
        save()
    summary(res)
    print(f"[done at {elapsed():.0f} s]", flush=True)
    save()
    return 0


def summary(res: dict) -> None:
    """The run's result in a few lines (the long tables above may be cut from a captured tail)."""
    print("\n== summary ==")
    for sh in res["q4"]:
        n, k = sh["shape"]
        best = {r["cfg"]: r for r in sh["configs"] if "us_M1" in r}
        parts = []
        for tile, name in sh["best_per_layout"].items():
            r = best[name]
            parts.append(f"{name}: M1 {r['frac_M1']:.1%} M8 {r.get('frac_M8', 0):.1%} M16 {r['frac_M16']:.1%}")
        inv = all(r["row_invariant"] for r in best.values())
        i4 = sh["torch_int4"]
        print(f"  {n}x{k} ({len(best)} measured, all row-invariant: {inv}) " + " | ".join(parts) +
              (f" | torch int4 M1 {i4['frac_M1']:.1%} M16 {i4['frac_M16']:.1%}" if i4 else ""))
    if "adopted_tile" in res:
        print(f"  adopted layout tile={res['adopted_tile']} (step-weighted cost us: {res['layout_cost_us']})")
    q8 = res.get("q8")
    if q8 and "best" in q8:
        b = next(r for r in q8["configs"] if r["cfg"] == q8["best"])
        print(f"  Q8 best {q8['best']}: " + " ".join(f"R{r} {b['us'][r]:.1f}/{q8['bf16_us'][r]:.1f}" for r in b["us"]) +
              " us (Q8/bf16)")
    for e in res.get("e2e", []):
        print(f"  e2e {e['shape']}: AR {e['ar_tok_s']:.1f} tok/s ({e['bw_frac']:.1%} of 4.17 TB/s), MTP k=3 cycle "
              f"{e['mtp3_cycle_over_ar']:.3f} x AR, verify 4 / 1 = {e['verify4_ms'] / e['verify1_ms']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
