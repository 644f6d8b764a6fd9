"""Programmatic dependent launch (kernels/pdl.py) on one GPU: does the graph keep it, what it buys a chain
of GEMV launches, and what it buys the 27B step through `LLM.generate`, PDL on and off in one process.

    PYTHONPATH=$PWD python bench/pdl.py --budget-s 300 --out $OUT
    PYTHONPATH=$PWD python bench/pdl.py --smoke            # the flow on the CPU (PDL never on there)

1. edges: a chain of 4-bit GEMV launches captured in a CUDA graph (torch.cuda.CUDAGraph with
   keep_graph), its edges read back through the driver (cuGraphGetEdges_v2): programmatic edges
   with PDL on, none with it off.
2. chain: the 4-bit launches of a 27B layer pair (GDN qkv+z, GDN out, MLP gate+up, MLP down, each
   its sum(x) launch + GEMV, as q4_group makes them) over --chain-layers distinct weight sets
   (past L2), captured once per variant and replayed: us per call, % of 4.17 TB/s, and every
   output's bits equal to PDL off.
3. e2e: the 27B shape, every projection 4-bit as `specfire quantize` makes it (bench/tp_mtp.py
   q4ckpt, random head: greedy output follows the bits), 512-token random prompt, 64 new tokens,
   greedy, CUDA graphs: per variant (graphs captured again after each switch) the AR step
   (median of --reps `LLM.generate` runs), the 1-row graph replayed alone, the AR tokens equal to
   those of PDL off, and MTP k=3 == AR. Then the bf16 27B (bench/tp.py ckpt) the same way if the
   budget allows.
Variants: off (SPECFIRE_PDL=0); on (PDL, each kernel releases the next right after its own wait);
on_pf2 / on_pf4 (+ the 4-bit GEMV asks L2 for its first 2 / 4 groups of codes before its wait);
early / early_pf2 (each kernel releases the next before its wait: SPECFIRE_PDL_EARLY=1).
One JSON line per record on stdout and in OUT/pdl.jsonl.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tp import CEILING, Log, _time_graph, job_ckpt, md5, smoke_shapes, step_bytes  # noqa: E402

# name -> (PDL on, 4-bit code groups prefetched to L2 before the wait, where a kernel releases the next)
VARIANTS = {"off": (False, 0, 1), "on": (True, 0, 1), "on_pf2": (True, 2, 1), "on_pf4": (True, 4, 1),
            "early": (True, 0, 2), "early_pf2": (True, 2, 2)}


def apply(name: str) -> None:
    from specfire.kernels import pdl
    from specfire.kernels.q4 import gemv as triton_quant
    pdl.ENABLED, triton_quant.PDL_PREFETCH, pdl.ORDER = VARIANTS[name]


# ---- 1. does the captured graph keep the programmatic edge --------------------------------------

class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def graph_edges(raw) -> dict:
    """Edge types of a cudaGraph_t through the driver API: {"default": n, "programmatic": n, ...}."""
    cu = ctypes.CDLL("libcuda.so.1")
    fn = cu.cuGraphGetEdges_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    n = ctypes.c_size_t(0)
    rc = fn(ctypes.c_void_p(raw), None, None, None, ctypes.byref(n))
    if rc != 0:
        return {"error": f"cuGraphGetEdges_v2 count rc={rc}"}
    frm, to = (ctypes.c_void_p * max(1, n.value))(), (ctypes.c_void_p * max(1, n.value))()
    data = (_EdgeData * max(1, n.value))()
    rc = fn(ctypes.c_void_p(raw), frm, to, data, ctypes.byref(n))
    if rc != 0:
        return {"error": f"cuGraphGetEdges_v2 rc={rc}"}
    out = {"edges": n.value, "default": 0, "programmatic": 0, "launch_order_port": 0}
    for e in data[:n.value]:
        out["programmatic" if e.type == 1 else "default"] += 1
        out["launch_order_port"] += e.from_port == 2
    return out


def edges_check(log: Log) -> None:
    from specfire.kernels import pdl
    from specfire.kernels.q4 import QuantWeight
    from specfire.kernels.q4.gemv import q4_group

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    ws = [QuantWeight(torch.randint(0, 256, (n, 2560), dtype=torch.uint8, device=dev, generator=g),
                      torch.full((40, n), 1e-3, dtype=torch.bfloat16, device=dev),
                      torch.full((40, n), -7.5e-3, dtype=torch.bfloat16, device=dev), False, torch.bfloat16)
          for n in (5120, 1024, 5120)]
    x = torch.randn(1, 5120, device=dev, dtype=torch.bfloat16)
    log("pdl_support", supported=pdl.supported(dev), capability=torch.cuda.get_device_capability(),
        triton=__import__("triton").__version__, torch=torch.__version__, cuda=torch.version.cuda)
    for name in ("off", "on"):
        apply(name)
        for w in ws:
            q4_group(x, [w])                     # compiled and its counters made before the capture
        torch.cuda.synchronize()
        try:
            gr = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(gr):
                y = x
                for w in ws:
                    y = q4_group(x, [w])[0]
            e = graph_edges(gr.raw_cuda_graph())
            gr.instantiate()
            gr.replay()
            torch.cuda.synchronize()
            log("edges", variant=name, **e, replay_ok=bool(torch.isfinite(y.float()).all()))
        except Exception as ex:  # noqa: BLE001 - the answer to record
            import traceback
            log("edges", variant=name, error=repr(ex), tb=traceback.format_exc()[-1500:])


# ---- 2. a chain of 4-bit GEMV launches -----------------------------------------------------------

CHAIN = (("qkv+z", 5120, (10240, 6144)), ("gdn out", 6144, (5120,)), ("gate+up", 5120, (17408, 17408)),
         ("down", 17408, (5120,)))


def chain_bench(layers: int, reps: int, device: str, log: Log, smoke: bool, chain_names: list[str]) -> None:
    from specfire.kernels.q4 import QuantWeight
    from specfire.kernels.q4.gemv import q4_group

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(2)
    div = 64 if smoke else 1
    sets, nbytes = [], 0
    for _ in range(layers):
        layer = []
        for _, k, ns in CHAIN:
            k //= div
            ws = []
            for n in ns:
                n //= div
                s = torch.full((k // 128, n), k ** -0.5 / 4.6, dtype=torch.bfloat16, device=dev)
                ws.append(QuantWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=g),
                                      s, -7.5 * s, False, torch.bfloat16 if not smoke else torch.float32))
                nbytes += n * k // 2 + 2 * 2 * n * (k // 128)
            layer.append((torch.randn(1, k, device=dev, generator=g).to(ws[0].dtype), ws))
        sets.append(layer)

    def run():
        return [y for layer in sets for x, ws in layer for y in q4_group(x, ws)]

    ref = None
    for name in chain_names:
        apply(name)
        if device != "cuda":
            outs = run()
            row = dict(variant=name, calls=len(CHAIN) * layers)
        else:
            run()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                outs = run()
            t = statistics.median(_time_graph(gr, 10) for _ in range(reps))
            calls = len(CHAIN) * layers
            row = dict(variant=name, calls=calls, us_per_call=round(t / calls * 1e6, 2), ms=round(t * 1e3, 3),
                       of_ceiling=round(nbytes / t / CEILING, 4), mb=round(nbytes / 1e6, 1))
        same = ref is None or all(torch.equal(a, b) for a, b in zip(outs, ref))
        if ref is None:
            ref = [o.clone() for o in outs]
        row["bits_equal_off"] = same
        log("chain", **row)
        if device == "cuda":
            del gr


# ---- 3. end to end --------------------------------------------------------------------------------

def reset_graphs(llm) -> None:
    from specfire.runtime.graphs import RowsGraphs

    trunk, mtp = llm.engine.trunk, llm.engine.drafters.get("mtp")
    if trunk.graphs is not None:
        trunk.graphs = RowsGraphs(trunk.model, trunk.state)     # the rows graphs bake the launches in
    if mtp is not None and mtp.graphs is not None:
        mtp.graphs.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def e2e(path: str, label: str, names: list[str], args, log: Log, nbytes, deadline: float, device: str) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    with LLM(path, device=device, progress=False, max_seq_len=args.prompt + 2 * args.tokens + 64) as llm:
        log("progress", what=label, loaded_s=round(time.perf_counter() - t0, 1))
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (args.prompt,), generator=gen).tolist()
        nb = nbytes(llm.cfg, args.prompt + args.tokens // 2)
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        warm = SamplingParams(max_tokens=8, ignore_eos=True)
        ref_ids = None
        for name in names:
            if time.monotonic() > deadline:
                log("skipped", what=label, variant=name, why="time budget")
                continue
            t1 = time.monotonic()
            try:
                apply(name)
                reset_graphs(llm)
                llm.generate(ids, warm, spec="off")
                steps, ar_ids = [], None
                for _ in range(args.reps):
                    a = llm.generate(ids, sp, spec="off")
                    steps.append(a.stats["decode_s"] / max(1, len(a.token_ids) - 1))
                    ar_ids = ar_ids or a.token_ids
                    if a.token_ids != ar_ids:
                        ar_ids = ["runs differ"]
                m = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
                step = statistics.median(steps)
                ref_ids = ref_ids or ar_ids
                row = dict(weights=label, variant=name, ar_step_ms=round(step * 1e3, 3), ar_tok_s=round(1 / step, 1),
                           ar_of_ceiling=round(nb / step / CEILING, 4), runs_ms=[round(s * 1e3, 3) for s in steps],
                           ar_equals_first_variant=ar_ids == ref_ids, mtp_equals_ar=m.token_ids == ar_ids,
                           mtp_tau=m.stats.get("mean_accept_len"), ar_md5=md5(ar_ids), tokens=len(ar_ids))
                trunk = llm.engine.trunk
                if device == "cuda" and trunk.graphs is not None and 1 in trunk.graphs.graphs:
                    row["rows1_graph_ms"] = round(_time_graph(trunk.graphs.graphs[1].graph, 20) * 1e3, 3)
                log("e2e", **row)
            except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the others
                import traceback
                log("error", what=label, variant=name, error=repr(e), tb=traceback.format_exc()[-2000:])
            log("progress", what=label, variant=name, s=round(time.monotonic() - t1, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="off,on,on_pf2,early,early_pf2,off")
    ap.add_argument("--chain-variants", default="off,on,on_pf2,early,early_pf2,off")
    ap.add_argument("--bf16-variants", default="off,on")
    ap.add_argument("--chain-layers", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of: edges, chain, q4, bf16")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--bf16-need-s", type=float, default=100)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    bnames = [v for v in args.bf16_variants.split(",") if v]
    cnames = [v for v in args.chain_variants.split(",") if v]
    for v in names + bnames + cnames:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    skip = set(s for s in args.skip.split(",") if s)
    t_end = time.monotonic() + args.budget_s
    device = "cpu" if args.smoke else "cuda"
    import tp_mtp
    if args.smoke:
        import decode
        smoke_shapes()
        decode.SHAPES["tiny"] = {**decode.SHAPES["tiny"], "intermediate_size": 128}
        args.shape, args.prompt, args.tokens, args.reps, args.chain_layers = "tiny", 40, 12, 1, 1
        tp_mtp.GROUP = 32
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    log = Log(args.out, name="pdl.jsonl")
    log("start", commit=args.commit, shape=args.shape, torch=torch.__version__,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    if device == "cuda" and "edges" not in skip:
        try:
            edges_check(log)
        except Exception as e:  # noqa: BLE001
            log("error", what="edges", error=repr(e))
    if "chain" not in skip and not args.smoke:
        t0 = time.monotonic()
        try:
            chain_bench(args.chain_layers, 5, device, log, args.smoke, cnames)
        except Exception as e:  # noqa: BLE001
            import traceback
            log("error", what="chain", error=repr(e), tb=traceback.format_exc()[-2000:])
        torch.cuda.empty_cache()
        log("progress", what="chain", s=round(time.monotonic() - t0, 1))
    d = tempfile.mkdtemp(prefix="pdl-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        if "q4" not in skip:
            t0 = time.perf_counter()
            tp_mtp.job_q4ckpt(cfg, d, device, log)
            log("progress", what="q4ckpt", s=round(time.perf_counter() - t0, 1))
            e2e(os.path.join(d, "q4"), "4-bit", names, args, log,
                lambda c, ctx: tp_mtp.q4_step_bytes(c, d, 1, ctx), t_end - 10, device)
            shutil.rmtree(os.path.join(d, "q4"), ignore_errors=True)
        left = t_end - time.monotonic()
        if "bf16" not in skip and bnames and left >= args.bf16_need_s:
            t0 = time.perf_counter()
            job_ckpt(cfg, d, device, log)
            log("progress", what="ckpt", s=round(time.perf_counter() - t0, 1))
            e2e(os.path.join(d, "normal"), "bf16", bnames, args, log, lambda c, ctx: step_bytes(c, 1, ctx),
                t_end - 5, device)
        elif "bf16" not in skip and bnames:
            log("skipped", what="bf16", why=f"{left:.0f} s left, need {args.bf16_need_s:.0f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    log("done", seconds=round(time.monotonic() - (t_end - args.budget_s), 1))


if __name__ == "__main__":
    main()
