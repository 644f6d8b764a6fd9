"""4-bit prefill on one GPU: the products of more than 16 rows through a 4-bit weight, by each path of
kernels/q4/matmul.py (MODE switched in one process), on the 27B shape.

    PYTHONPATH=$PWD python bench/q4_prefill.py --budget-s 170 --out $OUT
    PYTHONPATH=$PWD python bench/q4_prefill.py --smoke          # the flow on the CPU, tiny shape

Model: bench/tp_mtp.py's 4-bit checkpoint (`specfire quantize`'s format: group 128, every projection,
the MTP head's fc and the lm_head 4-bit; random codes, seeded), loaded through `LLM` with
draft_vocab 32768. Paths: "torch" (main before this bench: float32 dequantize through torch ops,
then F.linear; a prefill of at most 16 rows took it too, the last row's lm_head included),
"dequant" (a Triton kernel writes the bf16 weight into a reused scratch buffer, then F.linear;
a prefill of at most 16 rows takes the 4-bit GEMV), "fused" (one Triton kernel dequantizing weight
tiles in registers into tl.dot).

Stages (one JSON line per record on stdout and in OUT/q4_prefill.jsonl):
  kernels  each distinct projection shape of a prefill (trunk layers and the MTP head's fc) at
           --rows rows of random bf16 x: time per path (CUDA events, mean of --kreps after a
           warm-up), TFLOP/s (2 M N K / time) and its fraction of 790 TFLOP/s (the H200's measured
           bf16 dense rate); the dequantize kernel alone (bytes read + written / time, of 4.17 TB/s)
           and F.linear on its output alone; the fused kernel in each --fused config; error of
           each against float32 x @ bf16-dequantized W (relative L2, max |diff| / max |ref|), and
           whether "dequant" gives the torch path's bits.
  e2e      per path and prompt length: trunk.prefill (time to the first token's logits, best of
           --reps, tok/s), the MTP head's prompt catch-up (MtpDrafter.begin over prompt - 1 rows,
           best of --reps), and the prefill's last logits / hidden rows against the torch path's.
  exact    per path: greedy LLM.generate MTP k=3 == AR token for token (--tokens new tokens) at each
           prompt length, and AR's tokens against the torch path's AR tokens.
  bf16     the same model with every 4-bit weight replaced by its bf16 values (dense tensors, the
           stock cuBLAS prefill): trunk.prefill and the head catch-up, for reference.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tp import CEILING, Log, md5, smoke_shapes  # noqa: E402

TENSOR_PEAK = 790e12       # H200 bf16 dense, as measured (the device notes)
FUSED = {                  # name -> MMConfig fields (block_m, block_n, num_warps, num_stages, wa)
    "m128n128w8s3": (128, 128, 8, 3, True),
    "m128n256w8s3": (128, 256, 8, 3, True),
    "m128n128w8s4": (128, 128, 8, 4, True),
    "m128n128w8s3b": (128, 128, 8, 3, False),
    "m64n128w4s4": (64, 128, 4, 4, True),
}


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed(fn, reps: int, cuda: bool) -> float:
    """Mean seconds per call after one warm-up (CUDA events on the GPU)."""
    fn()
    sync(cuda)
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3 / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def quant_linears(llm) -> list:
    """(name, Linear) of every 4-bit projection of the trunk and the MTP head."""
    from specfire.kernels.q4 import QuantWeight

    out = []
    for tag, mod in (("trunk", llm.engine.trunk.model), ("mtp", llm.engine.drafters["mtp"].head)):
        for n, m in mod.named_modules():
            if isinstance(getattr(m, "weight", None), QuantWeight):
                out.append((f"{tag}.{n}", m))
    return out


def err(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (y.float() - ref)
    return {"rel_l2": float(d.norm() / ref.norm()), "max_rel": float(d.abs().max() / ref.abs().max())}


def stage_kernels(llm, rows: list[int], fused: list[str], reps: int, cuda: bool, log: Log, deadline: float) -> None:
    from specfire.kernels.q4 import matmul as T

    shapes = {}
    for name, lin in quant_linears(llm):
        if "lm_head" not in name:                  # a prefill's lm_head product is one row (the GEMV)
            shapes.setdefault(tuple(lin.weight.shape), (name, lin.weight))
    g = torch.Generator(device=llm.engine.trunk.device).manual_seed(5)
    for (n, k), (name, qw) in shapes.items():
        for m in rows:
            if time.monotonic() > deadline:
                log("skipped", what="kernels", shape=[n, k], rows=m, why="time budget")
                continue
            x = torch.randn(m, k, generator=g, device=qw.device, dtype=qw.dtype)
            flop = 2.0 * m * n * k
            w16 = T.q4_dequantize(qw, dtype=qw.dtype)
            ref = F.linear(x.float(), w16.float())
            row = {"shape": [n, k], "weight": name, "rows": m}
            y_torch = qw.linear_dequantized(x)
            y_dq = T.q4_linear_dequant(x, qw)
            row["dequant_equals_torch_bits"] = bool(torch.equal(y_dq, y_torch))
            row["dequant_weight_equals_torch_bits"] = bool(torch.equal(w16, qw.dequantize().to(qw.dtype)))
            paths = {"torch": (lambda: qw.linear_dequantized(x), y_torch),
                     "dequant": (lambda: T.q4_linear_dequant(x, qw), y_dq),
                     "bf16_gemm_only": (lambda: F.linear(x, w16), None)}
            for fname in fused:
                cfg = T.MMConfig(*FUSED[fname])
                paths[f"fused_{fname}"] = ((lambda c=cfg: T.q4_matmul(x, qw, c)), None)
            for pname, (fn, y) in paths.items():
                try:
                    t = timed(fn, reps, cuda)
                    y = fn() if y is None else y
                    row[pname] = {"ms": round(t * 1e3, 4), "tflops": round(flop / t / 1e12, 1),
                                  "of_790": round(flop / t / TENSOR_PEAK, 4), **err(y, ref)}
                except Exception as e:          # one config's failure (e.g. shared memory) must not end the stage
                    row[pname] = {"error": repr(e)[:300]}
            td = timed(lambda: T.q4_dequantize(qw, out=w16, dtype=qw.dtype), reps, cuda)
            nb = qw.nbytes() + n * k * w16.element_size()
            row["dequant_kernel_alone"] = {"ms": round(td * 1e3, 4), "gb_s": round(nb / td / 1e9, 1),
                                           "of_4.17TB_s": round(nb / td / CEILING, 4)}
            log("kernel", **row)


def stage_e2e(llm, prompts: list[int], modes: list[str], reps: int, cuda: bool, log: Log, deadline: float,
              keep: dict, label: str | None = None, suffix: str = "") -> None:
    """trunk.prefill and the head catch-up per path (label: the bf16 model, its one path; suffix:
    added to the logged path name)."""
    from specfire.kernels.q4 import matmul as T

    trunk, mtp = llm.engine.trunk, llm.engine.drafters["mtp"]
    g = torch.Generator().manual_seed(11)
    ids_by_len = {t: torch.randint(0, llm.cfg.vocab_size - 1, (t,), generator=g).to(trunk.device) for t in prompts}
    for mode in ([label] if label else modes):
        if not label:
            T.MODE = mode
        for t, ids in ids_by_len.items():
            if time.monotonic() > deadline:
                log("skipped", what="e2e", mode=mode, prompt=t, why="time budget")
                continue
            best, head, rows = float("inf"), float("inf"), None
            for _ in range(reps):
                sync(cuda)
                t0 = time.perf_counter()
                trunk.begin()
                rows = trunk.prefill(ids)
                sync(cuda)
                t1 = time.perf_counter()
                mtp.begin(ids, rows.hidden)
                sync(cuda)
                t2 = time.perf_counter()
                best, head = min(best, t1 - t0), min(head, t2 - t1)
            row = {"mode": mode + suffix, "prompt": t, "prefill_ms": round(best * 1e3, 2),
                   "prefill_tok_s": round(t / best, 1),
                   "head_catchup_ms": round(head * 1e3, 2), "first_token_with_head_ms": round((best + head) * 1e3, 2)}
            base = keep.get(t)
            if base is None and mode == "torch":
                keep[t] = (rows.logits[-1].float().clone(), rows.hidden.float().clone())
            elif base is not None:
                row["logits_vs_torch"] = err(rows.logits[-1], base[0])
                row["hidden_vs_torch"] = err(rows.hidden, base[1])
                row["same_first_token_as_torch"] = int(rows.logits[-1].argmax()) == int(base[0].argmax())
            log("e2e", **row)


DQ_SWEEP = [(64, 4, 4), (64, 1, 4), (64, 2, 4), (64, 8, 4), (128, 2, 4), (128, 4, 8), (32, 4, 2), (64, 4, 2),
            (64, 2, 2), (128, 1, 4)]


def stage_dqsweep(llm, reps: int, cuda: bool, log: Log, deadline: float) -> dict:
    """The dequantize kernel per distinct prefill weight shape in each DQ_SWEEP setting (block_n,
    gb, num_warps) and the current default (dequant_config): time, bytes / time; returns the
    fastest setting per shape."""
    from specfire.kernels.q4 import matmul as T

    shapes = {}
    for name, lin in quant_linears(llm):
        if "lm_head" not in name:
            shapes.setdefault(tuple(lin.weight.shape), lin.weight)
    best = {}
    for (n, k), qw in shapes.items():
        if time.monotonic() > deadline:
            log("skipped", what="dqsweep", shape=[n, k], why="time budget")
            continue
        w = T.q4_dequantize(qw, dtype=qw.dtype)
        ref = w.clone()
        nb = qw.nbytes() + n * k * w.element_size()
        cur = T.dequant_config(n, k, qw.group_size)
        row, top = {"shape": [n, k], "default": list(cur.__dict__.values())}, None
        for c in [tuple(cur.__dict__.values())] + [c for c in DQ_SWEEP if c != tuple(cur.__dict__.values())]:
            cfg = T.DequantConfig(*c)
            w.zero_()
            t = timed(lambda: T.q4_dequantize(qw, out=w, dtype=qw.dtype, cfg=cfg), reps, cuda)
            ok = bool(torch.equal(w, ref))
            row["x".join(map(str, c))] = {"us": round(t * 1e6, 1), "of_4.17TB_s": round(nb / t / CEILING, 4),
                                          "equal": ok}
            if ok and (top is None or t < top[0]):
                top = (t, cfg)
        best[(n, k)] = top[1]
        row["best"] = list(top[1].__dict__.values())
        log("dqsweep", **row)
    return best


def stage_exact(llm, prompts: list[int], modes: list[str], tokens: int, log: Log, deadline: float) -> None:
    from specfire import SamplingParams, SpecPolicy
    from specfire.kernels.q4 import matmul as T

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ar_torch = {}
    for mode in modes:
        T.MODE = mode
        for t in prompts:
            if time.monotonic() > deadline:
                log("skipped", what="exact", mode=mode, prompt=t, why="time budget")
                continue
            gen = torch.Generator().manual_seed(13 + t)
            ids = torch.randint(0, llm.cfg.vocab_size - 1, (t,), generator=gen).tolist()
            a = llm.generate(ids, sp, spec="off")
            m = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            if mode == "torch":
                ar_torch[t] = a.token_ids
            row = {"mode": mode, "prompt": t, "tokens": tokens, "mtp_equals_ar": m.token_ids == a.token_ids,
                   "ar_md5": md5(a.token_ids), "tau": round(m.stats["mean_accept_len"], 3),
                   "ar_prefill_ms": round(a.stats["prefill_s"] * 1e3, 2),
                   "mtp_prefill_ms": round(m.stats["prefill_s"] * 1e3, 2),
                   "ar_decode_tok_s": round(a.stats["decode_tok_s"], 1),
                   "mtp_decode_tok_s": round(m.stats["decode_tok_s"], 1)}
            if t in ar_torch and mode != "torch":
                row["ar_equals_torch_path_ar"] = a.token_ids == ar_torch[t]
            log("exact", **row)


def stage_bf16(llm, prompts: list[int], reps: int, cuda: bool, log: Log, deadline: float) -> None:
    """Every 4-bit weight replaced by a dense tensor of its bf16 values, timed, then put back."""
    from specfire.kernels.q4 import matmul as T

    swapped = []
    try:
        for name, lin in quant_linears(llm):
            qw = lin.weight
            if qw.hadamard:
                raise SystemExit("bf16 stage: rotated weights are not supported here")
            dense = T.q4_dequantize(qw, dtype=qw.dtype) if cuda else qw.dequantize().to(qw.dtype)
            del lin.weight
            lin.weight = torch.nn.Parameter(dense, requires_grad=False)
            swapped.append((lin, qw))
        log("progress", what="bf16", weights=len(swapped),
            gb=round(sum(lin.weight.numel() * 2 for lin, _ in swapped) / 1e9, 2))
        stage_e2e(llm, prompts, [], reps, cuda, log, deadline, {}, label="bf16")
    finally:
        for lin, qw in swapped:
            del lin.weight
            lin.weight = qw
        if cuda:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--vocab", type=int, default=32768, help="draft vocabulary (0: the whole one)")
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--rows", default="511,1024,4095", help="rows of the kernel stage")
    ap.add_argument("--modes", default="torch,dequant,fused")
    ap.add_argument("--fused", default="m128n128w8s3,m128n256w8s3,m128n128w8s4,m64n128w4s4",
                    help=f"fused kernel configs of the kernel stage (known: {', '.join(FUSED)})")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kreps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--stages", default="kernels,e2e,exact,bf16",
                    help="of kernels, dqsweep (then e2e of dequant with the sweep's winners: 'dequant+tuned'), "
                         "e2e, exact, bf16")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what would start past this")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: the flow, no timings worth keeping")
    args = ap.parse_args()
    t_end = time.monotonic() + args.budget_s
    prompts = [int(v) for v in args.prompts.split(",") if v]
    rows = [int(v) for v in args.rows.split(",") if v]
    modes = [v for v in args.modes.split(",") if v]
    fused = [v for v in args.fused.split(",") if v]
    stages = set(args.stages.split(","))
    for v in fused:
        if v not in FUSED:
            raise SystemExit(f"--fused: unknown config {v!r} (known: {', '.join(FUSED)})")
    from specfire.kernels.q4 import matmul as T
    for v in modes:
        if v not in T.MODES:
            raise SystemExit(f"--modes: unknown path {v!r} (known: {', '.join(T.MODES)})")
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"

    import tp_mtp
    if args.smoke:
        smoke_shapes()
        args.shape, args.vocab, args.tokens = "tiny", 100, 8
        prompts, rows, args.reps, args.kreps = [40], [20], 1, 1
        tp_mtp.GROUP = 32
        FUSED.update({k: (16, 16, 1, 1, v[4]) for k, v in FUSED.items()})
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    log = Log(args.out, name="q4_prefill.jsonl")
    log("start", commit=args.commit, shape=args.shape, torch=torch.__version__, default_mode=T.MODE,
        device=torch.cuda.get_device_name() if cuda else "cpu")
    d = tempfile.mkdtemp(prefix="q4pre-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    default = T.MODE
    try:
        from specfire import LLM
        t0 = time.perf_counter()
        tp_mtp.job_q4ckpt(cfg, d, device, log)
        with LLM(os.path.join(d, "q4"), device=device, progress=False, max_seq_len=max(prompts) + 2 * args.tokens + 64,
                 draft_vocab=args.vocab or None) as llm:
            log("progress", what="loaded", s=round(time.perf_counter() - t0, 1))
            if "kernels" in stages:
                stage_kernels(llm, rows, fused, args.kreps, cuda, log, t_end - 100)
                log("progress", what="kernels", s=round(time.perf_counter() - t0, 1))
            keep: dict = {}
            if "e2e" in stages:
                stage_e2e(llm, prompts, modes, args.reps, cuda, log, t_end - 60, keep)
                log("progress", what="e2e", s=round(time.perf_counter() - t0, 1))
            if "dqsweep" in stages:
                won = stage_dqsweep(llm, args.kreps, cuda, log, t_end - 80)
                T.DQ_MEASURED.update(won)
                log("progress", what="dqsweep", s=round(time.perf_counter() - t0, 1),
                    installed={f"{n}x{k}": list(c.__dict__.values()) for (n, k), c in won.items()})
                stage_e2e(llm, prompts, ["dequant"], args.reps, cuda, log, t_end - 60, keep, suffix="+tuned")
            keep.clear()
            if "exact" in stages:
                stage_exact(llm, prompts, [m for m in modes if m != default] + [default], args.tokens, log, t_end - 25)
                log("progress", what="exact", s=round(time.perf_counter() - t0, 1))
            if "bf16" in stages:
                stage_bf16(llm, prompts, args.reps, cuda, log, t_end - 5)
    finally:
        T.MODE = default
        shutil.rmtree(d, ignore_errors=True)
    log("done", seconds=round(time.monotonic() - (t_end - args.budget_s), 1))


if __name__ == "__main__":
    main()
