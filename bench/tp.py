"""Tensor parallelism on 2 GPUs: tp1 vs tp2 speed and where a step's time goes, the MTP cycle's
cost, and the identity table (greedy output hashes on every degree).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python -m bench.tp --shape 27B --jobs bundled,ckpt,speed1,speed2,ident1,ident2 --long 8192 --out $OUT
    python -m bench.tp --smoke          # every job on the CPU (gloo), the tiny shape

Each job runs in its own process with a time limit (a hung mesh costs its limit, not the call),
and is skipped when the remaining budget (--budget-s) is below its estimate. Every result is one
JSON line appended to OUT/tp.jsonl as it is measured.

  bundled   the bundled model in bf16: tp2 logits == tp1 (tp_invariant) bitwise, greedy AR
            tokens equal, MTP k=3 == AR on both
  ckpt      random weights of the shape with an MTP head (bench/common.py write_checkpoint), and a
            tied copy whose final norms are -1 (every MTP draft accepted: the best case for speed)
  speedN    tied checkpoint on N ranks: AR and MTP k=1,3 tok/s, cycle cost vs an AR step, the rows
            graphs replayed back to back (the device time of a step with no host in between), the
            MTP draft graphs, and per-rank kernel time by family (torch.profiler, parallel/probe.py);
            --ar-only: AR and the 1-row graph only
  canon1    speed1 with tp_invariant (the bits a mesh computes, on one GPU): what invariance costs
  identN    normal checkpoint on N ranks, tp_invariant: md5 of greedy output,
            AR / MTP k=3 (/ n-gram on tp2) at a short context (--prompt) and a long one (--long)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch

from bench.common import (CEILING, ROOT, Log, checkpoint_step_bytes, machine, md5, model_config, replay_time, scratch_dir,
                          tied_copy, write_checkpoint)

# job -> (estimated seconds, time limit seconds) on the GPU at the 27B shape
JOBS = {"bundled": (35, 120), "ckpt": (40, 120), "speed1": (60, 120), "speed2": (60, 120), "canon1": (60, 120),
        "ident1": (50, 120), "ident2": (40, 100)}


def job_ckpt(cfg, d: str, device: str, log: Log) -> None:
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    write_checkpoint(os.path.join(d, "normal"), cfg, dtype, device)
    tied_copy(os.path.join(d, "normal"), os.path.join(d, "tied"))
    log("ckpt", shape=cfg.hidden_size, write_s=time.perf_counter() - t0)


# ---- speed --------------------------------------------------------------------------------------------

def job_speed(path: str, tp: int, device: str, log: Log, prompt: int, tokens: int, out: str | None,
              shape: str, ar_only: bool = False, canon: bool = False) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.parallel.probe import time_rows

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(path, tp=tp, device=device, progress=False, max_seq_len=prompt + 2 * tokens + 64,
             tp_invariant=canon) as llm:
        load_s = time.perf_counter() - t0
        trunk = llm.engine.trunk
        mtp = llm.engine.drafters.get("mtp")
        if device == "cpu" and mtp is not None:    # smoke: the draft chain's graph flow, emulated
            from specfire.runtime.graphs import DraftGraphs
            mtp.graphs = DraftGraphs(mtp._chain_for, mtp.head.fc.weight.device, emulate=True)
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()
        llm.generate(ids, warm, spec="off")                                 # compile, capture
        ar = llm.generate(ids, sp, spec="off")
        row = dict(shape=shape, tp=tp, canonical=canon, graphs=trunk.graphs_enabled, load_s=load_s,
                   prefill_tok_s=ar.stats["prefill_tok_s"], ar_tok_s=ar.stats["decode_tok_s"],
                   generated=len(ar.token_ids), ar_step_ms=1e3 / ar.stats["decode_tok_s"])
        nb = checkpoint_step_bytes(path, prompt + tokens // 2, llm.dtype.itemsize) / tp
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
        log("speed", **row)
        # the device alone (NaN on the CPU: no graphs): each rows graph replayed back to back, on every rank at once
        probe = dict(shape=shape, tp=tp)
        prof = os.path.join(out, f"prof_{shape}_tp{tp}") if out else None
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
                probe["draft_graph_" + "_".join(map(str, key)) + "_ms"] = replay_time(g, 20) * 1e3
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
                    log("profile", shape=shape, tp=tp, rows=rows, rank=r,
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

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    with LLM(path, tp=tp, device=device, progress=False, max_seq_len=max(contexts) + 2 * tokens + 64,
             tp_invariant=True) as llm:
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


# ---- bundled ------------------------------------------------------------------------------------------

def job_bundled(device: str, log: Log, tokens: int) -> None:
    from specfire import LLM, SamplingParams, SpecPolicy

    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    sp = SamplingParams(max_tokens=tokens)
    res = {}
    dtype = "bfloat16" if device == "cuda" else "float32"
    for tp in (1, 2):
        with LLM(None, tp=tp, device=device, dtype=dtype, progress=False, max_seq_len=512, tp_invariant=True) as llm:
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

def run_job(job: str, args) -> None:
    log = Log(args.out, "tp.jsonl")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
    cfg = model_config(args.shape)
    d = args.ckpt_dir
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.job_limit_s - 15
    if job == "bundled":
        job_bundled(device, log, 200 if device == "cuda" else 16)
    elif job == "ckpt":
        job_ckpt(cfg, d, device, log)
    elif job == "canon1":
        job_speed(os.path.join(d, "tied"), 1, device, log, args.prompt, args.tokens, args.out, args.shape,
                  args.ar_only, canon=True)
    elif job.startswith("speed"):
        job_speed(os.path.join(d, "tied"), int(job[5:]), device, log, args.prompt, args.tokens, args.out, args.shape,
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
    ap.add_argument("--jobs", default="bundled,ckpt,speed1,speed2,ident1,ident2",
                    help="groups in order (,); a+b: lanes at once, lane i on GPU i; a>b: one after another")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip jobs whose estimate exceeds what is left")
    ap.add_argument("--ckpt-dir", default=None, help="where the checkpoints go (default: a fresh dir in /dev/shm)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--commit", default=None, help="recorded in the log (the GPU copy has no .git)")
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
    drive(args, JOBS, ["--ar-only"] if args.ar_only else [])


def _lane(lane: list[str], jobs: dict, args, extra: list[str], gpu: int | None, left: float) -> subprocess.Popen:
    """One shell lane running `lane`'s jobs one after another (a>b), each killed at its own limit."""
    cmds = []
    for job in lane:
        limit = int(min(jobs[job][1], left))
        cmd = [sys.executable, "-m", "bench.tp", "--job", job, "--job-limit-s", str(limit), "--shape", args.shape,
               "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--long", str(args.long),
               "--ckpt-dir", args.ckpt_dir] + (["--smoke"] if args.smoke else []) + extra + \
              (["--out", args.out] if args.out else [])
        cmds.append(f"timeout -s KILL {max(1, limit)} " + " ".join(map(repr, cmd)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return subprocess.Popen(["bash", "-c", " ; ".join(cmds)], start_new_session=True, env=env, cwd=ROOT)


def drive(args, jobs: dict, extra: list[str]) -> None:
    """The parent of a run: `args.jobs` is groups in order (','); in a group 'a+b' runs lanes at
    once (lane i on GPU i), 'a>b' runs jobs one after another in a lane; a group whose estimate
    (jobs[name] = (estimate s, limit s)) exceeds the budget left is skipped. Every job is a child
    process (--job NAME)."""
    import shutil
    import signal
    import tempfile

    unknown = [j for j in args.jobs.replace("+", ",").replace(">", ",").split(",") if j not in jobs]
    if unknown:
        raise SystemExit(f"unknown job(s) {', '.join(unknown)} in --jobs; jobs: {', '.join(jobs)}")
    log = Log(args.out, "tp.jsonl")
    own_dir = args.ckpt_dir is None
    if own_dir:
        args.ckpt_dir = tempfile.mkdtemp(prefix="tp-", dir=scratch_dir())
    log("start", **{**machine(), **({"commit": args.commit} if args.commit else {})}, shape=args.shape, jobs=args.jobs,
        gpus=torch.cuda.device_count())
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
            procs = [(lane, _lane(lane, jobs, args, extra,
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
    finally:
        if own_dir:
            shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    log("done", total_s=args.budget_s - (t_end - time.monotonic()) if args.budget_s < 1e8 else None)


if __name__ == "__main__":
    main()
