"""Fused decode kernels on one GPU (ops/gdn_fused.py, ops/attn_fused.py): parity, speed, identity.

One call, stages in order, results written to $OUT/fuse.json as each ends (a timeout keeps them):
1. parity:  the fused kernels vs their PyTorch references at the real shapes (27B GDN and
            attention heads, 1..4 rows, bf16), rows at once == chained single rows bit for bit,
            a shard of heads == those heads of the whole bit for bit.
2. bundled: the bundled model, fusion off then on: AR tok/s through LLM.generate, the bare 1-row
            graph, kernels per step; with fusion on greedy MTP k=3 and n-gram k=3 == AR tokens.
3. big:     random weights of a real shape (27B): the 1-row and 4-row graphs replayed back to back
            (parallel/probe.py time_rows), fusion off then on, % of 4.17 TB/s, kernels per step by
            family, and 4 verify rows == 4 chained decode rows bit for bit (logits).

    python bench/fuse.py [--shape 27B] [--budget 180]
    TRITON_INTERPRET=1 python bench/fuse.py --smoke     # CPU: tiny shapes, checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import CEILING, SHAPES, build, make_cfg, step_bytes  # noqa: E402
from timing import graph_time  # noqa: E402

from specfire.ops import fusion  # noqa: E402
from specfire.ops.attn_fused import (out_gate_ref, out_gate_triton, qk_norm_rope_write_ref,  # noqa: E402
                                     qk_norm_rope_write_triton)
from specfire.ops.gdn_fused import gdn_decode_ref, gdn_decode_triton  # noqa: E402

SHAPES["tiny"] = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False)
T0 = time.time()


class Report:
    def __init__(self, out: str | None):
        self.data: dict = {"ceiling_Bps": CEILING}
        self.path = os.path.join(out, "fuse.json") if out else None

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)
        print(f"[{time.time() - T0:6.1f}s] {key}: {json.dumps(value)[:900]}", flush=True)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def stage_parity(rep: Report, dev: str, tiny: bool) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dt)

    hk, hv, dk, dv, kk = (2, 4, 8, 8, 4) if tiny else (16, 48, 128, 128, 4)
    hq, hkv, d, r = (4, 2, 16, 4) if tiny else (24, 4, 256, 64)
    c = 2 * hk * dk + hv * dv
    res: dict = {}
    for t in (1, 2, 4):
        qkv, a, b = rnd(t, c), rnd(t, hv, scale=3), rnd(t, hv)
        win = torch.randn(kk - 1, c, generator=g, device=dev)
        w, alog, dtb = rnd(c, kk, scale=0.5), rnd(hv, scale=0.5), rnd(hv)
        s = torch.randn(hv, dk, dv, generator=g, device=dev) * 0.3
        o, caps, full = gdn_decode_triton(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv)
        ro, rcaps, rfull = gdn_decode_ref(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv)
        res[f"gdn_rows{t}"] = {"o_err": _err(o, ro), "caps_err": _err(caps, rcaps), "full_equal": torch.equal(full, rfull)}
        if t == 4:
            ok, cs, cw = True, s, win
            for i in range(t):
                o1, c1, _ = gdn_decode_triton(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cw, w, alog, dtb, cs, hk, dk, dv)
                ok &= torch.equal(o1[0], o[i]) and torch.equal(c1[0], caps[i])
                cs, cw = caps[i], full[i + 1:i + kk]
            res["gdn_rows_invariant"] = ok
            res["gdn_detail"] = rows_detail(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, o, caps, full)
            h2, k2 = hv // 2, hk // 2
            ch = torch.cat([torch.arange(k2 * dk), hk * dk + torch.arange(k2 * dk), 2 * hk * dk + torch.arange(h2 * dv)]).to(dev)
            o2, c2, _ = gdn_decode_triton(qkv[:, ch].contiguous(), a[:, :h2].contiguous(), b[:, :h2].contiguous(),
                                          win[:, ch].contiguous(), w[ch].contiguous(), alog[:h2], dtb[:h2],
                                          s[:h2].contiguous(), k2, dk, dv)
            res["gdn_half_heads_equal"] = torch.equal(o2, o[:, :h2]) and torch.equal(c2, caps[:, :h2])
        qg, kx, vx = rnd(t, hq, 2 * d), rnd(t, hkv, d), rnd(t, hkv, d)
        qw, kw = rnd(d, scale=0.1), rnd(d, scale=0.1)
        f = (torch.arange(t, device=dev, dtype=torch.float32)[:, None] + 700) * torch.rand(r // 2, generator=g, device=dev)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        kc, vc = rnd(1024, hkv, d), rnd(1024, hkv, d)
        kc2, vc2 = kc.clone(), vc.clone()
        pos = torch.tensor([700], device=dev)
        q = qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc, vc, pos)
        rq = qk_norm_rope_write_ref(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc2, vc2, 700)
        ao = torch.randn(t, hq, d, generator=g, device=dev)
        res[f"attn_rows{t}"] = {"q_err": _err(q, rq), "k_err": _err(kc, kc2), "v_equal": torch.equal(vc, vc2),
                                "q_bits_equal_frac": float((q == rq).float().mean()),
                                "gate_err": _err(out_gate_triton(ao, qg), out_gate_ref(ao, qg))}
        if t == 4:
            ok = True
            for i in range(t):
                k1, v1 = kc2.clone(), vc2.clone()
                q1 = qk_norm_rope_write_triton(qg[i:i + 1], kx[i:i + 1], vx[i:i + 1], qw, kw, 1e-6, cos[i:i + 1],
                                               sin[i:i + 1], k1, v1, torch.tensor([700 + i], device=dev))
                ok &= torch.equal(q1[0], q[i]) and torch.equal(k1[700 + i], kc[700 + i])
            res["attn_rows_invariant"] = ok
    errs = [v for k, d_ in res.items() if isinstance(d_, dict) for kk_, v in d_.items() if kk_.endswith("_err")]
    res["max_err"] = max(errs)
    res["pass"] = (res["max_err"] < 2e-2 and res["gdn_rows_invariant"] and res["gdn_half_heads_equal"]
                   and res["attn_rows_invariant"] and all(d_["full_equal"] for k, d_ in res.items() if k.startswith("gdn_rows") and isinstance(d_, dict))
                   and all(d_["v_equal"] for k, d_ in res.items() if k.startswith("attn_rows") and isinstance(d_, dict)))
    rep.put("parity", res)


def rows_detail(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, o, caps, full) -> dict:
    """Which rows of a 4-row call differ from single rows, and whether a 2-row call equals the
    first two rows of the 4-row call (no single-row binary involved)."""
    kk = w.shape[-1]
    det, cs, cw = {}, s, win
    for i in range(qkv.shape[0]):
        o1, c1, _ = gdn_decode_triton(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cw, w, alog, dtb, cs, hk, dk, dv)
        det[f"row{i}"] = [bool(torch.equal(o1[0], o[i])), bool(torch.equal(c1[0], caps[i]))]
        cs, cw = caps[i], full[i + 1:i + kk]
    o2, c2, _ = gdn_decode_triton(qkv[:2], a[:2], b[:2], win, w, alog, dtb, s, hk, dk, dv)
    det["rows2_prefix"] = [bool(torch.equal(o2, o[:2])), bool(torch.equal(c2, caps[:2]))]
    return det


def stage_norms(rep: Report, dev: str) -> None:
    """Warps per row of the hidden-size add+RMSNorm (27B: 5120) timed inside a CUDA graph; the
    fastest is kept (ops/triton_small.py NORM_WARPS)."""
    from specfire.ops import triton_small
    if dev != "cuda":
        return
    x, h = (torch.randn(1, 5120, device=dev).to(torch.bfloat16) for _ in range(2))
    wt = torch.randn(5120, device=dev).to(torch.bfloat16)
    times = {}
    for nw in (4, 8, 16, 32):
        triton_small.NORM_WARPS = nw
        times[f"w{nw}"] = graph_time([lambda: triton_small.add_rms_norm_triton(x, h, wt, 1e-6)]) * 1e6
    best = min(times, key=times.get)
    triton_small.NORM_WARPS = int(best[1:])
    rep.put("norms", {"add_rms_norm_5120_us": times, "pick": best})


def stage_sweep(rep: Report, dev: str, tiny: bool) -> None:
    """Launch settings of the fused GDN kernel at the real shape, 1 row, timed inside a CUDA graph
    (20 launches back to back); the fastest is kept for the stages after this one."""
    from specfire.ops import gdn_fused
    g = torch.Generator(device=dev).manual_seed(0)
    hk, hv, dk, dv, kk = (2, 4, 8, 8, 4) if tiny else (16, 48, 128, 128, 4)
    c = 2 * hk * dk + hv * dv
    x = [torch.randn(1, n, generator=g, device=dev).to(torch.bfloat16) for n in (c, hv, hv)]
    win = torch.randn(kk - 1, c, generator=g, device=dev)
    w = torch.randn(c, kk, generator=g, device=dev).to(torch.bfloat16)
    alog, dtb = (torch.randn(hv, generator=g, device=dev).to(torch.bfloat16) for _ in range(2))
    s = torch.randn(hv, dk, dv, generator=g, device=dev)
    times = {}
    for bv, nw in ((16, 1), (32, 1), (16, 2), (32, 2), (64, 2), (64, 4)):
        def fn():
            return gdn_decode_triton(*x, win, w, alog, dtb, s, hk, dk, dv, bv=bv, num_warps=nw)
        fn()
        if dev == "cuda":
            times[f"bv{bv}_w{nw}"] = graph_time([fn]) * 1e6    # us per launch
    if times:
        best = min(times, key=times.get)
        gdn_fused.BV, gdn_fused.NUM_WARPS = (int(v) for v in best[2:].split("_w"))
        rep.put("sweep", {"gdn_us_per_launch": times, "pick": best})


def kernels_per_step(trunk, rows: int, path: str) -> dict:
    """Replays the rows graph under the profiler; kernels and device us per replay by family."""
    from specfire.parallel.probe import time_rows
    sec = time_rows(trunk, rows, 20, profile=path)
    try:
        with open(path + ".rank0.json") as f:
            fams = json.load(f)["families_per_replay"]
    except OSError:
        fams = {}
    return {"graph_ms": sec * 1e3, "kernels": round(sum(v["kernels"] for v in fams.values())),
            "families": {k: {"kernels": round(v["kernels"]), "us": round(v["us"], 1)} for k, v in fams.items()}}


def stage_bundled(rep: Report, dev: str, tokens: int, out: str) -> None:
    from engine_gpu import PROMPTS, bare_trunk, run_modes

    from specfire import LLM, SpecPolicy
    for on in (False, True):
        fusion.set_enabled(on)
        with LLM(device=dev, progress=False) as llm:
            nbytes = step_bytes(llm.engine.trunk.model, 256, torch.tensor([], dtype=llm.dtype).element_size())
            modes = {"ar": "off"}
            if on:
                modes.update(mtp3=SpecPolicy("mtp", 3), ngram3=SpecPolicy("ngram", 3))
            res = run_modes(llm, PROMPTS, tokens, modes, nbytes)
            ref = res["ar"]["token_ids"]
            exact = {name: r.pop("token_ids") == ref for name, r in res.items()}
            bare = bare_trunk(llm, 256, 200) if dev == "cuda" else {}
            prof = kernels_per_step(llm.engine.trunk, 1, os.path.join(out, f"prof_bundled_{int(on)}")) if dev == "cuda" else {}
            rep.put(f"bundled_fuse{int(on)}", {"step_bytes": nbytes, "graphs": llm.engine.trunk.graphs_enabled,
                                               "exact_vs_ar": exact, **bare, **prof,
                                               **{f"{k}_tok_s": v["tok_s"] for k, v in res.items()},
                                               **{f"{k}_tau": v["mean_accept_len"] for k, v in res.items()}})
    fusion.set_enabled(None)


def stage_big(rep: Report, dev: str, shape: str, prompt: int, out: str) -> None:
    from specfire.parallel.probe import time_rows
    from specfire.runtime.trunk import LocalTrunk
    cfg = make_cfg(shape)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    m = build(cfg, dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (prompt,), device=dev, generator=gen)
    drafts = torch.randint(0, cfg.vocab_size, (4,), device=dev, generator=gen)
    nbytes = step_bytes(m, prompt + 4, torch.tensor([], dtype=dtype).element_size())
    for on in (False, True):
        fusion.set_enabled(on)
        trunk = LocalTrunk(m, prompt + 64, dtype, cuda_graphs=dev == "cuda")
        trunk.begin()
        trunk.prefill(ids)
        r4 = trunk.verify(drafts, prompt).logits                      # 4 rows at once (captures that graph)
        chained = []
        for i in range(4):                                          # the same rows one at a time
            chained.append(trunk.verify(drafts[i:i + 1], prompt + i).logits[0])
            trunk.commit(0)
        res = {"rows4_equal_chained_rows": bool(torch.equal(r4, torch.stack(chained))), "step_bytes": nbytes}
        if dev == "cuda":
            t1 = time_rows(trunk, 1, 50)
            t4 = time_rows(trunk, 4, 20)
            res.update(graph1_ms=t1 * 1e3, graph4_ms=t4 * 1e3, tok_s=1 / t1, bw_frac=nbytes / t1 / CEILING,
                       verify4_over_step=t4 / t1)
            res["profile"] = kernels_per_step(trunk, 1, os.path.join(out, f"prof_{shape}_{int(on)}"))
        rep.put(f"{shape}_fuse{int(on)}", res)
        trunk.close() if hasattr(trunk, "close") else None
        del trunk
        if dev == "cuda":
            torch.cuda.empty_cache()
    fusion.set_enabled(None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stages", default="parity,sweep,norms,bundled,big")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny shapes")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = os.environ.get("OUT") or "/tmp/fuse_out"
    os.makedirs(out, exist_ok=True)
    if args.smoke:
        args.shape, args.prompt, args.tokens = "tiny", 24, 8
    rep = Report(out)
    rep.put("setup", {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                      "shape": args.shape, "prompt": args.prompt, "tokens": args.tokens})
    stages = {"parity": lambda: stage_parity(rep, dev, args.smoke),
              "sweep": lambda: stage_sweep(rep, dev, args.smoke),
              "norms": lambda: stage_norms(rep, dev),
              "bundled": lambda: stage_bundled(rep, dev, args.tokens, out),
              "big": lambda: stage_big(rep, dev, args.shape, args.prompt, out)}
    for name in args.stages.split(","):
        if time.time() - T0 > args.budget:
            rep.put(f"{name}_skipped", f"budget {args.budget}s spent")
            continue
        try:
            stages[name]()
        except Exception as e:  # noqa: BLE001 - a failed stage is reported, the next one runs
            rep.put(f"{name}_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")


if __name__ == "__main__":
    main()
