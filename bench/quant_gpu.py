"""4-bit GEMV and Q8 KV attention on the GPU in one call: check, then time, then decode end to end.

1. 4-bit GEMV (ops/triton_quant.py), group 128, the 27B layer shapes and the lm_head: for every
   candidate launch config, parity against the float32 product of the dequantised weight and
   bitwise row invariance (every prefix M = 1..16 and every single row equal the 16-row result);
   then the time at M = 1, 4, 8, 16 (CUDA-graph replay over rotating weight copies > L2), beside
   version 1 of the kernel and torch's `_weight_int4pack_mm` on the same shape. Bandwidth = bytes
   the call must read (codes + bf16 scales + zeros) / time, as a fraction of 4.17 TB/s.
2. Q8 KV attention (ops/attention_kernels.py) at 33k positions, 27B geometry, rows 1..5 and 8:
   parity, bitwise row invariance, time per call for bf16 and every Q8 mode.
3. End to end: a random-weight 27B-shape (and 4B-shape) trunk with 4-bit projection weights made
   directly on the GPU (no checkpoint), AR decode tok/s through CUDA graphs and verify times.
A table per section; everything also in $OUT/quant_gpu.json (written after every section).

    python bench/quant_gpu.py [--budget 220] [--out DIR]
BENCH_SMOKE=1 TRITON_INTERPRET=1 runs the script's logic on the CPU on tiny shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from specfire.ops import attention as A  # noqa: E402
from specfire.ops.attention_kernels import attention_rows_triton  # noqa: E402
from specfire.ops.quant import QuantWeight  # noqa: E402
from specfire.ops.triton_quant import Q4Config, q4_config, q4_gemv  # noqa: E402

PEAK = 4.17e12
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
BF = torch.float32 if SMOKE else torch.bfloat16
SHAPES = [(17408, 5120), (5120, 17408), (12288, 5120), (6144, 5120), (10240, 5120), (248320, 5120)]
if SMOKE:
    SHAPES = [(48, 256)]
ROWS = (1, 4, 8, 16)
T0 = time.time()


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
    from timing import graph_time as replayed  # bench/timing.py: run as a script, this folder is on sys.path
    return replayed(fns, iters)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def random_q4(n: int, k: int, g: int) -> QuantWeight:
    """Random codes, scales and zeros (speed does not depend on the values)."""
    q = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
    s = (torch.rand(n, k // g, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (-8 * s.float()).to(torch.bfloat16)
    return QuantWeight.from_stored(q, s, z, False, BF, DEV)


def row_invariant(fn, x) -> bool:
    full = fn(x)
    ok = all(torch.equal(fn(x[:m]), full[:m]) for m in range(1, x.shape[0] + 1))
    return ok and all(torch.equal(fn(x[i:i + 1])[0], full[i]) for i in range(x.shape[0]))


def v1_config(n: int, k: int, g: int) -> Q4Config:
    """The committed configuration of kernel version 1 (its measured best per shape)."""
    if n >= 65536:
        return Q4Config(block_n=64, split_k=1, version=1)
    if k >= 12288 and g >= 128:
        return Q4Config(block_n=64, split_k=8, version=1)
    return Q4Config(block_n=64, split_k=4, version=1)


def candidates(n: int) -> list[Q4Config]:
    """v2 launch configs, most promising first (later ones may be cut by the time budget)."""
    c = [Q4Config(32, num_warps=2, num_stages=3, gps=2, deq=True), Q4Config(32, num_warps=2, num_stages=3, gps=2, xsum=False),
         Q4Config(16, num_warps=1, num_stages=3, gps=2, deq=True), Q4Config(16, num_warps=1, num_stages=3, gps=2),
         Q4Config(64, num_warps=4, num_stages=3, gps=2, deq=True), Q4Config(64, num_warps=4, num_stages=3, gps=2),
         Q4Config(16, num_warps=1, num_stages=3, gps=2, xsum=False), Q4Config(64, num_warps=4, num_stages=3, gps=2, xsum=False),
         Q4Config(32, num_warps=2, num_stages=4, gps=1), Q4Config(32, num_warps=1, num_stages=3, gps=2, deq=True),
         Q4Config(64, num_warps=2, num_stages=3, gps=2, deq=True), Q4Config(128, num_warps=4, num_stages=3, gps=1, deq=True),
         Q4Config(32, num_warps=2, num_stages=3, gps=4, deq=True), Q4Config(32, num_warps=2, num_stages=2, gps=2, deq=True),
         Q4Config(32, num_warps=2, num_stages=3, gps=2, asm=False), Q4Config(32, num_warps=2, num_stages=3, gps=2, deq=True, asm=False)]
    c += [Q4Config(32, num_warps=2, num_stages=3, gps=1, prefetch=True), Q4Config(32, num_warps=2, num_stages=2, gps=2,
          prefetch=True), Q4Config(32, num_warps=2, num_stages=3, gps=2, prefetch=True, deq=True)]
    if n < 65536:
        c += [Q4Config(32, split_k=4, num_warps=2, num_stages=3, gps=2), Q4Config(32, split_k=8, num_warps=2, num_stages=3),
              Q4Config(32, split_k=4, num_warps=2, num_stages=3, gps=2, prefetch=True),
              Q4Config(32, split_k=2, num_warps=2, num_stages=3, gps=2, deq=True),
              Q4Config(16, split_k=2, num_warps=1, num_stages=3, gps=2, deq=True),
              Q4Config(32, split_k=2, num_warps=2, num_stages=3, gps=2, xsum=False),
              Q4Config(32, split_k=2, num_warps=2, num_stages=3, gps=2, deq=True, sem=False)]
    return c


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


def bench_q4(res: dict, budget: float, group: int = 128, shapes=None, full: bool = True) -> None:
    print(f"\n== 4-bit GEMV, group {group}: parity, bitwise row invariance, time (us, % of 4.17 TB/s) ==", flush=True)
    for n, k in shapes or SHAPES:
        qw0 = random_q4(n, k, group)
        nbytes = qw0.nbytes()
        copies = max(1, min(8, math.ceil(400e6 / nbytes)))
        qws = [qw0] + [random_q4(n, k, group) for _ in range(copies - 1)]
        x16 = torch.randn(16, k, device=DEV, dtype=BF)
        ref = x16.float() @ qw0.dequantize().t()
        cands = [q4_config(n, k, group), v1_config(n, k, group)]
        if full:
            cands += [c for c in candidates(n) if c not in cands]
        rows = []
        for cfg in cands:
            if elapsed() > budget and cfg not in cands[:2]:
                rows.append({"cfg": cfg.__dict__, "skipped": "time budget"})
                continue
            rec = {"cfg": cfg.__dict__}
            try:
                y = q4_gemv(x16, qw0, cfg)
                rec["rel_err"] = rel(y, ref)
                rec["row_invariant"] = row_invariant(lambda t: q4_gemv(t, qw0, cfg), x16)
                rec["repeat_equal"] = torch.equal(q4_gemv(x16, qw0, cfg), y)
                for m in ROWS:
                    if m in (4, 8) and cfg not in cands[:2]:
                        continue
                    t = graph_time([lambda w=w: q4_gemv(x16[:m], w, cfg) for w in qws])
                    rec[f"us_M{m}"] = t * 1e6
                    rec[f"frac_M{m}"] = nbytes / t / PEAK
            except Exception as e:  # a config the compiler refuses is reported, not fatal
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(rec)
        ti4 = torch_int4(n, k, group) if not SMOKE else None
        i4 = {}
        if ti4 is not None:
            fns = [ti4] + [torch_int4(n, k, group) for _ in range(3)]
            for m in (1, 16):
                t = graph_time([lambda f=f: f(x16[:m]) for f in fns])
                i4[f"us_M{m}"] = t * 1e6
                i4[f"frac_M{m}"] = (n * k // 2 + n * k // group * 4) / t / PEAK
            i4["row_invariant"] = row_invariant(ti4, x16)
        entry = {"group": group, "shape": [n, k], "bytes": nbytes, "copies": copies, "configs": rows,
                 "best": None, "torch_int4": i4}
        res["q4"].append(entry)
        ok = [r for r in rows if "us_M1" in r and r.get("row_invariant") and r.get("rel_err", 1) < 1e-2
              and r["cfg"]["version"] == 2]
        best = min(ok, key=lambda r: r["us_M1"] + r["us_M16"]) if ok else None
        entry["best"] = best["cfg"] if best else None
        for r in rows:
            if "us_M1" not in r:
                print(f"  {n:>6}x{k:<6} {r['cfg']}: {r.get('error') or r.get('skipped')}")
                continue
            c = r["cfg"]
            tag = (f"v{c['version']} bn{c['block_n']} sk{c['split_k']} w{c['num_warps']} s{c['num_stages']} "
                   f"gps{c['gps']}{' deq' if c['deq'] else ''}{'' if c['asm'] else ' noasm'}"
                   f"{'' if c['xsum'] or c['deq'] else ' inxs'}"
                   f"{'' if c['sem'] or c['split_k'] == 1 else ' 2launch'}{' pf' if c.get('prefetch') else ''}")
            mark = " <- best" if r is best else (" (default)" if r is rows[0] else "")
            print(f"  {n:>6}x{k:<6} {tag:<40} M1 {r['us_M1']:7.1f} us {r['frac_M1']:6.1%}  M16 {r['us_M16']:7.1f} us "
                  f"{r['frac_M16']:6.1%}  err {r['rel_err']:.1e} inv {r['row_invariant']}{mark}")
        if i4:
            print(f"  {n:>6}x{k:<6} torch _weight_int4pack_mm                 M1 {i4['us_M1']:7.1f} us "
                  f"{i4['frac_M1']:6.1%}  M16 {i4['us_M16']:7.1f} us {i4['frac_M16']:6.1%}  inv {i4['row_invariant']}")
        del qws, qw0
        if not SMOKE:
            torch.cuda.empty_cache()
        print(f"  [{elapsed():.0f} s]", flush=True)


def bench_q8(res: dict, budget: float) -> None:
    seq, hq, hkv, d = (33014, 24, 4, 256) if not SMOKE else (200, 6, 2, 64)
    rows = (1, 2, 3, 4, 5, 8) if not SMOKE else (1, 3)
    print(f"\n== KV attention at {seq} positions, {hq}/{hkv} heads, head_dim {d}: bf16 vs Q8 ==", flush=True)
    max_seq = seq + 24
    caches = {"bf16": [], "q8": []}
    for _ in range(2):
        k = torch.randn(max_seq, hkv, d, device=DEV, dtype=BF)
        v = torch.randn(max_seq, hkv, d, device=DEV, dtype=BF)
        caches["bf16"].append((k, v, None, None))
        kq, ks = A.quantize_q8(k)
        vq, vs = A.quantize_q8(v)
        caches["q8"].append((kq, vq, ks, vs))
    qs = {r: torch.randn(r, hq, d, device=DEV, dtype=BF) * 2 for r in rows}
    scale = d ** -0.5
    per_pos = {"bf16": hkv * d * 2 * 2, "q8": hkv * d * 2 + hkv * (d // A.q8_group(d)) * 2 * 2}
    d64 = {"block_n": 64, "num_stages": 2}      # the shared default tile before the Q8 fp16 path got its own
    variants = [("bf16", {}), ("q8", {"q8_mode": 0, **d64}), ("q8", {}),
                ("q8", {"q8_mode": 1, **d64}), ("q8", {"q8_mode": 2, **d64}),
                ("q8", {"q8_mode": 2, "prefetch": False, **d64}), ("q8", {"q8_mode": 1, "prefetch": False, **d64}),
                ("q8", {"q8_mode": 1, "block_n": 32, "num_stages": 3}),
                ("q8", {"q8_mode": 2, "block_n": 32, "num_stages": 3, "prefetch": False}),
                ("q8", {"q8_mode": 2, "block_n": 16, "num_stages": 3}),
                ("q8", {"q8_mode": 2, "num_warps": 8, **d64}), ("q8", {"q8_mode": 2, "split": 1024, **d64})]
    if SMOKE:
        variants = [("bf16", {"split": 64, "block_n": 16}), ("q8", {"q8_mode": 0, "split": 64, "block_n": 16}),
                    ("q8", {"q8_mode": 1, "split": 64, "block_n": 16})]
    out = []
    for kind, kw in variants:
        if elapsed() > budget:
            out.append({"kv": kind, "kw": kw, "skipped": "time budget"})
            continue
        kc, vc, ks, vs = caches[kind][0]
        rec = {"kv": kind, "kw": kw, "rows": {}}
        try:
            for r in rows:
                q = qs[r]
                o = attention_rows_triton(q, kc, vc, seq, scale, ks, vs, **kw)
                ref = (A.attention_rows_ref(q, kc, vc, seq, scale) if ks is None
                       else A.attention_rows_q8_ref(q, kc, vc, seq, scale, ks, vs))
                inv = all(torch.equal(attention_rows_triton(q[i:i + 1], kc, vc, seq + i, scale, ks, vs, **kw)[0], o[i])
                          for i in range(r))
                t = graph_time([lambda c=c: attention_rows_triton(q, c[0], c[1], seq, scale, c[2], c[3], **kw)
                                for c in caches[kind]])
                rec["rows"][r] = {"rel_err": rel(o, ref), "row_invariant": inv, "us": t * 1e6,
                                  "frac": per_pos[kind] * (seq + r) / t / PEAK}
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        out.append(rec)
        line = " ".join(f"R{r}:{v['us']:.1f}us/{v['frac']:.0%}/{'inv' if v['row_invariant'] else 'NOT-INV'}"
                        f"/{v['rel_err']:.1e}" for r, v in rec["rows"].items())
        print(f"  {kind:<4} {str(kw):<48} {line} {rec.get('error', '')}", flush=True)
    res["q8"] = {"seq": seq, "geometry": [hq, hkv, d], "variants": out}


def bench_e2e(res: dict, budget: float, shapes: str) -> None:
    """Random-weight trunks with 4-bit projections built on the GPU; AR decode through CUDA graphs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from decode import build, make_cfg
    from specfire.config import ModelConfig
    from specfire.model.qwen35 import Linear, Qwen35Trunk
    from specfire.runtime.trunk import LocalTrunk

    print("\n== end to end: 4-bit random-weight trunk, AR decode (CUDA graphs), verify rows ==", flush=True)
    res.setdefault("e2e", [])
    for shape in shapes.split(","):
        if elapsed() > budget:
            res["e2e"].append({"shape": shape, "skipped": "time budget"})
            continue
        t0 = time.time()
        if SMOKE:
            cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                              layer_types=("linear_attention",) * 3 + ("full_attention",), tie_word_embeddings=False)
        else:
            cfg = make_cfg(shape)
        with torch.device("meta"):
            m = Qwen35Trunk(cfg)
        keep = ("in_proj_a", "in_proj_b")
        dense_bytes, q_bytes = 0, 0
        for name, mod in list(m.named_modules()):
            if isinstance(mod, Linear) and not name.endswith(keep):
                n, k = mod.weight.shape
                del mod.weight
                mod.weight = random_q4(n, k, 128)
                q_bytes += mod.weight.nbytes()
        m = m.to(BF).to_empty(device=DEV)
        g = torch.Generator(device=DEV).manual_seed(0)
        with torch.no_grad():
            for name, p in m.named_parameters():
                scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g, device=DEV, dtype=BF) * scale)
                if name != "embed_tokens.weight" or m.lm_head is None:  # a tied lm_head reads it all
                    dense_bytes += p.numel() * p.element_size()
        build_s = time.time() - t0
        prompt, tokens = (64, 48) if not SMOKE else (8, 4)
        trunk = LocalTrunk(m, prompt + tokens + 64, BF, cuda_graphs=not SMOKE)
        trunk.begin()
        sync = torch.cuda.synchronize if not SMOKE else (lambda: None)
        ids = torch.randint(0, cfg.vocab_size, (prompt,), device=DEV)
        r = trunk.prefill(ids)
        last, pos = int(r.logits[-1].argmax()), prompt
        for _ in range(3):
            r = trunk.verify(torch.tensor([last], device=DEV), pos)
            trunk.commit(0)
            last, pos = int(r.logits[0].argmax()), pos + 1
        sync()
        t1 = time.perf_counter()
        for _ in range(tokens):
            r = trunk.verify(torch.tensor([last], device=DEV), pos)
            trunk.commit(0)
            last, pos = int(r.logits[0].argmax()), pos + 1
        sync()
        dt = (time.perf_counter() - t1) / tokens
        kv = cfg.n_full * 2 * pos * cfg.num_key_value_heads * cfg.head_dim * 2
        st = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        step = q_bytes + dense_bytes + kv + st
        rec = {"shape": shape, "build_s": build_s, "weights_4bit_bytes": q_bytes, "dense_bytes": dense_bytes,
               "step_bytes": step, "decode_ms": dt * 1e3, "tok_s": 1 / dt, "ceiling_tok_s": PEAK / step,
               "bw_frac": step / dt / PEAK}
        for rr in (1, 2, 4):
            ids_r = torch.randint(0, cfg.vocab_size, (rr,), device=DEV)
            trunk.verify(ids_r, pos)
            trunk.commit(0)
            sync()
            t1 = time.perf_counter()
            for _ in range(8):
                trunk.verify(ids_r, pos)
                trunk.commit(0)
            sync()
            rec[f"verify{rr}_ms"] = (time.perf_counter() - t1) / 8 * 1e3
        rec["verify4_over_verify1"] = rec["verify4_ms"] / rec["verify1_ms"]
        print(f"  {shape}: build {build_s:.0f} s, step {step / 1e9:.2f} GB, AR {rec['tok_s']:.1f} tok/s "
              f"({rec['bw_frac']:.1%} of 4.17 TB/s; ceiling {rec['ceiling_tok_s']:.0f} tok/s); verify 1/2/4 rows "
              f"{rec['verify1_ms']:.2f}/{rec['verify2_ms']:.2f}/{rec['verify4_ms']:.2f} ms", flush=True)
        res["e2e"].append(rec)
        del trunk, m
        if not SMOKE:
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=215.0, help="seconds; later sweeps are skipped past it")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--e2e", default="27B,4B")
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    import triton
    res = {"gpu": "cpu-smoke" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "q4": [], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{res['gpu']} torch {res['torch']} triton {res['triton']}", flush=True)
    path = os.path.join(args.out, "quant_gpu.json")
    skip = set(args.skip.split(","))
    b = args.budget
    e2e = args.e2e.split(",")
    steps = [("q4", lambda: bench_q4(res, 0.45 * b)),
             ("q8", lambda: bench_q8(res, 0.62 * b)),
             ("e2e", lambda: bench_e2e(res, 0.75 * b, e2e[0])),
             ("q4g", lambda: bench_q4(res, 0.85 * b, 64, SHAPES[:1] + SHAPES[-1:], full=False)),
             ("e2e2", lambda: bench_e2e(res, 0.9 * b, ",".join(e2e[1:])) if len(e2e) > 1 else None)]
    for name, fn in steps:
        if name in skip:
            continue
        try:
            fn()
        except Exception as e:
            import traceback
            traceback.print_exc()
            res[name + "_error"] = f"{type(e).__name__}: {e}"
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"[{name} done at {elapsed():.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
