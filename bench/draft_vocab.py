"""A reduced draft vocabulary for the MTP drafter (`LLM(path, draft_vocab=N)`): what it saves in
one MTP cycle on one GPU, on the 27B shape with random weights.

    PYTHONPATH=$PWD python bench/draft_vocab.py --shape 27B --vocab 32768,16384 --budget-s 200 --out $OUT
    PYTHONPATH=$PWD python bench/draft_vocab.py --smoke      # the same flow on the CPU, tiny shape
    PYTHONPATH=$PWD python bench/draft_vocab.py --bundled --vocab 2048,1024,512   # acceptance, bundled model, CPU

The checkpoint is bench/tp.py's "tied" one (final norms -1: every logit ties, greedy picks token 0,
which lies inside every prefix [0, N), so every draft is accepted with and without a draft
vocabulary: acceptance is unchanged by construction and the figures isolate the cost). One load;
the draft vocabulary is switched in the process by setting the trunk's `draft_vocab` (what the
load-time option sets, runtime/trunk.py) and dropping the captured draft graphs. Per setting:
AR step, MTP k=3 and k=1 tok/s and cycle / AR step, MTP == AR, each captured draft chain graph
replayed alone, the drafter's lm_head product alone, and one sampled MTP k=3 request (the accept
with a narrower q, through its graph). `--q4`: the same on a 4-bit checkpoint of the shape
(bench/tp_mtp.py q4ckpt, final norms -1 too) when the budget leaves room.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tp import CEILING, Log, _time_graph, job_ckpt, md5, smoke_shapes, step_bytes  # noqa: E402


def tie_norms(src: str, dst: str, cfg) -> None:
    """dst: hard links to src's shards plus one file (named last) holding both final norms at -1."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            os.link(os.path.join(src, f), os.path.join(dst, f))
        elif f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    tie = {"model.norm.weight": torch.full((cfg.hidden_size,), -1.0, dtype=torch.bfloat16),
           "mtp.norm.weight": torch.full((cfg.hidden_size,), -1.0, dtype=torch.bfloat16)}
    fn = "model.zzzzz-tied-norms.safetensors"
    save_file(tie, os.path.join(dst, fn), metadata={"format": "pt"})
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    wm.update({k: fn for k in tie})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def _cycle(llm, ids, sp, k):
    from specfire import SpecPolicy

    r = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=k))
    return r, r.stats["decode_s"] / max(1, r.stats["cycles"])


def _lm_ms(trunk, device: str, n: int = 50) -> float:
    """The drafter's lm_head product alone (trunk.lm_logits of one row), eager, median of 3 x n calls."""
    h = torch.randn(1, trunk.cfg.hidden_size, device=device, dtype=trunk.model.embed_tokens.weight.dtype)
    trunk.lm_logits(h)
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            trunk.lm_logits(h)
        return (time.perf_counter() - t0) / n * 1e3
    out = []
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            trunk.lm_logits(h)
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / n)
    return sorted(out)[1]


def run_model(path: str, label: str, vocabs: list[int | None], device: str, log: Log, prompt: int, tokens: int,
              shape: str, deadline: float, nbytes) -> None:
    from specfire import LLM, SamplingParams
    from specfire.runtime.graphs import DraftGraphs

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8, seed=1)
    with LLM(path, device=device, progress=False, max_seq_len=prompt + 2 * tokens + 64) as llm:
        trunk, mtp = llm.engine.trunk, llm.engine.drafters["mtp"]
        if device == "cpu":                                 # smoke: the draft chain's and accept's graph flow, emulated
            from specfire.runtime.spec import StepBuffers
            mtp.graphs = DraftGraphs(mtp._chain_for, mtp.head.fc.weight.device, emulate=True)
            llm.engine.bufs = StepBuffers(trunk.device, emulate=True)
        log("progress", what=label, loaded_s=time.perf_counter() - t0)
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (prompt,), generator=g).tolist()
        llm.generate(ids, warm, spec="off")
        ar = llm.generate(ids, sp, spec="off")
        ar_step = 1.0 / ar.stats["decode_tok_s"]
        nb = nbytes(llm.cfg, prompt + tokens // 2)
        base = dict(shape=shape, weights=label, ar_tok_s=ar.stats["decode_tok_s"], ar_step_ms=ar_step * 1e3,
                    ar_bw_frac=nb * ar.stats["decode_tok_s"] / CEILING, ar_md5=md5(ar.token_ids),
                    vocab_size=llm.cfg.vocab_size)
        rows = {}
        if trunk.graphs is not None:
            for r in (1, 2, 4):
                gr = trunk.graphs.graphs.get(r)
                if gr is None:
                    continue
                rows[r] = _time_graph(gr.graph, 20) * 1e3
        base["rows_graph_ms"] = rows
        log("ar", **base)
        for n in vocabs:
            if time.monotonic() > deadline:
                log("skipped", what=label, draft_vocab=n, why="time budget")
                continue
            trunk.draft_vocab = n                            # what LLM(..., draft_vocab=n) sets at load
            if mtp.graphs is not None:
                mtp.graphs.clear()                           # captured chains bake the product in
            row = dict(shape=shape, weights=label, draft_vocab=n or llm.cfg.vocab_size,
                       lm_rows_read=n or llm.cfg.vocab_size, lm_product_ms=_lm_ms(trunk, device))
            for k in (3, 1):
                llm.generate(ids, warm, spec={"mode": "mtp", "k": k})
                r, cyc = _cycle(llm, ids, sp, k)
                row[f"mtp{k}_tok_s"] = r.stats["decode_tok_s"]
                row[f"mtp{k}_tau"] = r.stats["mean_accept_len"]
                row[f"mtp{k}_cycle_ms"] = cyc * 1e3
                row[f"mtp{k}_cycle_vs_ar"] = cyc / ar_step
                row[f"mtp{k}_equals_ar"] = r.token_ids == ar.token_ids
            if mtp.graphs is not None and device == "cuda":
                dg = {}
                for key, gr in sorted(mtp.graphs.graphs.items(), key=lambda kv: str(kv[0])):
                    dg["_".join(map(str, key))] = _time_graph(gr, 20) * 1e3
                row["draft_graph_ms"] = dg
                d3 = dg.get("4_3_after", dg.get("1_3_None"))
                if d3 is not None and 4 in rows:
                    row["mtp3_rest_ms"] = row["mtp3_cycle_ms"] - rows[4] - d3
            llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.8, seed=2, ignore_eos=True),
                         spec={"mode": "mtp", "k": 3})
            r, cyc = _cycle(llm, ids, sampled, 3)
            row.update(sampled_mtp3_tok_s=r.stats["decode_tok_s"], sampled_mtp3_tau=r.stats["mean_accept_len"],
                       sampled_mtp3_cycle_vs_ar=cyc / ar_step, sampled_tokens=len(r.token_ids))
            log("draft_vocab", **row)
        trunk.draft_vocab = None


def bundled(vocabs: list[int | None], n_prompts: int, tokens: int, threads: int, log: Log) -> None:
    """Acceptance on the bundled model (CPU): greedy MTP k=3 on held-out code prompts
    (bench/bundled_accept.py's), mean_accept_len and output == AR for each draft vocabulary; and how
    well the id prefix [0, N) stands for the N most frequent tokens: the share of the AR output's
    tokens below N, beside the share inside the N ids most frequent on the held-out stdlib text
    (an independent count: what a frequency-ranked subset, FR-Spec's, would keep)."""
    from collections import Counter

    from bundled_accept import held_out_prompts

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.train.corpus import held_out_sources

    torch.set_num_threads(threads)
    prompts = [p for _, p in held_out_prompts(n_prompts, 24, "packages")]
    sp = SamplingParams(max_tokens=tokens)
    with LLM(None, device="cpu", dtype="float32", spec="auto", progress=False) as llm:
        trunk, v = llm.engine.trunk, llm.cfg.vocab_size
        ar = [llm.generate(p, sp, spec="off").token_ids for p in prompts]
        out = [t for seq in ar for t in seq]
        freq = Counter(t for _, text in held_out_sources()["stdlib"] for t in llm.tokenizer.encode(text))
        ranked = [t for t, _ in freq.most_common()]
        for n in vocabs:
            trunk.draft_vocab = n                            # what LLM(..., draft_vocab=n) sets at load
            res = [llm.generate(p, sp, spec=SpecPolicy("mtp", 3)) for p in prompts]
            cyc = sum(r.stats["cycles"] for r in res)
            acc = sum(r.stats["accepted"] for r in res)
            nn = n or v
            top = set(ranked[:nn])
            log("bundled", draft_vocab=nn, vocab_size=v, prompts=len(prompts), tokens=tokens,
                mtp3_mean_accept_len=1 + acc / cyc, cycles=cyc, equals_ar=all(r.token_ids == a for r, a in zip(res, ar)),
                ar_tokens_below_n=sum(t < nn for t in out) / len(out),
                ar_tokens_in_top_n_by_frequency=sum(t in top for t in out) / len(out),
                prefix_overlap_with_top_n=len(top & set(range(nn))) / nn)
        trunk.draft_vocab = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--vocab", default="32768,16384", help="draft vocabularies to time besides the whole one")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens a request (default 64; --bundled 128)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what would start past this")
    ap.add_argument("--q4", action="store_true", help="then the 4-bit checkpoint, if >= --q4-need-s are left")
    ap.add_argument("--q4-need-s", type=float, default=110)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: the flow, no timings worth keeping")
    ap.add_argument("--bundled", action="store_true", help="CPU: acceptance of the bundled model per draft vocabulary")
    ap.add_argument("--prompts", type=int, default=10, help="--bundled: held-out prompts")
    ap.add_argument("--threads", type=int, default=2, help="--bundled: CPU threads")
    args = ap.parse_args()
    if args.bundled:
        vocabs = [None] + [int(v) for v in args.vocab.split(",") if v]
        bundled(vocabs, args.prompts, args.tokens or 128, args.threads, Log(args.out))
        return
    args.tokens = args.tokens or 64
    t_end = time.monotonic() + args.budget_s
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        import decode
        smoke_shapes()
        decode.SHAPES["tiny"] = {**decode.SHAPES["tiny"], "intermediate_size": 128}
        args.shape, args.prompt, args.tokens = "tiny", 40, 12
        args.vocab = ",".join(str(v) for v in (100, 37))
        torch.set_num_threads(1)
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    log = Log(args.out)
    log("start", commit=args.commit, shape=args.shape, torch=torch.__version__,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    vocabs = [None] + [int(v) for v in args.vocab.split(",") if v]
    d = tempfile.mkdtemp(prefix="dvocab-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        t0 = time.perf_counter()
        job_ckpt(cfg, d, device, log)
        shutil.rmtree(os.path.join(d, "normal"), ignore_errors=True)     # tied holds hard links to its shards
        log("progress", what="ckpt", s=time.perf_counter() - t0)
        run_model(os.path.join(d, "tied"), "bf16", vocabs, device, log, args.prompt, args.tokens, args.shape,
                  t_end - 20, lambda c, ctx: step_bytes(c, 1, ctx))
        shutil.rmtree(os.path.join(d, "tied"), ignore_errors=True)
        left = t_end - time.monotonic()
        if args.q4 and left >= args.q4_need_s:
            import tp_mtp
            if args.smoke:
                tp_mtp.GROUP = 32
            tp_mtp.job_q4ckpt(cfg, d, device, log)
            tie_norms(os.path.join(d, "q4"), os.path.join(d, "q4tied"), cfg)
            run_model(os.path.join(d, "q4tied"), "4-bit", vocabs, device, log, args.prompt, args.tokens,
                      args.shape, t_end - 10, lambda c, ctx: tp_mtp.q4_step_bytes(c, d, 1, ctx))
        elif args.q4:
            log("skipped", what="4-bit", why=f"{left:.0f} s left, need {args.q4_need_s:.0f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    log("done", seconds=time.monotonic() - (t_end - args.budget_s))


if __name__ == "__main__":
    main()
