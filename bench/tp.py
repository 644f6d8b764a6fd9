"""Tensor parallelism on 2 GPUs: speed of tp1 vs tp2 and where a step's time goes, MTP cycle
cost, the collectives' share, and the identity table (greedy output hashes on every degree).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=$PWD python bench/tp.py --shape 27B --jobs kernels,bundled,ckpt,speed1,speed2,collect --out $OUT
    PYTHONPATH=$PWD python bench/tp.py --smoke          # every job on the CPU, tiny shapes

Each job runs in its own process with a time limit (a hung mesh costs its limit, not the call),
and is skipped when the remaining budget (--budget-s) is below its estimate. Every result is one
JSON line appended to OUT/tp.jsonl as it is measured.

  kernels   the tree loop with 1/2/4 programs per tile and the grouped column launch vs the plain
            forms, bitwise; the faster bit-equal forms become the later jobs' settings (tp_kernels.py)
  bundled   the bundled model in bf16: tp2 logits == tp1 (canonical split on) bitwise, greedy AR
            tokens equal, MTP k=3 == AR on both
  ckpt      random weights of the shape with an MTP head, written once (--ckpt-dir); a second
            directory of hard links whose final norms are -1 (every logit ties, so every MTP draft
            is accepted: the best case for speed; identity there is meaningless)
  speedN    tied checkpoint on N ranks: AR and MTP k=1,3 tok/s, cycle cost vs an AR step, the rows
            graphs replayed back to back (the device time of a step with no host in between), the
            MTP draft graph, and per-rank kernel time by family (torch.profiler, parallel/probe.py);
            --ar-only: AR and the 1-row graph only
  identN    normal checkpoint on N ranks (tp1 with the canonical split on): md5 of greedy output,
            AR / MTP k=3 (/ n-gram on tp2) at a short context (--prompt) and a long one (--long)
  collect   a decode step's collectives alone, replayed from one CUDA graph
  prefill   one GPU: a head's prefill attention with all heads vs a tp2 / tp4 rank's heads, bitwise
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

CEILING = 4.17e12     # measured device-to-device copy bandwidth of the H200 (bytes/s)
# job -> (estimated seconds, time limit seconds) on the GPU at the 27B shape
JOBS = {"kernels": (40, 120), "bundled": (35, 120), "ckpt": (30, 100), "speed1": (60, 120), "speed2": (60, 120),
        "ident1": (50, 120), "ident2": (40, 100), "collect": (12, 90), "prefill": (10, 60)}


class Log:
    """One JSON line per record, on stdout and appended to OUT/<name> (the benches that share tp.py's jobs)."""

    def __init__(self, out: str | None, job: str = "", name: str = "tp.jsonl"):
        self.path = os.path.join(out, name) if out else None
        self.job = job

    def __call__(self, stage: str, **kw) -> None:
        row = {"stage": stage, **kw}
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def md5(ids: list[int]) -> str:
    return hashlib.md5(json.dumps(ids).encode()).hexdigest()


# ---- ckpt -------------------------------------------------------------------------------------------

def job_ckpt(cfg, d: str, device: str, log: Log) -> None:
    """d/normal: random weights + MTP head; d/tied: hard links to it plus one small file, sorted
    last (the loader's later file wins a name), holding the two final norms at -1."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file
    from decode import build

    from specfire.model.qwen35 import MtpHead
    from specfire.train.export import export_checkpoint

    t0 = time.perf_counter()
    dt = torch.bfloat16
    normal, tied = os.path.join(d, "normal"), os.path.join(d, "tied")
    trunk = build(cfg, device, dt)
    with torch.device("meta"):
        head = MtpHead(cfg)
    head = head.to(dt).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for _, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dt) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    with ThreadPoolExecutor(8) as pool, parallel_export(pool) as pending:
        export_checkpoint(trunk, head, normal, eos_ids=[cfg.vocab_size - 1], dtype=dt, max_shard_bytes=2 << 30)
        for f in pending:
            f.result()
    del trunk, head
    os.makedirs(tied, exist_ok=True)
    for f in os.listdir(normal):
        if f.endswith(".safetensors"):
            os.link(os.path.join(normal, f), os.path.join(tied, f))
        elif f != "model.safetensors.index.json":
            with open(os.path.join(normal, f), "rb") as a, open(os.path.join(tied, f), "wb") as b:
                b.write(a.read())
    tie = {"model.norm.weight": torch.full((cfg.hidden_size,), -1.0, dtype=dt),
           "mtp.norm.weight": torch.full((cfg.hidden_size,), -1.0, dtype=dt)}
    tie_file = "model.zzzzz-tied-norms.safetensors"        # sorts after every model shard name
    save_file(tie, os.path.join(tied, tie_file), metadata={"format": "pt"})
    idx = os.path.join(normal, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
    else:                                                    # one file: an index naming both
        from safetensors import safe_open
        with safe_open(os.path.join(normal, "model.safetensors"), "pt") as h:
            wm = {k: "model.safetensors" for k in h.keys()}
    wm.update({k: tie_file for k in tie})
    with open(os.path.join(tied, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    if device == "cuda":
        torch.cuda.empty_cache()
    log("ckpt", shape=cfg.hidden_size, write_s=time.perf_counter() - t0)


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                      torch.uint8: "U8"}       # U8: 4-bit codes, two to a byte (bench/tp_mtp.py q4ckpt)


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    """The safetensors layout (8-byte header length, JSON header, raw bytes in header order),
    written tensor by tensor from the device: no whole-shard host copy, and the file writes
    release the GIL, so several shards are written at once."""
    import struct

    names = sorted(tensors)
    header, off = {}, 0
    for k in names:
        t = tensors[k]
        nb = t.numel() * t.element_size()
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"write_safetensors: {k} is {t.dtype}; this writer takes {sorted(map(str, SAFETENSORS_DTYPES))}")
        header[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nb]}
        off += nb
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for k in names:
            t = tensors[k].detach().contiguous().reshape(-1).to("cpu")
            f.write(t.view(torch.uint8).numpy().data)


@contextlib.contextmanager
def parallel_export(pool):
    """export_checkpoint with its shards written by `pool` straight from the device (the 27B shape's
    54 GB took 75 s through safetensors' writer one shard after another). Yields the futures."""
    from specfire.train import export

    ct, sf = export.checkpoint_tensors, export.save_file
    pending: list = []

    def tensors(trunk, head, dtype):
        out = {(n if n == "lm_head.weight" else "model." + n): p.detach().to(dtype) for n, p in trunk.named_parameters()}
        out.update({"mtp." + n: p.detach().to(dtype) for n, p in head.named_parameters()})
        return out

    def save(shard, fn, metadata=None):
        pending.append(pool.submit(write_safetensors, dict(shard), fn, metadata))
    export.checkpoint_tensors, export.save_file = tensors, save
    try:
        yield pending
    finally:
        export.checkpoint_tensors, export.save_file = ct, sf


def step_bytes(cfg, tp: int, ctx: int) -> float:
    """Bytes one decode step must move per rank: every trunk weight once (the embedding: one row),
    KV up to ctx, GDN state read and written; a 1/tp share of each (norms are negligible)."""
    from decode import step_bytes as whole

    from specfire.model.qwen35 import Qwen35Trunk
    with torch.device("meta"):
        m = Qwen35Trunk(cfg).to(torch.bfloat16)
    return whole(m, ctx, 2) / tp


# ---- speed --------------------------------------------------------------------------------------------

def _time_graph(graph, n: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        graph.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3 / n


def job_speed(cfg, path: str, tp: int, device: str, log: Log, prompt: int, tokens: int, out: str | None,
              shape: str, ar_only: bool = False, tag: str = "") -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.parallel.probe import time_rows

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(path, tp=tp, device=device, progress=False, max_seq_len=prompt + 2 * tokens + 64) as llm:
        load_s = time.perf_counter() - t0
        trunk = llm.engine.trunk
        mtp = llm.engine.drafters.get("mtp")
        if device == "cpu" and mtp is not None:    # smoke: the draft chain's graph flow, emulated
            from specfire.runtime.graphs import DraftGraphs
            mtp.graphs = DraftGraphs(mtp._chain_for, mtp.head.fc.weight.device, emulate=True)
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()
        llm.generate(ids, warm, spec="off")                                 # compile, capture
        ar = llm.generate(ids, sp, spec="off")
        row = dict(shape=shape, tp=tp, variant=tag or "default",
                   graphs=trunk.graphs_enabled, load_s=load_s,
                   prefill_tok_s=ar.stats["prefill_tok_s"], ar_tok_s=ar.stats["decode_tok_s"],
                   generated=len(ar.token_ids), ar_step_ms=1e3 / ar.stats["decode_tok_s"])
        nb = step_bytes(llm.cfg, tp, prompt + tokens // 2)
        row["step_bytes_per_rank"] = nb
        row["ar_bw_frac"] = nb * ar.stats["decode_tok_s"] / CEILING
        for k in (() if ar_only else (1, 3)):
            llm.generate(ids, warm, spec=SpecPolicy("mtp", k=k))
            r = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=k))
            cyc = r.stats["decode_s"] / max(1, r.stats["cycles"])
            row[f"mtp{k}_tok_s"] = r.stats["decode_tok_s"]
            row[f"mtp{k}_tau"] = r.stats["mean_accept_len"]
            row[f"mtp{k}_cycle_ms"] = cyc * 1e3
            row[f"mtp{k}_cycle_vs_ar_step"] = cyc * ar.stats["decode_tok_s"]
            row[f"mtp{k}_equals_ar"] = r.token_ids == ar.token_ids
        if getattr(mtp, "graphs", None) is not None and not ar_only:     # the same k=3 run without this session's draft changes
            variants = [("noahead", False, getattr(trunk, "draft_sharded", False))]
            if getattr(trunk, "draft_sharded", False):
                variants.append(("noahead_whole", False, False))
            for name, ahead, sharded in variants:
                mtp.ahead = ahead
                if getattr(trunk, "draft_sharded", False) != sharded:
                    trunk.draft_sharded = sharded
                    mtp.graphs.clear()                  # rank 0's chain graphs keep the picks they captured
                llm.generate(ids, warm, spec=SpecPolicy("mtp", k=3))
                r = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
                cyc = r.stats["decode_s"] / max(1, r.stats["cycles"])
                row[f"mtp3_{name}_tok_s"] = r.stats["decode_tok_s"]
                row[f"mtp3_{name}_cycle_vs_ar_step"] = cyc * ar.stats["decode_tok_s"]
                row[f"mtp3_{name}_equals_ar"] = r.token_ids == ar.token_ids
            mtp.ahead = True
            if variants[-1][2] != variants[0][2]:
                trunk.draft_sharded = True
                mtp.graphs.clear()
            llm.generate(ids, warm, spec=SpecPolicy("mtp", k=3))   # the probe below times the default graphs
            llm.generate(ids, warm, spec=SpecPolicy("mtp", k=1))
        log("speed", **row)
        # the device alone (NaN on the CPU: no graphs): each rows graph replayed back to back, on every rank at once
        probe = dict(shape=shape, tp=tp, variant=tag or "default")
        prof = os.path.join(out, f"prof_{shape}_tp{tp}{tag}") if out else None
        for rows in ((1,) if ar_only else (1, 2, 4)):
            p = prof + f"_r{rows}" if prof and rows in (1, 4) else None
            if tp == 1:
                t = [time_rows(trunk, rows, 20, p, rank=0)]
            else:
                t = trunk.rank_time(rows, 20, p)
            probe[f"replay_r{rows}_ms"] = [v * 1e3 for v in t]
        probe["ar_host_overhead_ms"] = row["ar_step_ms"] - max(probe["replay_r1_ms"])
        probe["replay_r1_bw_frac"] = nb / (max(probe["replay_r1_ms"]) / 1e3) / CEILING
        dg = getattr(mtp, "graphs", None)
        if dg is not None and device == "cuda":
            for key, gr in sorted(dg.graphs.items(), key=lambda kv: str(kv[0])):   # key: the drafter's tuple
                g = getattr(gr, "graph", gr)            # a CUDA graph, or a FnGraphs entry (has .replay)
                if tp > 1 and getattr(trunk, "draft_sharded", False) and key[2] in (None, "after"):
                    trunk.draft_rounds(key[1], 0, 21, now=True)   # the peers replay their side as often
                probe["draft_graph_" + "_".join(map(str, key)) + "_ms"] = _time_graph(g, 20) * 1e3
            for k in (1, 3):     # what a cycle costs beyond the device time of its draft and verify graphs
                d = probe.get(f"draft_graph_{k + 1}_{k}_after_ms", probe.get(f"draft_graph_{k + 1}_{k}_None_ms"))
                if d is not None and f"replay_r{k + 1}_ms" in probe:
                    probe[f"mtp{k}_host_gap_ms"] = row[f"mtp{k}_cycle_ms"] - max(probe[f"replay_r{k + 1}_ms"]) - d
        probe["draft_sharded"] = bool(getattr(trunk, "draft_sharded", False))
        log("probe", **probe)
        for rows in ((1,) if ar_only else (1, 4)):
            for r in range(tp):
                f = f"{prof}_r{rows}.rank{r}.json" if prof else None
                if f and os.path.exists(f):
                    with open(f) as fh:
                        body = json.load(fh)
                    log("profile", shape=shape, tp=tp, variant=tag or "default", rows=rows, rank=r,
                        families=body["families_per_replay"],
                        top=body["top_kernels_per_replay"][:16])
                    os.unlink(f)                     # logged: keep OUT to a few files
                if f and os.path.exists(f[:-5] + ".error"):
                    with open(f[:-5] + ".error") as fh:
                        log("error", where=f"profile tp{tp} r{rows} rank{r}", error=fh.read()[:500])
                    os.unlink(f[:-5] + ".error")


# ---- identity ---------------------------------------------------------------------------------------

def job_ident(path: str, tp: int, device: str, log: Log, contexts: list[int], tokens: int, shape: str,
              deadline: float) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.kernels import canonical

    canonical.set_enabled(True)          # tp1 computes the mesh's canonical split (off by default on one GPU)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    with LLM(path, tp=tp, device=device, progress=False, max_seq_len=max(contexts) + 2 * tokens + 64) as llm:
        log("progress", job=f"ident{tp}", load_s=time.perf_counter() - t0)
        for ctx in contexts:
            if time.monotonic() > deadline:
                log("skipped", job=f"ident{tp}", context=ctx, why="time budget")
                continue
            g = torch.Generator().manual_seed(ctx)
            body = torch.randint(0, llm.cfg.vocab_size - 1, (ctx - ctx // 4,), generator=g).tolist()
            ids = (body + body[: ctx // 4])[:ctx]                  # a repeat: n-gram lookup finds drafts
            runs = [("ar", "off"), ("mtp3", SpecPolicy("mtp", k=3))] + ([("ngram4", SpecPolicy("ngram", k=4))] if tp > 1 else [])
            row = dict(shape=shape, tp=tp, context=ctx, tokens=tokens)
            for name, spec in runs:
                t1 = time.perf_counter()
                r = llm.generate(ids, sp, spec=spec)
                row[name] = md5(r.token_ids)
                row[name + "_s"] = time.perf_counter() - t1
                row[name + "_distinct_tokens"] = len(set(r.token_ids))
                if name != "ar":     # equal accepted counts across degrees: the drafts agreed too
                    row[name + "_drafted"] = r.stats["drafted"]
                    row[name + "_accepted"] = r.stats["accepted"]
            log("identity", **row)
    canonical.set_enabled(None)


# ---- bundled ------------------------------------------------------------------------------------------

def job_bundled(device: str, log: Log, tokens: int) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.kernels import canonical

    canonical.set_enabled(True)
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    sp = SamplingParams(max_tokens=tokens)
    res = {}
    dtype = "bfloat16" if device == "cuda" else "float32"
    for tp in (1, 2):
        with LLM(None, tp=tp, device=device, dtype=dtype, progress=False, max_seq_len=512) as llm:
            ids = llm.tokenizer.encode(text)
            lg = llm.score(ids).cpu()
            llm.generate(ids, SamplingParams(max_tokens=16), spec="off")
            llm.generate(ids, SamplingParams(max_tokens=16), spec=SpecPolicy("mtp", k=3))
            ar = llm.generate(ids, sp, spec="off")
            mtp = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            res[tp] = (lg, ar.token_ids, mtp.token_ids)
            log("bundled", tp=tp, graphs=llm.engine.trunk.graphs_enabled, ar_tok_s=ar.stats["decode_tok_s"],
                mtp_tok_s=mtp.stats["decode_tok_s"], mtp_equals_ar=mtp.token_ids == ar.token_ids,
                mean_accept_len=mtp.stats.get("mean_accept_len"))
    (lg1, ar1, _), (lg2, ar2, mtp2) = res[1], res[2]
    log("bundled", logits_tp2_equal_tp1=bool(torch.equal(lg1, lg2)), ar_tokens_equal=ar1 == ar2,
        mtp_tp2_equals_ar_tp1=mtp2 == ar1, tokens=len(ar1), ar_md5=md5(ar1))


# ---- driver -------------------------------------------------------------------------------------------

def smoke_shapes() -> None:
    import dataclasses

    import decode
    decode.SHAPES["tiny"] = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                                 tie_word_embeddings=False)
    make = decode.make_cfg
    decode.make_cfg = lambda name: dataclasses.replace(make(name), vocab_size=512, head_dim=16, linear_key_head_dim=16,
                                                       linear_value_head_dim=16)


def run_job(job: str, args) -> None:
    log = Log(args.out, job)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        smoke_shapes()
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    d = args.ckpt_dir
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.job_limit_s - 15
    if job == "kernels":
        from tp_kernels import stage_kernels
        stage_kernels(cfg, log, os.path.join(d, "best_loop.json"))
    elif job == "prefill":
        from tp_kernels import stage_prefill_heads
        stage_prefill_heads(cfg, log, device)
    elif job == "collect":
        from tp_kernels import stage_collect
        stage_collect(cfg, log)
    elif job == "bundled":
        job_bundled(device, log, 200 if device == "cuda" else 16)
    elif job == "ckpt":
        job_ckpt(cfg, d, device, log)
    elif job.startswith("speed"):
        job_speed(cfg, os.path.join(d, "tied"), int(job[5:]), device, log, args.prompt, args.tokens, args.out, args.shape,
                  args.ar_only)
    elif job.startswith("ident"):
        ctxs = [args.prompt] + ([args.long] if args.long else [])
        job_ident(os.path.join(d, "normal"), int(job[5:]), device, log, ctxs, args.tokens, args.shape, deadline)
    else:
        raise SystemExit(f"unknown job {job!r}; jobs: {', '.join(JOBS)}")
    log("job_time", job=job, seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--long", type=int, default=0, help="the long context of the identity table (0: none)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--jobs", default="kernels,bundled,ckpt,speed1,speed2,collect,ident1,ident2",
                    help="groups in order (,); a+b: lanes at once, lane i on GPU i; a>b: one after another")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip jobs whose estimate exceeds what is left")
    ap.add_argument("--ckpt-dir", default=None, help="where the checkpoints go (default: a fresh dir in /dev/shm)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--commit", default=None, help="recorded in the log (the GPU copy has no .git)")
    ap.add_argument("--keep-kernel", action="store_true", help="do not apply the kernels job's choice of forms")
    ap.add_argument("--ar-only", action="store_true", help="speed jobs: AR and the 1-row graph only (no MTP)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check the flow, no timings worth keeping")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)            # a child: run this one job
    ap.add_argument("--job-limit-s", type=float, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.prompt, args.tokens = "tiny", min(args.prompt, 60), 8
        args.long = min(args.long, 120)
    if args.job:
        run_job(args.job, args)
        return
    extra = ["--ar-only"] if args.ar_only else []

    def after(jobs: list[str], log: Log) -> None:
        best = os.path.join(args.ckpt_dir, "best_loop.json")
        if "kernels" in jobs and os.path.exists(best) and not args.keep_kernel:
            with open(best) as f:
                env = json.load(f)
            os.environ.update(env)          # the later jobs run the fastest bit-equal forms
            log("kernel_choice", env=env)

    drive(args, JOBS, os.path.abspath(__file__), "tp-", extra, after)


def _lane(lane: list[str], jobs: dict, args, script: str, extra: list[str], gpu: int | None,
          left: float) -> subprocess.Popen:
    """One shell lane running `lane`'s jobs one after another (a>b), each killed at its own limit."""
    cmds = []
    for job in lane:
        limit = int(min(jobs[job][1], left))
        cmd = [sys.executable, script, "--job", job, "--job-limit-s", str(limit), "--shape", args.shape,
               "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--long", str(args.long),
               "--ckpt-dir", args.ckpt_dir] + (["--smoke"] if args.smoke else []) + extra + \
              (["--out", args.out] if args.out else [])
        cmds.append(f"timeout -s KILL {max(1, limit)} " + " ".join(map(repr, cmd)))
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return subprocess.Popen(["bash", "-c", " ; ".join(cmds)], start_new_session=True, env=env)


def drive(args, jobs: dict, script: str, prefix: str, extra: list[str] | None = None, after=None) -> None:
    """The parent of a bench run: `args.jobs` is groups in order (','); in a group 'a+b' runs lanes at
    once (lane i on GPU i), 'a>b' runs jobs one after another in a lane; a group whose estimate
    (jobs[name] = (estimate s, limit s)) exceeds the budget left is skipped; `after(group_jobs, log)`
    runs after each group. Every job is a child process of `script` (--job NAME)."""
    import shutil
    import signal
    import tempfile

    unknown = [j for j in args.jobs.replace("+", ",").replace(">", ",").split(",") if j not in jobs]
    if unknown:
        raise SystemExit(f"unknown job(s) {', '.join(unknown)} in --jobs; jobs: {', '.join(jobs)}")
    log = Log(args.out)
    own_dir = args.ckpt_dir is None
    if own_dir:
        args.ckpt_dir = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    log("start", commit=args.commit, shape=args.shape, jobs=args.jobs,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
        gpus=torch.cuda.device_count(), torch=torch.__version__,
        env={k: v for k, v in os.environ.items() if k.startswith("SPECFIRE_")})
    t_end = time.monotonic() + args.budget_s
    try:
        for group in args.jobs.split(","):
            lanes = [lane.split(">") for lane in group.split("+")]
            est = max(sum(jobs[j][0] for j in lane) for lane in lanes)
            left = t_end - time.monotonic()
            if left < est:
                log("skipped", job=group, why=f"{left:.0f} s left, estimate {est} s")
                continue
            t0 = time.perf_counter()
            procs = [(lane, _lane(lane, jobs, args, script, extra or [],
                                  i if len(lanes) > 1 and not args.smoke else None, left))
                     for i, lane in enumerate(lanes)]
            for lane, p in procs:
                try:
                    rc = p.wait(timeout=max(1.0, t_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    rc = "killed at the budget"
                if rc != 0:
                    log("error", where=f"lane {'>'.join(lane)}", error=f"exited with {rc}",
                        seconds=time.perf_counter() - t0)
            if after is not None:
                after([j for lane in lanes for j in lane], log)
    finally:
        if own_dir:
            shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    log("done", total_s=args.budget_s - (t_end - time.monotonic()) if args.budget_s < 1e8 else None)


if __name__ == "__main__":
    main()
