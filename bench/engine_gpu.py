"""The engine loop on one GPU, end to end through LLM.generate (one call, results as JSON).

1. exact:   greedy MTP k=3, n-gram k=3, auto and forced mid-request route changes == AR tokens on
            the bundled model with CUDA graphs.
2. bundled: AR / MTP k=3 / n-gram k=3 / auto decode tok/s of the bundled model, beside the bare
            trunk (the 1-row CUDA graph replayed back to back) and a host loop without reads.
3. big:     a random-weight checkpoint of a real shape (27B by default) written to --ckpt-dir with
            final norms -1 (every draft of the real head accepted): AR decode vs the bare trunk
            step, MTP k=3, and SYNTHETIC-acceptance MTP k=3 at the code / prose profiles
            (bench/common.py ProfileDrafter: the head's cost is real, its acceptance drawn), and auto.
4. sampled: sampled MTP k=3 with the draft chain and accept replayed from CUDA graphs vs the same
            seeded request run eagerly (identical tokens) and vs greedy MTP (cycle cost).
Bandwidth: tok/s x bytes of one AR step (bench/common.py) / 4.17 TB/s; for
speculative routes that is the AR-equivalent fraction. A stage's results are written to
$OUT/engine_gpu.json as soon as it ends, so a timeout keeps what finished.

    python -m bench.engine_gpu [--shape 27B] [--big-tokens 128] [--bundled-tokens 256]
    python -m bench.engine_gpu --stages sampled --big-tokens 64
    python -m bench.engine_gpu --smoke      # CPU: bundled + a tiny shape, few tokens
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import traceback

import torch

from bench.common import (CEILING, PROFILES, ProfileDrafter, checkpoint_step_bytes, model_config, model_step_bytes,
                          random_head, random_trunk, sync, write_checkpoint)
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.runtime.route import Decision

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield every file path under root.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


class Forced:
    """Routes taken from a fixed schedule, cycle after cycle (the engine's controller interface)."""

    candidates = ("mtp", "ngram")
    reason = "forced schedule"
    current = ("ar", 0)
    SCHEDULE = [("ar", 0), ("mtp", 3), ("ngram", 2), ("mtp", 1), ("ar", 0), ("ar", 0), ("mtp", 2), ("ngram", 3)]

    def __init__(self):
        self.i = 0
        self.acc = {}                    # no acceptance to carry over

    def decide(self) -> Decision:
        return Decision(*self.SCHEDULE[self.i % len(self.SCHEDULE)])

    def observe(self, d, k, n, seconds) -> None:
        self.i += 1


class Report:
    def __init__(self, out: str | None):
        self.data: dict = {"ceiling_Bps": CEILING}
        self.path = os.path.join(out, "engine_gpu.json") if out else None

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)
        print(f"[{time.strftime('%H:%M:%S')}] {key}: {json.dumps(value)[:600]}", flush=True)


def bare_trunk(llm: LLM, ctx: int, steps: int) -> dict:
    """Per-step time of the trunk alone at position `ctx`: the 1-row CUDA graph replayed back to
    back (device time), and a host loop (verify + commit + argmax fed back, no host read)."""
    trunk = llm.engine.trunk
    dev = str(trunk.device)
    ids = torch.zeros(1, dtype=torch.long, device=trunk.device)
    out: dict = {}
    if trunk.graphs is not None and 1 in trunk.graphs.graphs:
        g = trunk.graphs.graphs[1]
        trunk.graphs.pos.fill_(ctx)
        g.graph.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(steps):
            g.graph.replay()
        e1.record()
        sync(dev)
        out["graph_ms"] = e0.elapsed_time(e1) / steps
    trunk.begin()
    trunk.prefill(torch.zeros(ctx, dtype=torch.long, device=trunk.device))
    for i in range(3):
        r = trunk.verify(ids, ctx + i)
        trunk.commit(0)
    sync(dev)
    t = time.perf_counter()
    for i in range(steps):
        r = trunk.verify(ids, ctx + 3 + i)
        trunk.commit(0)
        ids.copy_(r.logits.argmax(-1))
    sync(dev)
    out["loop_ms"] = (time.perf_counter() - t) / steps * 1e3
    return out


def run_modes(llm: LLM, prompts: list, tokens: int, modes: dict, bytes_per_step: int, drafters: dict | None = None) -> dict:
    """Decode tok/s per mode over the prompts (one warm-up request per mode first)."""
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    res = {}
    for name, spec in modes.items():
        def go(p):
            if drafters and name in drafters:
                d = drafters[name]()
                chunks = list(llm.engine.stream(llm._ids(p), sp, SpecPolicy("mtp", 3), drafter=d))
                return chunks[-1].result
            return llm.generate(p, sp, spec=spec)
        go(prompts[0])
        n_tok, dec_s, rs = 0, 0.0, []
        for p in prompts:
            r = go(p)
            n_tok += r.stats["generated_tokens"] - 1
            dec_s += r.stats["decode_s"]
            rs.append(r)
        tok_s = n_tok / dec_s
        last = rs[-1].stats
        res[name] = {"tok_s": tok_s, "bw_frac": tok_s * bytes_per_step / CEILING,
                     "mean_accept_len": last["mean_accept_len"], "accept_per_pos": last["accept_per_pos"],
                     "route": last["route"], "k": last["k"], "routes": last["routes"],
                     "route_reason": last["route_reason"], "token_ids": [r.token_ids for r in rs]}
    return res


def stage_bundled(rep: Report, dev: str, tokens: int, steps: int) -> None:
    with LLM(device=dev, progress=False) as llm:
        nbytes = model_step_bytes(llm.engine.trunk.model, llm.cfg, 256, llm.dtype.itemsize)
        modes = {"ar": "off", "mtp3": SpecPolicy("mtp", 3), "ngram3": SpecPolicy("ngram", 3),
                 "auto": SpecPolicy("auto", 3)}
        res = run_modes(llm, PROMPTS, tokens, modes, nbytes)
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        forced = [list(llm.engine.stream(llm._ids(p), sp, SpecPolicy("auto", 3), controller=Forced()))[-1].result.token_ids
                  for p in PROMPTS]
        ref = res["ar"]["token_ids"]
        exact = {name: r["token_ids"] == ref for name, r in res.items()}
        exact["forced_route_changes"] = forced == ref
        rep.put("exact_bundled", {"graphs": llm.engine.trunk.graphs_enabled, **exact})
        for r in res.values():
            r.pop("token_ids")
        bare = bare_trunk(llm, 256, steps)
        ar = res["ar"]["tok_s"]
        rep.put("bundled", {"step_bytes": nbytes, "graphs": llm.engine.trunk.graphs_enabled, **bare,
                            "bare_graph_tok_s": 1e3 / bare["graph_ms"] if "graph_ms" in bare else None,
                            "generate_vs_bare_graph": ar * bare["graph_ms"] / 1e3 if "graph_ms" in bare else None,
                            "loop_tok_s": 1e3 / bare["loop_ms"], "generate_vs_loop": ar * bare["loop_ms"] / 1e3,
                            "modes": res})


def stage_big(rep: Report, dev: str, shape: str, ckpt_dir: str, prompt: int, tokens: int, steps: int) -> None:
    cfg = model_config(shape)
    path = os.path.join(ckpt_dir, f"specfire_{shape}_tied")
    t = time.perf_counter()
    write_checkpoint(path, cfg, torch.bfloat16 if dev.startswith("cuda") else torch.float32, dev, tied=True)
    rep.put("big_written", {"shape": shape, "seconds": time.perf_counter() - t})
    try:
        t = time.perf_counter()
        with LLM(path, device=dev, progress=False, max_seq_len=prompt + tokens + 64) as llm:
            rep.put("big_loaded", {"seconds": time.perf_counter() - t, "graphs": llm.engine.trunk.graphs_enabled})
            nbytes = checkpoint_step_bytes(path, prompt + tokens // 2, llm.dtype.itemsize)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(2, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()]
            ar = run_modes(llm, prompts, tokens, {"ar": "off"}, nbytes)["ar"]
            bare = bare_trunk(llm, prompt + tokens // 2, steps)
            base = {"shape": shape, "step_bytes": nbytes, "ceiling_tok_s": CEILING / nbytes, **bare}
            if "graph_ms" in bare:
                base["bare_graph_tok_s"] = 1e3 / bare["graph_ms"]
                base["generate_vs_bare_graph"] = ar["tok_s"] * bare["graph_ms"] / 1e3
            base["generate_vs_loop"] = ar["tok_s"] * bare["loop_ms"] / 1e3
            ar_ids = ar.pop("token_ids")
            rep.put("big_ar", {**base, "ar": ar, "ar_all_zero": all(t == 0 for t in ar_ids[0])})
            try:
                big_spec(rep, llm, prompts, tokens, nbytes, ar, ar_ids)
            except Exception:
                rep.put("error_big_spec", traceback.format_exc())
    finally:
        shutil.rmtree(path, ignore_errors=True)


def big_spec(rep: Report, llm: LLM, prompts: list, tokens: int, nbytes: int, ar: dict, ar_ids: list) -> None:
    """MTP k=3 on the big shape: synthetic-acceptance profiles, every draft accepted, auto."""
    inner = llm.engine.drafters["mtp"]
    seeds = iter(range(1, 1_000_000))          # a fresh random sequence for every request, warm-up included
    drafters = {f"synthetic_{n}": (lambda p=p: ProfileDrafter(inner, p, seed=next(seeds))) for n, p in PROFILES.items()}
    res = run_modes(llm, prompts, tokens, {"synthetic_code": None, "synthetic_prose": None}, nbytes, drafters)
    for r in res.values():
        r["equals_ar"] = r.pop("token_ids") == ar_ids
        r["speedup_vs_ar"] = r["tok_s"] / ar["tok_s"]
    res["profiles"] = PROFILES
    rep.put("big_synthetic_mtp3", res)
    res = run_modes(llm, prompts, tokens, {"mtp3_all_accepted": SpecPolicy("mtp", 3),
                                           "auto": SpecPolicy("auto", 3)}, nbytes)
    for r in res.values():
        r["equals_ar"] = r.pop("token_ids") == ar_ids
        r["speedup_vs_ar"] = r["tok_s"] / ar["tok_s"]
    rep.put("big_mtp_auto", res)


def stage_sampled(rep: Report, dev: str, shape: str, prompt: int, tokens: int) -> None:
    """Sampled MTP k=3 (temperature 0.8, top-p 0.95, seeded) with the draft chain and the accept
    replayed from CUDA graphs, against the same request run eagerly (same tokens expected: the
    random stream is device-side) and against greedy MTP: the cost of a cycle. Random weights of
    `shape` built on the device with a random head (drafts rarely accepted, greedy or sampled, so
    the comparison is at equal acceptance)."""
    from specfire.runtime.drafters import MtpDrafter
    from specfire.runtime.engine import Engine
    from specfire.runtime.trunk import LocalTrunk

    cfg = model_config(shape)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = random_trunk(cfg, dev, dtype)
    trunk = LocalTrunk(model, prompt + tokens + 64, dtype)
    eng = Engine(trunk, None, set(), {"mtp": MtpDrafter(random_head(cfg, dev, dtype), trunk, dtype)})
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(4)).tolist()
    drafter = eng.drafters["mtp"]

    def go(sp: SamplingParams, policy: SpecPolicy, graphs: bool = True) -> dict:
        saved = drafter.graphs, eng.bufs.graphs
        if not graphs:
            drafter.graphs = eng.bufs.graphs = None
        try:
            r = list(eng.stream(ids, sp, policy))[-1].result
        finally:
            drafter.graphs, eng.bufs.graphs = saved
        st = r.stats
        steps = max(1, st["cycles"] if policy.mode != "off" else st["generated_tokens"] - 1)
        return {"tok_s": st["decode_tok_s"], "step_ms": st["decode_s"] / steps * 1e3, "tau": st["mean_accept_len"],
                "cycles": st["cycles"], "ids": r.token_ids}

    greedy = SamplingParams(max_tokens=tokens, ignore_eos=True)
    sampled = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
    mtp, off = SpecPolicy("mtp", 3), SpecPolicy("off")
    for sp in (greedy, sampled):                     # warm-up: kernel compilation and graph captures
        go(sp, mtp)
        go(sp, off)
    res = {"greedy_mtp": go(greedy, mtp), "sampled_mtp_graphs": go(sampled, mtp),
           "sampled_mtp_eager": go(sampled, mtp, graphs=False), "greedy_ar": go(greedy, off),
           "sampled_ar_graphs": go(sampled, off)}
    out = {"shape": shape, "graphs": trunk.graphs_enabled,
           "sampled_graphs_equal_eager": res["sampled_mtp_graphs"]["ids"] == res["sampled_mtp_eager"]["ids"],
           "sampled_vs_greedy_cycle": res["greedy_mtp"]["step_ms"] / res["sampled_mtp_graphs"]["step_ms"],
           "eager_vs_graphs_cycle": res["sampled_mtp_graphs"]["step_ms"] / res["sampled_mtp_eager"]["step_ms"],
           "sampled_ar_vs_greedy_ar": res["greedy_ar"]["step_ms"] / res["sampled_ar_graphs"]["step_ms"]}
    for r in res.values():
        r.pop("ids")
    rep.put("sampled", {**out, "runs": res})


def table(d: dict) -> None:
    print("\n| model | route | tok/s | of 4.17 TB/s | tau | note |\n|---|---|---|---|---|---|")
    b = d.get("bundled")
    if b:
        for name, r in b["modes"].items():
            print(f"| bundled | {name} | {r['tok_s']:.0f} | {100 * r['bw_frac']:.2f}% | {r['mean_accept_len']:.2f} | "
                  f"{r['route']} k={r['k']} |")
        if b.get("bare_graph_tok_s"):
            print(f"| bundled | bare 1-row graph | {b['bare_graph_tok_s']:.0f} | "
                  f"{100 * b['bare_graph_tok_s'] * b['step_bytes'] / CEILING:.2f}% | | {b['graph_ms']:.3f} ms |")
        print(f"| bundled | host loop, no reads | {b['loop_tok_s']:.0f} | | | {b['loop_ms']:.3f} ms |")
    a = d.get("big_ar")
    if a:
        sh = a["shape"]
        print(f"| {sh} | ar (LLM.generate) | {a['ar']['tok_s']:.1f} | {100 * a['ar']['bw_frac']:.1f}% | | "
              f"{100 * a.get('generate_vs_bare_graph', 0):.1f}% of bare graph, {100 * a['generate_vs_loop']:.1f}% of loop |")
        if a.get("bare_graph_tok_s"):
            print(f"| {sh} | bare 1-row graph | {a['bare_graph_tok_s']:.1f} | "
                  f"{100 * a['bare_graph_tok_s'] * a['step_bytes'] / CEILING:.1f}% | | {a['graph_ms']:.2f} ms |")
        for key in ("big_synthetic_mtp3", "big_mtp_auto"):
            for name, r in d.get(key, {}).items():
                if name == "profiles":
                    continue
                acc = "/".join(f"{x:.2f}" for x in r["accept_per_pos"])
                print(f"| {sh} | {name} | {r['tok_s']:.1f} | {100 * r['bw_frac']:.1f}% | {r['mean_accept_len']:.2f} | "
                      f"{r['speedup_vs_ar']:.2f}x AR, accept {acc}, equal {r['equals_ar']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--big-tokens", type=int, default=128)
    ap.add_argument("--bundled-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ckpt-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--stages", default="bundled,big", help="comma list of bundled, big, sampled")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for engine_gpu.json")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny shape, few tokens")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.shape, args.prompt, args.big_tokens, args.bundled_tokens, args.steps = "tiny", 24, 16, 24, 3
        args.ckpt_dir = tempfile.mkdtemp()
    rep = Report(args.out)
    rep.put("machine", {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                        "torch": torch.__version__, "shape": args.shape, "prompt": args.prompt,
                        "big_tokens": args.big_tokens, "bundled_tokens": args.bundled_tokens})
    want = set(args.stages.split(","))
    stages = [("bundled", lambda: stage_bundled(rep, dev, args.bundled_tokens, args.steps))] if "bundled" in want else []
    if not args.skip_big and "big" in want:
        stages.append(("big", lambda: stage_big(rep, dev, args.shape, args.ckpt_dir, args.prompt, args.big_tokens,
                                                args.steps)))
    if "sampled" in want:
        stages.append(("sampled", lambda: stage_sampled(rep, dev, args.shape, args.prompt, args.big_tokens)))
    for name, fn in stages:      # one stage failing must not cost the others their device time
        try:
            fn()
        except Exception:
            rep.put(f"error_{name}", traceback.format_exc())
    table(rep.data)


if __name__ == "__main__":
    main()
