"""Fused decode kernels on one GPU (kernels/gdn/fused.py, kernels/attention/fused.py): parity, speed, identity.

One call, stages in order, results written to $OUT/fuse.json as each ends (a timeout keeps them):
1. parity:  the fused kernels vs their PyTorch references at the real shapes (27B GDN and
            attention heads, 1..4 rows, bf16; the GDN layer with its gated norm folded in and in
            the split form), rows at once == chained single rows bit for bit, a shard of heads ==
            those heads of the whole bit for bit.
2. sweep:   the fused GDN launch forms at the 27B heads with 16 rotating input sets (the states
            do not stay in L2, as in a step): whole-head programs (gated norm inside) at 4/8/16
            warps vs heads split in 32/64 columns + the norm kernel; the fastest is kept.
3. llm:     random weights of a real shape (27B) and an MTP head built on the GPU, served through
            `LLM.generate` (no checkpoint written): AR tok/s with % of 4.17 TB/s, the bare 1-row
            and 4-row graphs replayed back to back in the same process (generate / bare), kernels
            per step by family, 4 verify rows == 4 chained decode rows (logits bit for bit),
            greedy MTP k=3 == AR; then the final norms set to -1 (every logit ties, every draft
            accepted): AR again and the MTP k=3 cycle vs an AR step.
4. bundled: the bundled model in the default one-GPU mode: AR tok/s through LLM.generate, the
            bare 1-row graph, kernels per step; greedy MTP k=3 and n-gram k=3 == AR tokens.
5. big:     the same random 27B trunk with the fusion OFF (the same process): the 1-row and
            4-row graphs, % of 4.17 TB/s, kernel families, 4 verify rows == 4 chained rows.

    python bench/fuse.py [--shape 27B] [--budget 105]
    TRITON_INTERPRET=1 python bench/fuse.py --smoke     # CPU: tiny shapes, checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import CEILING, SHAPES, build, make_cfg, step_bytes  # noqa: E402
from timing import graph_time  # noqa: E402

from specfire.kernels import fusion  # noqa: E402
from specfire.kernels.attention.fused import (out_gate_ref, out_gate_triton, qk_norm_rope_write_ref,  # noqa: E402
                                     qk_norm_rope_write_triton)
from specfire.kernels.gdn.fused import gdn_decode_ref, gdn_decode_triton  # noqa: E402

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
        z, nw = rnd(t, hv * dv, scale=2), 1 + rnd(dv, scale=0.2)
        for form, kw in (("split", dict(bv=min(32, dv), num_warps=1)), ("norm", dict(z=z, norm_w=nw))):
            zz = z if form == "norm" else None
            o, log, full = gdn_decode_triton(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, **kw)
            ro, rlog, rfull = gdn_decode_ref(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, zz, nw)
            res[f"gdn_{form}_rows{t}"] = {"o_err": _err(o, ro),
                                          "state_err": _err(_committed(s, log, t), _committed(s, rlog, t)),
                                          "full_equal": torch.equal(full, rfull)}
            if t == 4:
                res[f"gdn_{form}_rows_invariant"] = rows_detail(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, o, log,
                                                                 full, zz, kw)
                h2, k2 = hv // 2, hk // 2
                ch = torch.cat([torch.arange(k2 * dk), hk * dk + torch.arange(k2 * dk),
                                2 * hk * dk + torch.arange(h2 * dv)]).to(dev)
                kw2 = dict(kw, z=z[:, :h2 * dv]) if form == "norm" else kw
                o2, l2, _ = gdn_decode_triton(qkv[:, ch].contiguous(), a[:, :h2].contiguous(), b[:, :h2].contiguous(),
                                              win[:, ch].contiguous(), w[ch].contiguous(), alog[:h2], dtb[:h2],
                                              s[:h2].contiguous(), k2, dk, dv, **kw2)
                res[f"gdn_{form}_half_heads_equal"] = torch.equal(o2, o[:, :h2]) and all(
                    torch.equal(x, y[:, :h2]) for x, y in zip(l2, log))
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
    res["pass"] = (res["max_err"] < 3e-2
                   and all(v["all"] for k, v in res.items() if k.endswith("_rows_invariant") and isinstance(v, dict))
                   and all(v for k, v in res.items() if k.endswith("_half_heads_equal"))
                   and res["attn_rows_invariant"]
                   and all(d_["full_equal"] for k, d_ in res.items() if k.startswith("gdn_") and isinstance(d_, dict) and "full_equal" in d_)
                   and all(d_["v_equal"] for k, d_ in res.items() if k.startswith("attn_rows") and isinstance(d_, dict)))
    rep.put("parity", res)


def _committed(s, log, rows):
    """The state after the first `rows` rows of a log (the commit: kernels/gdn commit_rows)."""
    from specfire.kernels.gdn import commit_rows
    st = s[None].clone()
    commit_rows(st, *(x[None].contiguous() for x in log), rows)
    return st[0]


def rows_detail(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, o, log, full, z, kw) -> dict:
    """Which rows of a 4-row call differ from chained single rows (outputs; the state each commit
    leaves), and whether a 2-row call equals the first two rows of the 4-row call (no single-row
    binary involved)."""
    kk = w.shape[-1]
    det, cs, cw = {}, s, win
    for i in range(qkv.shape[0]):
        kwi = dict(kw, z=z[i:i + 1]) if z is not None else kw
        o1, l1, _ = gdn_decode_triton(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cw, w, alog, dtb, cs, hk, dk, dv, **kwi)
        cs, cw = _committed(cs, l1, 1), full[i + 1:i + kk]
        det[f"row{i}"] = [bool(torch.equal(o1[0], o[i])), bool(torch.equal(cs, _committed(s, log, i + 1)))]
    kw2 = dict(kw, z=z[:2]) if z is not None else kw
    o2, l2, _ = gdn_decode_triton(qkv[:2], a[:2], b[:2], win, w, alog, dtb, s, hk, dk, dv, **kw2)
    det["rows2_prefix"] = [bool(torch.equal(o2, o[:2])), all(bool(torch.equal(x, y[:2])) for x, y in zip(l2, log))]
    det["all"] = all(all(v) for v in det.values())
    return det


def stage_norms(rep: Report, dev: str) -> None:
    """Warps per row of the hidden-size add+RMSNorm (27B: 5120) timed inside a CUDA graph; the
    fastest is kept (kernels/small/kernel.py NORM_WARPS)."""
    from specfire.kernels.small import kernel as triton_small
    from specfire.kernels.norm import kernel as triton_norm
    if dev != "cuda":
        return
    x, h = (torch.randn(1, 5120, device=dev).to(torch.bfloat16) for _ in range(2))
    wt = torch.randn(5120, device=dev).to(torch.bfloat16)
    times = {}
    for nw in (4, 8, 16, 32):
        triton_norm.NORM_WARPS = nw
        times[f"w{nw}"] = graph_time([lambda: triton_norm.add_rms_norm_triton(x, h, wt, 1e-6)]) * 1e6
    best = min(times, key=times.get)
    triton_norm.NORM_WARPS = int(best[1:])
    rep.put("norms", {"add_rms_norm_5120_us": times, "pick": best})


SWEEP = (("whole_w4", None, 4), ("whole_w8", None, 8), ("whole_w16", None, 16), ("split32_w1", 32, 1),
         ("split64_w2", 64, 2))      # split32_w1: the first version's form (its norm a second launch)


def stage_sweep(rep: Report, dev: str, tiny: bool) -> None:
    """Launch forms of the fused GDN layer (gated norm included: inside for whole heads, its own
    kernel after split heads) at the real shape, 1 row, in a CUDA graph over 16 rotating input
    sets (~50 MB of states: not L2-resident, as in a step); the fastest is kept."""
    from specfire.kernels.gdn import fused as gdn_fused
    g = torch.Generator(device=dev).manual_seed(0)
    hk, hv, dk, dv, kk = (2, 4, 8, 8, 4) if tiny else (16, 48, 128, 128, 4)
    c = 2 * hk * dk + hv * dv
    sets = []
    for _ in range(2 if tiny else 16):
        x = [torch.randn(1, n, generator=g, device=dev).to(torch.bfloat16) for n in (c, hv, hv, hv * dv)]
        sets.append((x, torch.randn(kk - 1, c, generator=g, device=dev), torch.randn(hv, dk, dv, generator=g, device=dev)))
    w = torch.randn(c, kk, generator=g, device=dev).to(torch.bfloat16)
    alog, dtb, nw = (torch.randn(n, generator=g, device=dev).to(torch.bfloat16) for n in (hv, hv, dv))
    times, outs = {}, {}
    for name, bv, nwarp in SWEEP:
        def fn(i, bv=bv, nwarp=nwarp):
            (qkv, a, b, z), win, s = sets[i]
            return gdn_decode_triton(qkv, a, b, win, w, alog, dtb, s, hk, dk, dv, z, nw, 1e-6, bv=bv, num_warps=nwarp)
        outs[name] = fn(0)
        if dev == "cuda":
            times[name] = graph_time([lambda i=i, f=fn: f(i) for i in range(len(sets))], iters=32) * 1e6   # us per layer
    flat = {n: [o[0], *o[1], o[2]] for n, o in outs.items()}        # o, the log (k, delta, dec), full
    same = {n: [bool(torch.equal(x, y)) for x, y in zip(f, flat["whole_w8"])] for n, f in flat.items()}
    res = {"gdn_layer_us": times, "bits_equal_whole_w8": same}
    if times:
        best = min(times, key=times.get)
        gdn_fused.BV, gdn_fused.NUM_WARPS = dict((n, (b_, w_)) for n, b_, w_ in SWEEP)[best]
        res["pick"] = best
    rep.put("sweep", res)


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


def stage_bundled(rep: Report, dev: str, tokens: int, out: str, fuse_modes: tuple[bool, ...]) -> None:
    """The bundled model as `LLM(device=...)` serves it by default on one GPU (no canonical split)."""
    from engine_gpu import PROMPTS, bare_trunk, run_modes

    from specfire import LLM, SpecPolicy
    for on in fuse_modes:
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


def rows_check(trunk, vocab: int, prompt: int, dev: str) -> bool:
    """4 verify rows at once == the same 4 rows as chained 1-row decodes (logits bit for bit)."""
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, vocab, (prompt,), device=dev, generator=gen)
    drafts = torch.randint(0, vocab, (4,), device=dev, generator=gen)
    trunk.begin()
    trunk.prefill(ids)
    r4 = trunk.verify(drafts, prompt).logits.clone()                # 4 rows at once (captures that graph)
    chained = []
    for i in range(4):                                              # the same rows one at a time
        chained.append(trunk.verify(drafts[i:i + 1], prompt + i).logits[0].clone())
        trunk.commit(0)
    return bool(torch.equal(r4, torch.stack(chained)))


class Model:
    """The random-weight trunk of a shape, built once on the device and shared by the stages."""

    def __init__(self, dev: str, shape: str):
        self.dev, self.shape, self._m = dev, shape, None
        self.cfg = make_cfg(shape)
        if shape == "tiny":
            self.cfg = dataclasses.replace(self.cfg, vocab_size=512, head_dim=16, linear_key_head_dim=16,
                                           linear_value_head_dim=16)
        self.dtype = torch.bfloat16 if dev == "cuda" else torch.float32

    def get(self):
        if self._m is None:
            self._m = build(self.cfg, self.dev, self.dtype)
        return self._m


def stage_llm(rep: Report, model: Model, prompt: int, tokens: int, out: str) -> None:
    from synthetic import random_head

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.parallel.probe import time_rows
    from specfire.runtime import build as rt_build
    from specfire.runtime.trunk import LocalTrunk

    dev, cfg, dtype = model.dev, model.cfg, model.dtype
    m = model.get()
    head = random_head(cfg, dev, dtype)
    d = tempfile.mkdtemp()
    body = cfg.to_hf_text_dict()
    body["eos_token_id"] = [cfg.vocab_size - 1]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(body, f)
    local = rt_build.local_trunk
    rt_build.local_trunk = lambda opts: rt_build.BuiltTrunk(LocalTrunk(m, opts.max_seq_len, opts.kv_dtype, opts.cuda_graphs),
                                                             head, "single")
    fusion.set_enabled(None)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    try:
        with LLM(d, device=dev, dtype=dtype, progress=False, max_seq_len=prompt + 2 * tokens + 64) as llm:
            trunk = llm.engine.trunk
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, cfg.vocab_size - 1, (prompt,), generator=g).tolist()
            nbytes = step_bytes(m, prompt + tokens // 2, torch.tensor([], dtype=dtype).element_size())
            res: dict = {"shape": model.shape, "graphs": trunk.graphs_enabled, "step_bytes": nbytes,
                         "ceiling_tok_s": CEILING / nbytes}
            for tag in ("normal", "tied"):
                if tag == "tied":      # final norms -1: every logit ties, greedy picks 0, every draft accepted
                    with torch.no_grad():
                        m.norm.weight.fill_(-1.0)
                        head.norm.weight.fill_(-1.0)
                llm.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), spec="off")      # compile, capture
                ar = llm.generate(ids, sp, spec="off")
                llm.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), spec=SpecPolicy("mtp", k=3))
                mtp = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
                ar_s = ar.stats["decode_tok_s"]
                cyc = mtp.stats["decode_s"] / max(1, mtp.stats["cycles"])
                r = {"ar_tok_s": ar_s, "ar_step_ms": 1e3 / ar_s, "ar_bw_frac": nbytes * ar_s / CEILING,
                     "mtp3_tok_s": mtp.stats["decode_tok_s"], "mtp3_tau": mtp.stats["mean_accept_len"],
                     "mtp3_cycle_ms": cyc * 1e3, "mtp3_cycle_vs_ar_step": cyc * ar_s,
                     "mtp3_equals_ar": mtp.token_ids == ar.token_ids, "generated": len(ar.token_ids),
                     "prefill_tok_s": ar.stats["prefill_tok_s"]}
                if dev == "cuda":
                    t1, t4 = time_rows(trunk, 1, 50), time_rows(trunk, 4, 20)
                    r.update(bare_graph1_ms=t1 * 1e3, bare_graph4_ms=t4 * 1e3, bare_bw_frac=nbytes / t1 / CEILING,
                             generate_vs_bare=ar_s * t1, verify4_over_step=t4 / t1)
                rep.put(f"llm_{tag}", r)
                res[tag] = r
            with torch.no_grad():
                m.norm.weight.normal_(0, 0.1, generator=torch.Generator(device=dev).manual_seed(5))
            res["rows4_equal_chained_rows"] = rows_check(trunk, cfg.vocab_size, prompt, dev)
            if dev == "cuda":
                res["profile"] = kernels_per_step(trunk, 1, os.path.join(out, f"prof_{model.shape}_llm"))
            rep.put("llm", {k: v for k, v in res.items() if k not in ("normal", "tied")})
    finally:
        rt_build.local_trunk = local
        shutil.rmtree(d, ignore_errors=True)
        del head
        if dev == "cuda":
            torch.cuda.empty_cache()


def stage_big(rep: Report, model: Model, prompt: int, out: str, fuse_modes: tuple[bool, ...]) -> None:
    from specfire.parallel.probe import time_rows
    from specfire.runtime.trunk import LocalTrunk
    dev, m = model.dev, model.get()
    nbytes = step_bytes(m, prompt + 4, torch.tensor([], dtype=model.dtype).element_size())
    for on in fuse_modes:
        fusion.set_enabled(on)
        trunk = LocalTrunk(m, prompt + 64, model.dtype, cuda_graphs=dev == "cuda")
        res = {"rows4_equal_chained_rows": rows_check(trunk, model.cfg.vocab_size, prompt, dev), "step_bytes": nbytes}
        if dev == "cuda":
            t1 = time_rows(trunk, 1, 50)
            t4 = time_rows(trunk, 4, 20)
            res.update(graph1_ms=t1 * 1e3, graph4_ms=t4 * 1e3, tok_s=1 / t1, bw_frac=nbytes / t1 / CEILING,
                       verify4_over_step=t4 / t1)
            res["profile"] = kernels_per_step(trunk, 1, os.path.join(out, f"prof_{model.shape}_{int(on)}"))
        rep.put(f"{model.shape}_fuse{int(on)}", res)
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
    ap.add_argument("--big-tokens", type=int, default=64, help="new tokens per request of the llm stage")
    ap.add_argument("--stages", default="parity,sweep,llm,bundled,big")
    ap.add_argument("--big-fuse", default="0", help="fusion settings of the big stage: 0, 1 or 0,1")
    ap.add_argument("--bundled-fuse", default="1", help="fusion settings of the bundled stage: 0, 1 or 0,1")
    ap.add_argument("--budget", type=float, default=105.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny shapes")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = os.environ.get("OUT") or "/tmp/fuse_out"
    os.makedirs(out, exist_ok=True)
    if args.smoke:
        args.shape, args.prompt, args.tokens, args.big_tokens = "tiny", 24, 8, 8
    rep = Report(out)
    rep.put("setup", {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                      "shape": args.shape, "prompt": args.prompt, "tokens": args.tokens, "big_tokens": args.big_tokens})
    model = Model(dev, args.shape)
    flags = lambda v: tuple(x == "1" for x in v.split(","))  # noqa: E731
    stages = {"parity": lambda: stage_parity(rep, dev, args.smoke),
              "sweep": lambda: stage_sweep(rep, dev, args.smoke),
              "norms": lambda: stage_norms(rep, dev),
              "llm": lambda: stage_llm(rep, model, args.prompt, args.big_tokens, out),
              "bundled": lambda: stage_bundled(rep, dev, args.tokens, out, flags(args.bundled_fuse)),
              "big": lambda: stage_big(rep, model, args.prompt, out, flags(args.big_fuse))}
    for name in args.stages.split(","):
        if time.time() - T0 > args.budget:
            rep.put(f"{name}_skipped", f"budget {args.budget}s spent")
            continue
        try:
            stages[name]()
        except Exception as e:  # noqa: BLE001 - a failed stage is reported, the next one runs
            rep.put(f"{name}_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    rep.put("done", {"seconds": time.time() - T0})


if __name__ == "__main__":
    main()
