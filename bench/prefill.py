"""Prefill and long context on one GPU, one call, results as JSON.

Random weights of a real shape (27B by default) built on the GPU, with a random MTP head; the
engine is the library's own (LocalTrunk + Engine + MtpDrafter), no checkpoint written.

1. prefill: trunk.prefill tok/s at 512 / 4096 / 33000 prompt tokens, and the fraction of the
   H200's bf16 dense tensor-core peak (989 TFLOP/s) that its matmul FLOPs reach (2 x T x layer
   weights + causal attention 4 x Hq x D x visible keys; the Gated DeltaNet recurrence is not
   counted).
2. decode: LLM-loop AR tok/s after a 512- and a 33000-token prompt, and the trunk's 1-row CUDA
   graph replayed at both positions (device time).
3. exact: greedy MTP k=3 (the random head) and an oracle drafter (AR's own tokens, one wrong draft
   every third cycle, so every verify row is compared) == AR token for token at both contexts.
4. fla: Gated DeltaNet chunk prefill, ours vs flash-linear-attention's chunk_gated_delta_rule
   (when it imports) on the 27B GDN shape at 4096 and 33000 rows (key heads grouped, as the model
   passes them), error vs the float32 reference; then prefill tok/s with it wired in (kernels/gdn/fla.py) and MTP == AR at 33000 again.
Results go to $OUT/prefill.json after every stage, so a timeout keeps what finished.

    python -m bench.prefill [--shape 27B] [--budget 200]
    python -m bench.prefill --smoke          # CPU: tiny shape, short prompts
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial

import torch

from bench.common import CEILING, model_config, model_step_bytes, random_head, random_trunk, sync
from specfire.config import FULL
from specfire.kernels import gdn as G
from specfire.kernels.gdn import fla as gdn_fla
from specfire.params import SamplingParams, SpecPolicy
from specfire.runtime.drafters import HostDrafter, MtpDrafter, NgramDrafter
from specfire.runtime.engine import Engine
from specfire.runtime.prefix import PrefixCache
from specfire.runtime.trunk import LocalTrunk

PEAK_FLOPS = 989e12      # H200 bf16 dense tensor-core peak
_FLA = gdn_fla.kernel()  # flash-linear-attention's chunk kernel where installed (the engine's default)


def use_fla(on: bool) -> None:
    """The library in (on, where installed) or out of every prefill: its memoised kernel swapped."""
    gdn_fla._kernel = _FLA if on else None


class Report:
    def __init__(self, out: str | None):
        self.data: dict = {}
        self.path = os.path.join(out, "prefill.json") if out else None
        if out:
            os.makedirs(out, exist_ok=True)
        self.t0 = time.perf_counter()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {key}: {json.dumps(value)[:700]}", flush=True)

    def left(self, budget: float) -> float:
        return budget - (time.perf_counter() - self.t0)


def prefill_flops(model, t: int) -> float:
    """Matmul FLOPs of a prefill of t rows from position 0 (logits of the last row only)."""
    cfg = model.cfg
    w = sum(p.numel() for n, p in model.layers.named_parameters() if p.dim() == 2)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * (t * (t + 1) // 2) * cfg.n_full
    return 2.0 * t * w + attn + 2.0 * cfg.vocab_size * cfg.hidden_size


class OracleDrafter(HostDrafter):
    """Proposes the reference output's own next tokens (all accepted), except one wrong draft every
    third cycle (at a varying position), so verify rows at every offset get compared with AR."""

    name = "oracle"

    def __init__(self, ref: list[int], vocab: int):
        self.ref, self.vocab, self.seen, self.cycle = ref, vocab, 0, 0

    def begin(self, prompt, hidden) -> None:
        self.seen, self.cycle = 0, 0

    def commit(self, out, hidden, out_dev) -> None:
        self.seen += len(out)

    def propose(self, last, pos, k, sp, gen, pen=None):
        d = list(self.ref[self.seen:self.seen + k])
        self.cycle += 1
        if d and self.cycle % 3 == 0:
            i = self.cycle % len(d)
            d[i] = (d[i] + 1) % self.vocab
        return torch.tensor(d, dtype=torch.long), None


def generate(eng: Engine, ids: list[int], tokens: int, policy: SpecPolicy, drafter=None) -> dict:
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    r = list(eng.stream(ids, sp, policy, drafter=drafter))[-1].result
    return {"ids": r.token_ids, **{k: r.stats[k] for k in ("prefill_tok_s", "decode_tok_s", "mean_accept_len",
                                                            "cycles", "accepted")}}


def time_prefill(trunk: LocalTrunk, ids: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    best, logits = float("inf"), None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        trunk.begin()
        rows = trunk.prefill(ids)
        sync()
        best = min(best, time.perf_counter() - t)
        logits = rows.logits[-1]
    return best, logits


def stage_prefill(rep: Report, trunk: LocalTrunk, lengths: list[int], tag: str, reps: dict) -> None:
    m = trunk.model
    g = torch.Generator().manual_seed(7)
    res = {}
    for t in lengths:
        ids = torch.randint(0, m.cfg.vocab_size, (t,), generator=g).to(trunk.device)
        s, logits = time_prefill(trunk, ids, reps.get(t, 1))
        top = logits.float().topk(2).values
        f = prefill_flops(m, t)
        res[t] = {"s": s, "tok_s": t / s, "tflops": f / s / 1e12, "of_peak": f / s / PEAK_FLOPS,
                  "top2_gap": float(top[0] - top[1])}
    rep.put(f"prefill_{tag}", res)


def bare_graph_ms(trunk: LocalTrunk, pos: int, steps: int) -> float | None:
    gs = trunk.graphs
    if gs is None or 1 not in gs.graphs:
        return None
    g = gs.graphs[1]
    gs.pos.fill_(pos)
    g.graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(steps):
        g.graph.replay()
    e1.record()
    sync()
    return e0.elapsed_time(e1) / steps


def stage_context(rep: Report, eng: Engine, ctx: int, tokens: int, tag: str, oracle: bool = True,
                  reuse: bool = False) -> None:
    """AR, MTP k=3 and the oracle drafter after a ctx-token prompt: speed and token identity.
    `reuse`: the speculative requests resume from the prefix cache's snapshot of AR's prefill
    (bit-equal to a cold prefill by construction, so this also checks that claim)."""
    cfg = eng.trunk.cfg
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
    if reuse:
        eng.prefix = PrefixCache(eng.trunk, 16 << 30)
    try:
        stage_context_run(rep, eng, ids, tokens, tag, oracle)
    finally:
        eng.prefix = None


def stage_context_run(rep: Report, eng: Engine, ids: list[int], tokens: int, tag: str, oracle: bool) -> None:
    cfg, ctx = eng.trunk.cfg, len(ids)
    ar = generate(eng, ids, tokens, SpecPolicy("off"))
    nbytes = model_step_bytes(eng.trunk.model, cfg, ctx + tokens // 2, 2 if eng.trunk.device.type == "cuda" else 4)
    out = {"ctx": ctx, "tokens": tokens, "ar_prefill_tok_s": ar["prefill_tok_s"], "ar_tok_s": ar["decode_tok_s"],
           "ar_bw_frac": ar["decode_tok_s"] * nbytes / CEILING, "step_bytes": nbytes,
           "distinct_ar_tokens": len(set(ar["ids"]))}
    rep.put(f"{tag}_ar", out)
    mtp = generate(eng, ids, tokens, SpecPolicy("mtp", 3))
    out.update(mtp_equal=mtp["ids"] == ar["ids"], mtp_tok_s=mtp["decode_tok_s"], mtp_tau=mtp["mean_accept_len"])
    if oracle:
        orc = generate(eng, ids, tokens, SpecPolicy("mtp", 3), drafter=OracleDrafter(ar["ids"], cfg.vocab_size))
        out.update(oracle_equal=orc["ids"] == ar["ids"], oracle_tau=orc["mean_accept_len"],
                   oracle_cycles=orc["cycles"], oracle_tok_s=orc["decode_tok_s"])
    if not out["mtp_equal"] or (oracle and not out["oracle_equal"]):
        out["first_diff"] = next((i for i, (a, b) in enumerate(zip(ar["ids"], mtp["ids"])) if a != b), None)
    rep.put(f"{tag}_exact", out)


def gdn_inputs(t: int, hv: int, hk: int, dk: int, dv: int, dev: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, device=dev, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, device=dev, generator=g), dim=-1)
    v = torch.randn(t, hv, dv, device=dev, generator=g)
    gl = -torch.rand(t, hv, device=dev, generator=g) * 0.5
    beta = torch.rand(t, hv, device=dev, generator=g)
    s0 = torch.randn(hv, dk, dv, device=dev, generator=g) * 0.1
    return q, k, v, gl, beta, s0


def timed(fn, iters: int) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def stage_gdn_kernels(rep: Report, cfg, lengths: list[int], dev: str) -> None:
    hv, hk, dk, dv = cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rep_ = hv // hk
    res = {}
    for t in lengths:
        q, k, v, gl, beta, s0 = gdn_inputs(t, hv, hk, dk, dv, dev)
        qr, kr = q.repeat_interleave(rep_, 1), k.repeat_interleave(rep_, 1)
        ro, rs = G.gdn_chunked_ref(qr, kr, v, gl, beta, s0)
        use_fla(False)
        r = {"ours_ms": timed(partial(G.gdn_chunked, q, k, v, gl, beta, s0), 3) * 1e3}    # repeats the keys inside
        o, s = G.gdn_chunked(q, k, v, gl, beta, s0)
        r.update(ours_o_rel_err=rel(o, ro), ours_state_rel_err=rel(s, rs))
        use_fla(True)
        if _FLA is not None:
            t0 = time.perf_counter()
            o, s = gdn_fla.gdn_chunked_fla(q, k, v, gl, beta, s0)       # first call: compile + autotune
            sync()
            r["fla_first_call_s"] = time.perf_counter() - t0
            r.update(fla_o_rel_err=rel(o, ro), fla_state_rel_err=rel(s, rs))
            r["fla_ms"] = timed(partial(gdn_fla.gdn_chunked_fla, q, k, v, gl, beta, s0), 3) * 1e3
            r["speedup_fla_vs_ours"] = r["ours_ms"] / r["fla_ms"]
        res[t] = r
        del q, k, v, gl, beta, s0, qr, kr, ro, rs, o, s     # (timed() gets partials: no closure over these)
        if dev == "cuda":
            torch.cuda.empty_cache()
        rep.put("gdn_kernels", res)
    use_fla(True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--lengths", default="512,4096,33000")
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--long", type=int, default=33000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; optional stages are skipped past it")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for prefill.json")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny shape, short prompts")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if a.smoke:
        a.shape, a.lengths, a.short, a.long, a.tokens = "tiny", "40,100,300", 24, 300, 12
    lengths = [int(x) for x in a.lengths.split(",")]
    rep = Report(a.out)
    rep.put("machine", {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                        "shape": a.shape, "fla": gdn_fla.kernel() is not None,
                        "fla_version": getattr(sys.modules.get("fla"), "__version__", None)})
    cfg = model_config(a.shape)
    use_fla(False)           # our kernels first; flash-linear-attention in its own stage
    t = time.perf_counter()
    model = random_trunk(cfg, dev, dtype)
    head = random_head(cfg, dev, dtype)
    trunk = LocalTrunk(model, a.long + a.tokens + 64, dtype)
    if a.smoke:
        trunk.piece = 64                 # exercise several prefill pieces
    eng = Engine(trunk, None, set(), {"mtp": MtpDrafter(head, trunk, dtype), "ngram": NgramDrafter()})
    rep.put("built", {"seconds": time.perf_counter() - t, "graphs": trunk.graphs_enabled,
                      "full_layers": sum(1 for x in cfg.layer_types if x == FULL)})
    stages = [
        ("warmup", lambda: generate(eng, list(range(1, a.short + 1)), 8, SpecPolicy("mtp", 3))),
        ("prefill", lambda: stage_prefill(rep, trunk, lengths, "cublas", {lengths[0]: 3, lengths[1]: 2})),
        ("short", lambda: stage_context(rep, eng, a.short, a.tokens, "short")),
        ("long", lambda: stage_context(rep, eng, a.long, a.tokens, "long", reuse=True)),
        ("graph", lambda: rep.put("bare_graph_ms", {a.short: bare_graph_ms(trunk, a.short + a.tokens, 30),
                                                    a.long: bare_graph_ms(trunk, a.long + a.tokens, 30)})),
        ("gdn_kernels", lambda: stage_gdn_kernels(rep, cfg, [lengths[1], lengths[-1]], dev)),
        ("fla_prefill", lambda: fla_prefill(rep, eng, lengths, a)),
    ]
    need = {"gdn_kernels": 50, "fla_prefill": 20}
    for name, fn in stages:
        if rep.left(a.budget) < need.get(name, 0):
            rep.put(f"skipped_{name}", f"{rep.left(a.budget):.0f} s of the budget left")
            continue
        try:
            fn()
        except Exception:
            rep.put(f"error_{name}", traceback.format_exc())
            sync()
    summary(rep.data)


def fla_prefill(rep: Report, eng: Engine, lengths: list[int], a) -> None:
    if gdn_fla.kernel() is None:
        rep.put("fla_prefill", "flash-linear-attention not importable: skipped")
        return
    use_fla(True)
    try:
        stage_prefill(rep, eng.trunk, lengths, "fla", {lengths[0]: 3, lengths[1]: 2})
        if rep.left(a.budget) > 30:
            stage_context(rep, eng, a.long, a.tokens // 2, "long_fla", oracle=False, reuse=True)
    finally:
        use_fla(False)


def summary(d: dict) -> None:
    print("\n| path | prompt | tok/s | TFLOP/s | of 989 |\n|---|---|---|---|---|")
    for tag in ("cublas", "fla"):
        for t, r in (d.get(f"prefill_{tag}") or {}).items():
            print(f"| {tag} | {t} | {r['tok_s']:.0f} | {r['tflops']:.0f} | {100 * r['of_peak']:.1f}% |")
    s, lg = d.get("short_exact"), d.get("long_exact")
    if s and lg:
        print(f"\nAR decode: {s['ar_tok_s']:.1f} tok/s at {s['ctx']} ({100 * s['ar_bw_frac']:.1f}% of 4.17 TB/s), "
              f"{lg['ar_tok_s']:.1f} at {lg['ctx']} ({100 * lg['ar_bw_frac']:.1f}%): long/short "
              f"{lg['ar_tok_s'] / s['ar_tok_s']:.3f}")
        for r in (s, lg):
            print(f"ctx {r['ctx']}: MTP == AR {r['mtp_equal']}, oracle == AR {r.get('oracle_equal')} "
                  f"(tau {r.get('oracle_tau', 0):.2f})")
    print(json.dumps({"bench": "prefill", **{k: v for k, v in d.items() if not k.startswith("error")}})[:4000])


if __name__ == "__main__":
    main()
