"""Tensor parallelism on 2 GPUs: bits equal to one GPU, then speed (tp1 vs tp2), the canonical
split-K's cost on one GPU, and the collectives' share of a step.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=$PWD python bench/tp.py --shape 9B --out $OUT
    PYTHONPATH=$PWD python bench/tp.py --smoke          # the same flow on the CPU, tiny shapes

Stages (each appends one JSON line to OUT/tp.jsonl as it finishes, so a cut-off run keeps what
it measured):
  kernels   the row-parallel projections of the shape, M = 1 and 4: the fused split-K-in-8 GEMV
            vs the two-launch form (bitwise) vs the plain GEMV (time); column shards with the whole
            matrix's launch settings vs the whole (bitwise)
  bundled   the bundled model in bf16: tp2 logits == tp1 bitwise, greedy AR tokens (200) equal,
            MTP k=3 == AR on both
  collect   a decode step's collectives alone (2 processes, symmetric memory, one CUDA graph)
  speed     random weights of the shape (final norms -1: every logit ties, every MTP draft is
            accepted), 512-token prompt, 64 tokens: AR and MTP k=3 tok/s on tp1 (canonical split
            and plain) and tp2; the last layer's output of tp2 vs tp1 bitwise (prefill and decode)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

CEILING = 4.17e12     # measured device-to-device copy bandwidth of the H200 (bytes/s)


class Log:
    def __init__(self, out: str | None):
        self.path = os.path.join(out, "tp.jsonl") if out else None
        self.rows: list[dict] = []

    def __call__(self, stage: str, **kw) -> None:
        row = {"stage": stage, **kw}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


# ---- stage: kernels -------------------------------------------------------------------------------

def stage_kernels(cfg, log: Log) -> None:
    from timing import graph_time

    from specfire.ops.splitk import chunk_bounds
    from specfire.ops.triton_gemv import chunk_partials, gemv, gemv_chunks_fused, gemv_tree_loop, tree_combine

    dev, dt = "cuda", torch.bfloat16
    h = cfg.hidden_size
    shapes = {"o_proj": (h, cfg.num_attention_heads * cfg.head_dim),
              "out_proj": (h, cfg.linear_num_value_heads * cfg.linear_value_head_dim),
              "down_proj": (h, cfg.intermediate_size)}
    for name, (n, k) in shapes.items():
        reps = max(2, (120 << 20) // (n * k * 2))                 # rotate > L2
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(reps)]
        b = torch.tensor(chunk_bounds(k), dtype=torch.int32, device=dev)
        for m in (1, 4):
            x = torch.randn(m, k, device=dev, dtype=dt)
            fused = gemv_chunks_fused(x, ws[0], b, dt)
            two = tree_combine(chunk_partials(x, ws[0], b), dt)
            rows_ok = all(torch.equal(gemv_chunks_fused(x[i:i + 1], ws[0], b, dt)[0], fused[i]) for i in range(m))
            err = float((fused.float() - (x.float() @ ws[0].float().t())).abs().max())
            t_plain = graph_time([lambda w=w: gemv(x, w) for w in ws])
            t_fused = graph_time([lambda w=w: gemv_chunks_fused(x, w, b, dt) for w in ws])
            t_two = graph_time([lambda w=w: tree_combine(chunk_partials(x, w, b), dt) for w in ws])
            loop_ok, t_loop = None, None
            try:
                loop = gemv_tree_loop(x, ws[0], 8, dt)
                loop_ok = bool(torch.equal(loop, two))
                t_loop = graph_time([lambda w=w: gemv_tree_loop(x, w, 8, dt) for w in ws]) * 1e6
            except Exception as e:  # noqa: BLE001 - report and go on
                log("error", where="gemv_tree_loop", error=f"{type(e).__name__}: {e}"[:1500])
            nbytes = n * k * 2
            log("kernels", proj=name, n=n, k=k, m=m, fused_equals_two_launch=bool(torch.equal(fused, two)),
                fused_row_invariant=rows_ok, max_abs_err_vs_fp32=err, loop_equals_two_launch=loop_ok, loop_us=t_loop,
                plain_us=t_plain * 1e6, fused_us=t_fused * 1e6, two_launch_us=t_two * 1e6,
                plain_bw=nbytes / t_plain / CEILING, fused_bw=nbytes / t_fused / CEILING)
        del ws
    # prefill: the Triton kernel in 64-row tiles (what every degree runs) vs cuBLAS (tp1 before)
    import torch.nn.functional as F

    for name, (n, k) in {"gate_proj": (cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size)}.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
        x = torch.randn(512, k, device=dev, dtype=dt)
        t_cublas = graph_time([lambda: F.linear(x, w)], iters=5)
        t_triton = graph_time([lambda: gemv(x, w, tile=64)], iters=5)
        whole = F.linear(x, w)
        cub_shard = torch.equal(torch.cat([F.linear(x, w[:n // 2]), F.linear(x, w[n // 2:])], -1), whole)
        log("kernels", prefill_rows=512, proj=name, n=n, k=k, cublas_us=t_cublas * 1e6, triton64_us=t_triton * 1e6,
            cublas_tflops=2 * 512 * n * k / t_cublas / 1e12, triton64_tflops=2 * 512 * n * k / t_triton / 1e12,
            cublas_column_shards_equal_whole=bool(cub_shard))
    # column shards with the whole matrix's launch settings (GDN a/b: 24 of 48 rows, one tile)
    for n, lo in ((cfg.linear_num_value_heads, cfg.linear_num_value_heads // 2), (2 * cfg.intermediate_size,
                                                                               cfg.intermediate_size)):
        w = torch.randn(n, h, device=dev, dtype=dt)
        for m in (1, 4):
            x = torch.randn(m, h, device=dev, dtype=dt)
            whole = gemv(x, w)
            shard = torch.cat([gemv(x, w[:lo].contiguous(), launch_n=n), gemv(x, w[lo:].contiguous(), launch_n=n)], -1)
            log("kernels", column_shard_n=n, split_at=lo, m=m, shards_equal_whole=bool(torch.equal(shard, whole)))


# ---- stage: bundled -------------------------------------------------------------------------------

def stage_bundled(device: str, dtype: str, log: Log, tokens: int, graphs: bool | None = None) -> None:
    from specfire.ops import splitk
    splitk.set_enabled(True)   # one GPU bit-equal to the mesh (off by default on one GPU)
    from specfire import LLM, SamplingParams, SpecPolicy

    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    sp = SamplingParams(max_tokens=tokens)
    res = {}
    for tp in (1, 2):
        t0 = time.perf_counter()
        with LLM(None, tp=tp, device=device, dtype=dtype, progress=False, cuda_graphs=graphs,
                 max_seq_len=512) as llm:
            load_s = time.perf_counter() - t0
            ids = llm.tokenizer.encode(text)
            lg = llm.score(ids).cpu()
            rows = _rows_logits(llm, ids, device)
            llm.generate(ids, SamplingParams(max_tokens=16), spec="off")                  # warm-up: compile,
            llm.generate(ids, SamplingParams(max_tokens=16), spec=SpecPolicy("mtp", k=3))  # capture
            ar = llm.generate(ids, sp, spec="off")
            mtp = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            res[tp] = (lg, ar.token_ids, mtp.token_ids, rows)
            log("bundled", tp=tp, graphs=llm.engine.trunk.graphs_enabled, load_s=load_s, ar_tok_s=ar.stats["decode_tok_s"],
                mtp_tok_s=mtp.stats["decode_tok_s"], mtp_equals_ar=mtp.token_ids == ar.token_ids,
                mean_accept_len=mtp.stats.get("mean_accept_len"))
    lg1, ar1, _, rows1 = res[1]
    lg2, ar2, mtp2, rows2 = res[2]
    log("bundled", logits_tp2_equal_tp1=bool(torch.equal(lg1, lg2)), max_logit_diff=float((lg1 - lg2).abs().max()),
        rows_logits_tp2_equal_tp1={k: bool(torch.equal(rows1[k], rows2[k])) for k in rows1},
        rows_invariant_tp1=bool(torch.equal(rows1[1][0], rows1[4][0])),
        ar_tokens_equal=ar1 == ar2, mtp_tp2_equals_ar_tp1=mtp2 == ar1, tokens=len(ar1))


def _rows_logits(llm, ids: list[int], device: str) -> dict[int, torch.Tensor]:
    """Logits of a 4-row verify and a 1-row decode after the prompt (the rows forward: CUDA graphs
    where enabled), straight from the trunk."""
    t = llm.engine.trunk
    x = torch.tensor(ids, device=device)
    extra = torch.tensor(ids[:4], device=device)
    out = {}
    t.begin()
    t.prefill(x)
    for r in (4, 1):           # the live state moves only on commit: both verify the same position
        out[r] = t.verify(extra[:r], len(ids)).logits.float().cpu()
    t.commit(0)
    return out


# ---- stage: collectives alone ---------------------------------------------------------------------

def _collect_rank(rank: int, world: int, port: int, cfg_d: dict, q) -> None:
    import datetime

    import torch.distributed as dist

    from specfire.config import ModelConfig
    from specfire.parallel.symm import SymmCollectives

    from timing import graph_time

    cfg = ModelConfig(**cfg_d)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="nccl")
    dev = torch.device("cuda", rank)
    h = cfg.hidden_size
    vs = -(-cfg.vocab_size // world)
    sym = SymmCollectives(group, rank, world, dev, 4 * 16 * max(world * vs, world * h))
    out = {}
    for m in (1, 4):
        part = torch.randn(m, h, device=dev)
        emb = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        lg = torch.randn(m, vs, device=dev)

        def step():
            sym.sum(emb)
            for _ in range(2 * cfg.num_hidden_layers):
                sym.tree(part)
            sym.all_gather(lg)

        t = graph_time([step], iters=5)
        one = graph_time([lambda: sym.tree(part)], iters=50)
        ok = torch.equal(sym.tree(part), _peer_sum(part, group, world))
        out[m] = dict(step_collectives_us=t * 1e6, tree_us=one * 1e6, n_calls=2 * cfg.num_hidden_layers + 2,
                      tree_equals_nccl_sum=bool(ok))
    dist.barrier(group)
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def _peer_sum(x: torch.Tensor, group, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts[0] + parts[1] if world == 2 else parts[0]


def stage_collect(cfg, log: Log) -> None:
    import dataclasses
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29600 + os.getpid() % 300
    cfg_d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    procs = [ctx.Process(target=_collect_rank, args=(r, 2, port, cfg_d, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=180)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for m, r in out.items():
        log("collect", rows=m, **r)


# ---- stage: speed on a random checkpoint of a real shape --------------------------------------------

def write_checkpoint(shape: str, path: str, device: str, tie_norms: bool) -> str:
    """Random weights of `shape` (bench/decode.py's configs) with an MTP head; with `tie_norms` the
    trunk's and the head's final norms are -1, so every logit is 0 and every draft is accepted."""
    from decode import build, make_cfg

    from specfire.model.qwen35 import MtpHead
    from specfire.train.export import export_checkpoint

    cfg = make_cfg(shape)
    dt = torch.bfloat16
    trunk = build(cfg, device, dt)
    with torch.device("meta"):
        head = MtpHead(cfg)
    head = head.to(dt).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for _, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dt) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
        if tie_norms:
            trunk.norm.weight.fill_(-1.0)
            head.norm.weight.fill_(-1.0)
    export_checkpoint(trunk, head, path, eos_ids=[cfg.vocab_size - 1], dtype=dt, max_shard_bytes=4 << 30)
    del trunk, head
    return path


def rank0_model(llm):
    t = llm.engine.trunk
    local = getattr(t, "_local", None) or t
    return local.model


def stage_speed(shape: str, path: str, device: str, log: Log, prompt: int, tokens: int, tps: list[int],
                plain_tp1: bool, graphs: bool | None = None) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.ops import splitk

    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ref_h = None
    runs = [(tp, True) for tp in tps] + ([(1, False)] if plain_tp1 else [])
    for tp, canonical in runs:
        splitk.set_enabled(canonical)
        t0 = time.perf_counter()
        with LLM(path, tp=tp, device=device, progress=False, cuda_graphs=graphs,
                 max_seq_len=prompt + 2 * tokens + 64) as llm:
            load_s = time.perf_counter() - t0
            log("progress", tp=tp, canonical=canonical, done="load", t=time.perf_counter() - t0)
            ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist() if ref_h is None else ids
            caught = []       # the last layer's output over the prompt (eager prefill on every degree)
            hook = rank0_model(llm).layers[-1].register_forward_hook(lambda m, i, o: caught.append(o.detach().float().cpu()))
            llm.score(ids)
            hook.remove()
            hs = torch.cat(caught)
            log("progress", tp=tp, done="score", t=time.perf_counter() - t0)
            llm.generate(ids, sp, spec="off")                                   # warm-up: graphs captured
            log("progress", tp=tp, done="ar warm-up", t=time.perf_counter() - t0)
            ar = llm.generate(ids, sp, spec="off")
            llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            log("progress", tp=tp, done="mtp warm-up", t=time.perf_counter() - t0)
            mtp = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            row = dict(shape=shape, tp=tp, canonical_split=canonical, graphs=llm.engine.trunk.graphs_enabled,
                       load_s=load_s,
                       prefill_tok_s=ar.stats["prefill_tok_s"], ar_tok_s=ar.stats["decode_tok_s"],
                       mtp3_tok_s=mtp.stats["decode_tok_s"], mtp3_mean_accept_len=mtp.stats.get("mean_accept_len"),
                       generated=len(ar.token_ids), mtp_equals_ar=mtp.token_ids == ar.token_ids)
            if ref_h is None:
                ref_h = hs
            elif canonical:
                row["last_layer_equal_tp1"] = bool(torch.equal(hs, ref_h))
                row["last_layer_max_diff"] = float((hs - ref_h).abs().max())
            log("speed", **row)
    splitk.set_enabled(None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="9B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stages", default="kernels,bundled,speed,collect")
    ap.add_argument("--ckpt-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--no-plain", action="store_true", help="skip tp1 with the canonical split off")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--commit", default=None, help="recorded in the log (the GPU copy has no .git)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every stage in this process (default: one child process per stage, so each "
                         "process opens at most one mesh; a second mesh in one process did not finish on the GPU)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check the flow, no timings worth keeping")
    args = ap.parse_args()
    log = Log(args.out)
    stages = args.stages.split(",")
    if not args.in_process and len(stages) > 1:
        import subprocess
        for st in stages:
            cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--stages", st, "--shape", args.shape,
                   "--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            cmd += [x for x, on in (("--smoke", args.smoke), ("--no-plain", args.no_plain)) if on]
            cmd += ["--out", args.out] if args.out else []
            cmd += ["--commit", args.commit] if args.commit else []
            cmd += ["--ckpt-dir", args.ckpt_dir] if args.ckpt_dir else []
            rc = subprocess.call(cmd)
            if rc != 0:
                log("error", where=f"stage {st}", error=f"child exited with {rc}")
        return
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        import decode
        decode.SHAPES["tiny"] = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                                     tie_word_embeddings=False)
        decode_make = decode.make_cfg

        def small(name):
            c = decode_make(name)
            import dataclasses
            return dataclasses.replace(c, vocab_size=512, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
        decode.make_cfg = small
        args.shape, args.prompt, args.tokens = "tiny", min(args.prompt, 100), 8
        torch.set_num_threads(1)
    log("start", commit=args.commit, shape=args.shape, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        gpus=torch.cuda.device_count() if device == "cuda" else 0, torch=torch.__version__, stages=stages)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    t_all = time.perf_counter()
    def guarded(name, fn, *a, retry_eager=False):
        """Run a stage; on failure log the error and, where asked, run it again without CUDA graphs
        on the mesh (the eager NCCL path), so one failure does not cost the rest of the run."""
        t0 = time.perf_counter()
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            import traceback
            log("error", where=name, error=f"{type(e).__name__}: {e}"[:2000],
                trace=traceback.format_exc()[-3000:])
            if retry_eager:
                try:
                    fn(*a, False)
                except Exception as e2:  # noqa: BLE001
                    log("error", where=name + " (eager)", error=f"{type(e2).__name__}: {e2}"[:2000])
        log("stage_time", name=name, seconds=time.perf_counter() - t0)

    if "kernels" in stages and device == "cuda":
        guarded("kernels", stage_kernels, cfg, log)
    if "bundled" in stages:
        guarded("bundled", stage_bundled, device, "bfloat16" if device == "cuda" else "float32", log,
                200 if device == "cuda" else 16, retry_eager=True)
    if "speed" in stages:
        with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as d:
            t0 = time.perf_counter()
            path = write_checkpoint(args.shape, os.path.join(d, args.shape), device, tie_norms=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            log("checkpoint", shape=args.shape, write_s=time.perf_counter() - t0)
            guarded("speed", stage_speed, args.shape, path, device, log, args.prompt, args.tokens, [1, 2],
                    not args.no_plain, retry_eager=True)
    if "collect" in stages and device == "cuda":
        guarded("collect", stage_collect, cfg, log)
    log("done", total_s=time.perf_counter() - t_all)


if __name__ == "__main__":
    main()
