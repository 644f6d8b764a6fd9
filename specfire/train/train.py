"""Train the bundled model end to end: corpus -> tokenizer -> trunk + MTP head -> held-out eval -> export.

Reproducible: one seed drives the initialisation and the batch order; the corpus and the tokenizer
are deterministic functions of the interpreter's standard library. Loss = trunk LM loss + mtp_weight
x (sum over MTP steps of the step's loss), where a step's loss mixes cross-entropy on the true
token p+2 with cross-entropy against the trunk's own (detached) distribution for that token
(`mtp_distill`): acceptance is agreement with the trunk, so the trunk is the better teacher.
An optional unlikelihood phase against repetition follows pretraining, or runs alone from an
`init` checkpoint (finetune.py).
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace

import torch

from . import model as tm
from .config import PRESETS, TrainConfig  # noqa: F401  (re-exported: train.PRESETS, train.TrainConfig)
from .corpus import build_corpus, build_site_corpus, split_validation, subsample
from .evaluate import evaluate, pack, windows
from .export import export_checkpoint, load_checkpoint, write_attribution
from .losses import compute_losses, optimizer
from .tok import ENDOFTEXT, IM_END, save_tokenizer, train_tokenizer

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def _tokenize(tok, docs: list[tuple[str, str]], eot: int) -> torch.Tensor:
    """One stream: each document's ids followed by the end-of-text id."""
    import numpy as np

    parts = []
    for enc in getattr(tok, "encode_batch_fast", tok.encode_batch)([t for _, t in docs], add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eot], dtype=np.int64))
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)


def _lr(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ---------------------------------------------------------------------------------------------
# The whole recipe
# ---------------------------------------------------------------------------------------------

def _tokenizer_sample(docs: list[tuple[str, str]], budget: int):
    """Every file, or an even stride over the files when they exceed `budget` bytes."""
    total = sum(len(t) for _, t in docs)
    step = max(1, math.ceil(total / budget))
    return (t for i, (_, t) in enumerate(docs) if i % step == 0)


def _corpus(tc: TrainConfig, log):
    if tc.corpus == "site":
        return build_site_corpus(tuple(tc.held_out_packages), tc.max_files, log=log,
                                 max_bytes=tc.max_train_bytes if tc.init else None)
    return build_corpus(tc.corpus_root, tc.max_files, tc.extra_corpus_roots)


def _pretrain(tc: TrainConfig, trunk, head, train_ids: torch.Tensor, limit: float, save, log) -> dict:
    """The likelihood + MTP training loop: `tc.steps` steps of a cosine schedule, refitted to `limit`
    seconds (when finite) after `probe_steps` timed steps."""
    from tqdm import tqdm

    dev = train_ids.device
    autocast = dev.type == "cuda"
    params = [p for m in (trunk, head) for p in m.parameters()]
    opt = optimizer(params, tc.lr, tc.weight_decay, dev)
    gen = torch.Generator(device="cpu").manual_seed(tc.seed + 1)
    offs = torch.arange(tc.seq_len, device=dev)
    budget = limit if tc.deadline_s else 0.0   # fit the schedule to the deadline's budget only
    t_train = time.time()
    sched = tc.steps                  # cosine length; refitted to the time budget after probe_steps
    history = []
    stopped_at = None
    last_ckpt = time.time()
    t_probe = 0.0
    bar = tqdm(range(tc.steps), desc="train", mininterval=2.0 if sys.stderr.isatty() else 15.0,
               dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        if budget and step == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if budget and step == tc.probe_steps + 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_probe) / tc.probe_steps
            sched = min(tc.steps, step + int((limit - (time.time() - t_train)) / per_step))
            log(f"{per_step * 1e3:.0f} ms/step ({tc.batch_size * tc.seq_len / per_step / 1e3:.0f}k tok/s): "
                f"schedule fitted to {sched} steps for the {limit:.0f}s budget")
        lr = _lr(step, replace(tc, steps=sched))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - tc.seq_len, (tc.batch_size,), generator=gen).to(dev)
        ids = train_ids[starts[:, None] + offs]                         # [B, T]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
            lm, mls, _ = compute_losses(trunk, head, ids, tc.mtp_steps, tc.mtp_distill)
            loss = lm + tc.mtp_weight * sum(mls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        if step % 50 == 0 or step == sched - 1:
            rec = {"step": step, "lr": lr, "loss": loss.item(), "lm": lm.item(),
                   "mtp": [m.item() for m in mls], "grad_norm": gn.item(), "t": time.time() - t_train}
            history.append(rec)
            bar.set_postfix(lm=f"{rec['lm']:.3f}", mtp1=f"{rec['mtp'][0]:.3f}", lr=f"{lr:.2e}")
            if step % 250 == 0:
                log(json.dumps(rec))
        done = step + 1
        if done >= sched:
            stopped_at = done if sched < tc.steps else None
            break
        if time.time() - t_train > limit:
            stopped_at = done
            log(f"time limit {limit:.0f}s reached: stopping after {done} of {sched} steps")
            break
        if tc.stop_after_steps and done >= tc.stop_after_steps:
            stopped_at = done
            log(f"stopping after {done} of {tc.steps} scheduled steps (stop_after_steps)")
            break
        if tc.checkpoint_every_s and time.time() - last_ckpt > tc.checkpoint_every_s:
            save(f"interim, step {done}", {"steps_done": done, "schedule_steps": sched, "history": history})
            last_ckpt = time.time()
    bar.close()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    steps_done = stopped_at or sched
    peak_gb = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    log(f"trained {steps_done} steps in {train_s:.1f}s ({train_s / steps_done * 1e3:.0f} ms/step), "
        f"peak GPU memory {peak_gb:.1f} GiB")
    return {"train_seconds": train_s, "peak_gpu_gib": peak_gb, "steps_done": steps_done, "schedule_steps": sched,
            "tokens_seen": steps_done * tc.batch_size * tc.seq_len,
            "epochs": steps_done * tc.batch_size * tc.seq_len / train_ids.numel(), "history": history}


def _tokenizer(tc: TrainConfig, corpus):
    """The init checkpoint's tokenizer, or one trained on the corpus; written into tc.out."""
    if tc.init:
        import shutil

        from tokenizers import Tokenizer

        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tc.init, f), os.path.join(tc.out, f))
        tok = Tokenizer.from_file(os.path.join(tc.init, "tokenizer.json"))
        return tok, {t: tok.token_to_id(t) for t in (ENDOFTEXT, IM_END)}
    tok = train_tokenizer(_tokenizer_sample(corpus.train, tc.tokenizer_sample_bytes), tc.vocab_size)
    return tok, save_tokenizer(tok, tc.out, model_max_length=32768)


def _evaluate_all(tc: TrainConfig, trunk, head, held: dict, train_ids: torch.Tensor, log) -> dict:
    dev = train_ids.device
    autocast = dev.type == "cuda"
    trunk.eval()
    head.eval()
    evals = {}
    for name, data in held.items():
        if data.numel() > tc.seq_len:
            evals[name] = evaluate(trunk, head, windows(data, tc.seq_len, tc.eval_windows), tc.mtp_steps, dev, autocast)
    # the same measure on training text (windows spread over the stream) shows the train/held-out gap
    evals["train_sample"] = evaluate(trunk, head, windows(train_ids, tc.seq_len, tc.eval_windows, spread=True),
                                     tc.mtp_steps, dev, autocast)
    for name, e in evals.items():
        log(f"{name}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()}))
    trunk.train()
    head.train()
    return evals


def _snippet_arms(tc: TrainConfig, trunk, head, train_ids, corpus, val_docs, tok, eos_ids, limit: float, save,
                  log) -> dict:
    """The snippet phase twice from the same start weights: arm 0 with `snip_rows` snippet rows, arm 1
    with `snip_rows2` (the batch size kept: the corpus rows make up the rest), `limit` seconds shared
    evenly. The rule of select.py picks over the snapshots of both arms together; the other arm's pick
    (if any) is packed as alt.tar, and the model ends on the winner's weights (each arm's last weights
    are not kept)."""
    import copy

    from .select import Candidate, choose
    from .snippet_phase import run_snippet_phase

    total = tc.snip_rows + tc.snip_data_rows
    start = (copy.deepcopy(trunk.state_dict()), copy.deepcopy(head.state_dict()))
    arms, t0 = [], time.time()
    for i, rows in enumerate((tc.snip_rows, tc.snip_rows2)):
        trunk.load_state_dict(start[0])
        head.load_state_dict(start[1])
        left = limit - (time.time() - t0) if limit else 0.0
        res = run_snippet_phase(replace(tc, snip_rows=rows, snip_data_rows=total - rows), trunk, head, train_ids,
                                corpus.train, corpus.held_out, val_docs, tok, eos_ids,
                                left / (2 - i) if limit else 0.0,
                                lambda tag, name, out: None, log)            # no per-arm exports
        res["rows"] = {"snippet": rows, "corpus": total - rows}
        arms.append((res, copy.deepcopy(trunk.state_dict()), copy.deepcopy(head.state_dict())))
    cands = [(Candidate(r["step"], r["rep"], r["ppl_ratio"]), i) for i, (res, _, _) in enumerate(arms)
             for r in res.get("selection", {}).get("candidates", [])
             if res["selection"]["chosen_step"] == r["step"]]
    pick = choose([c for c, _ in cands], tc.ul_ppl_budget)
    win = next(i for c, i in cands if c is pick) if pick else len(arms) - 1
    out = {"arms": [a[0] for a in arms], "chosen_arm": win,
           "rule": "each arm's pick by select.choose; between arms the same rule over the two picks"}
    other = [i for c, i in cands if i != win]
    if other:
        trunk.load_state_dict(arms[other[0]][1])
        head.load_state_dict(arms[other[0]][2])
        save(f"snippet arm {other[0]} pick (not chosen)", "alt.tar", out)
    trunk.load_state_dict(arms[win][1])
    head.load_state_dict(arms[win][2])
    log(f"snippet arms: chose arm {win} ({arms[win][0]['rows']}); picks: "
        + json.dumps([(i, c.step, round(c.rep, 4), round(c.ppl_ratio, 4)) for c, i in cands]))
    return out


def run(tc: TrainConfig, log=print) -> dict:
    t_start = time.time()
    torch.manual_seed(tc.seed)
    dev = torch.device(tc.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(tc.out, exist_ok=True)
    if tc.init:   # the checkpoint decides the shape
        cfg, trunk, head = load_checkpoint(tc.init, dev, trainable=True)
        tc = replace(tc, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                     num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
                     linear_num_value_heads=cfg.linear_num_value_heads, linear_head_dim=cfg.linear_key_head_dim,
                     rope_theta=cfg.rope_theta)

    # ---- corpus and tokenizer ------------------------------------------------------------------
    corpus = _corpus(tc, log)
    if sum(len(t) for _, t in corpus.train) > tc.max_train_bytes:
        n = len(corpus.train)
        corpus.train = subsample(corpus.train, tc.max_train_bytes, corpus.hash_ceiling)
        log(f"corpus subsampled to {len(corpus.train)} of {n} files (max_train_bytes {tc.max_train_bytes})")
    csum = corpus.summary()
    log(f"corpus ({tc.corpus}): {csum['train_files']} train files ({csum['train_bytes'] / 1e6:.1f} MB), "
        f"{csum['held_out_files']} held-out files ({csum['held_out_bytes'] / 1e6:.2f} MB); "
        f"{time.time() - t_start:.1f}s")
    val_docs: list[tuple[str, str]] = []
    if (tc.ul_steps or tc.snip_steps) and tc.ul_select:   # the rule's validation files: out of the phase's training text
        corpus.train, val_docs = split_validation(corpus.train, tc.ul_val_permille)
        log(f"validation set (the snapshot rule's): {len(val_docs)} training-corpus files set aside "
            f"({sum(len(t) for _, t in val_docs) / 1e6:.2f} MB)")
    tok, special = _tokenizer(tc, corpus)
    if corpus.packages:
        write_attribution(corpus.packages, tc.out)
    eot = special[ENDOFTEXT]
    train_ids = _tokenize(tok, corpus.train, eot)
    held = {"held_out": _tokenize(tok, corpus.held_out, eot)}
    if corpus.held_out_stdlib:
        held["held_out_stdlib"] = _tokenize(tok, corpus.held_out_stdlib, eot)
    log(f"tokens: train {train_ids.numel():,}, " + ", ".join(f"{k} {v.numel():,}" for k, v in held.items())
        + f" ({csum['train_bytes'] / train_ids.numel():.2f} bytes/token); prep {time.time() - t_start:.1f}s")
    train_ids = train_ids.to(dev)

    # ---- model -----------------------------------------------------------------------------------
    if not tc.init:
        trunk, head = tm.build(tc.model_config((eot, special[IM_END])), dev, tc.seed)
    counts = tm.count_params(trunk, head)
    log(f"params: {counts}")
    base = {"train_config": asdict(tc), "params": counts, "corpus": csum,
            "tokens": {"train": int(train_ids.numel()), **{k: int(v.numel()) for k, v in held.items()}},
            "env": {"python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}}

    def save(tag: str, extra: dict, pack_name: str = "model.tar") -> None:
        files = export_checkpoint(trunk, head, tc.out, [eot, special[IM_END]])
        with open(os.path.join(tc.out, "train_metrics.json"), "w") as f:
            json.dump({**base, **extra, "checkpoint": tag, "files": files}, f, indent=2)
        if tc.pack_dir:
            pack(tc.out, tc.pack_dir, name=pack_name)
        log(f"checkpoint ({tag}) written at {time.time() - t_start:.1f}s")

    def left() -> float:  # seconds of training left before the deadline's reserve (inf: no deadline)
        return tc.deadline_s - tc.reserve_s - (time.time() - t_start) if tc.deadline_s else float("inf")

    # ---- pretraining, then the unlikelihood phase -------------------------------------------------
    metrics: dict = {}
    if not tc.init:
        limit = tc.time_limit_s or float("inf")
        if tc.deadline_s:
            avail = left() - (tc.ul_time_s if tc.ul_steps else tc.snip_time_s if tc.snip_steps else 0.0)
            if avail <= 0:
                raise RuntimeError(f"no training time left: prep took {time.time() - t_start:.0f}s of deadline_s "
                                   f"{tc.deadline_s}")
            limit = min(limit, avail)
        metrics.update(_pretrain(tc, trunk, head, train_ids, limit, save, log))
    if tc.ul_steps or tc.snip_steps:
        from .finetune import run_phase
        from .snippet_phase import run_snippet_phase

        key, phase, phase_s = (("ul", run_phase, tc.ul_time_s) if tc.ul_steps
                               else ("snip", run_snippet_phase, tc.snip_time_s))
        t_eval = time.time()
        metrics["before_" + key] = _evaluate_all(tc, trunk, head, held, train_ids, log)
        ul_limit = min(x for x in (phase_s, left(), float("inf")) if x > 0)
        if ul_limit <= 0 or (tc.deadline_s and left() <= 0):
            raise RuntimeError(f"no time left for the fine-tune phase before deadline_s {tc.deadline_s}")
        metrics["eval_seconds_before_" + key] = time.time() - t_eval
        limit = ul_limit if math.isfinite(ul_limit) else 0.0
        if key == "snip" and tc.snip_rows2:
            metrics[key] = _snippet_arms(tc, trunk, head, train_ids, corpus, val_docs, tok, (eot, special[IM_END]),
                                         limit, lambda tag, name, out: save(tag, {**metrics, key: out}, name), log)
        else:
            metrics[key] = phase(tc, trunk, head, train_ids, corpus.train, corpus.held_out, val_docs, tok,
                                 (eot, special[IM_END]), limit,
                                 lambda tag, name, out: save(tag, {**metrics, key: out}, name), log)

    # ---- evaluation and export ------------------------------------------------------------------
    t_eval = time.time()
    evals = _evaluate_all(tc, trunk, head, held, train_ids, log)
    trunk.eval()
    head.eval()
    eval_s = time.time() - t_eval
    metrics = {**evals, **metrics, "eval_seconds": eval_s, "total_seconds": time.time() - t_start}
    save("final", metrics)
    log(f"done: eval {eval_s:.1f}s, total {time.time() - t_start:.1f}s -> {tc.out}")
    return {**base, **metrics}
