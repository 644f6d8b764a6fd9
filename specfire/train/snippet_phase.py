"""The definition-snippet fine-tune phase, without rollouts or unlikelihood: corpus rows mixed with
definition snippets that end with end-of-text (snippets.py), scored by the same snapshot rule as
the unlikelihood phase (phase.py Guard)."""
from __future__ import annotations

import copy
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from . import unlikelihood as ul
from .phase import Guard, Prompts, fit_schedule


def _cosine(step: int, sched: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, sched - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def run_snippet_phase(tc, trunk, head, train_ids: torch.Tensor, train_docs, held_docs, val_docs, tok,
                      eos_ids: tuple[int, ...], limit_s: float, save, log) -> dict:
    """The definition-snippet fine-tune (snippets.py): each step one batch of `snip_data_rows` whole-file
    corpus rows (the pretraining packing) and `snip_rows` snippet rows (definition blocks of
    `train_docs`, each ended by end-of-text, the first at position 0), with the LM loss over all of
    it and the MTP head trained jointly on the same batch (+ KL to the starting model on the corpus
    rows when ul_kl_weight is set). `tc.snip_steps` steps or `limit_s` seconds (the cosine fitted to
    the time left after `snip_probe_steps` timed steps, less the snapshot scoring); with ul_select,
    `snip_snapshots` snapshots are scored by the rule of select.py on validation prompts (`snip_val_kind`)
    and the phase ends on its pick. Returns the phase's metrics."""
    from .snippets import SnippetRows, corpus_blocks
    from .losses import mtp_losses, optimizer, trunk_forward

    dev = train_ids.device
    autocast = dev.type == "cuda"
    eot = eos_ids[0]
    t0 = time.time()
    blocks = corpus_blocks(train_docs, bool(tc.snip_nested), import_frac=tc.snip_import_frac, seed=tc.seed + 12,
                           workers=min(16, os.cpu_count() or 1))
    rows = SnippetRows(tok, blocks, eot, tc.seq_len, tc.seed + 13, tc.snip_blank_frac)
    out: dict = {"snippets": {**rows.summary(), "files": len(train_docs), "seconds": round(time.time() - t0, 2)},
                 "history": [], "snapshots": []}
    log("snippet phase: " + json.dumps(out["snippets"]))
    params = [p for m in (trunk, head) for p in m.parameters()]
    opt = optimizer(params, tc.snip_lr, tc.weight_decay, dev)
    gen = torch.Generator(device="cpu").manual_seed(tc.seed + 11)
    offs = torch.arange(tc.seq_len, device=dev)
    held = Prompts(tok, held_docs, tc.seed + 1)
    held_prompts = (held.batch(tc.ul_eval_prompts, tc.ul_eval_prompt_tokens, dev)
                    if tc.ul_eval_prompts and held.snippets else None)
    teacher = None
    if tc.ul_kl_weight:
        teacher = copy.deepcopy(trunk).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    guard = (Guard(tc, trunk, head, tok, held_docs, val_docs, eos_ids, held_prompts, log, tc.snip_val_kind)
             if tc.ul_select else None)
    if guard:
        out["repetition_before"] = guard.start
    score_s = guard.start["seconds"] if guard else 0.0
    t0 = time.time()                                  # the phase's clock starts after its preparation
    sched, t_probe = tc.snip_steps, 0.0

    def marks_for(n: int) -> list[int]:
        return [max(1, round(n * (i + 1) / (tc.snip_snapshots + 1))) for i in range(tc.snip_snapshots)]

    marks = marks_for(sched)
    step = 0
    for step in range(tc.snip_steps):
        if limit_s and step == 3:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if limit_s and step == 3 + tc.snip_probe_steps:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_probe) / tc.snip_probe_steps
            left = limit_s - (time.time() - t0) - score_s * (tc.snip_snapshots + 1)
            sched = fit_schedule(step, per, left, tc.snip_steps)
            marks = [m for m in marks_for(sched) if m > step]
            log(f"snippet phase: {per * 1e3:.0f} ms/step: schedule fitted to {sched} steps for {limit_s:.0f}s "
                f"({score_s:.1f}s a snapshot score)")
        lr = _cosine(step, sched, tc.snip_lr, tc.snip_warmup, tc.snip_min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - tc.seq_len, (tc.snip_data_rows,), generator=gen).to(dev)
        ids = torch.cat([train_ids[starts[:, None] + offs], rows.batch(tc.snip_rows, dev)])
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
            h, logits = trunk_forward(trunk, ids)
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="none").view(ids.shape[0], -1)
            lm = ce.mean()
            mls, _ = mtp_losses(trunk, head, ids, h, logits, tc.mtp_steps, tc.mtp_distill)
            kl = lm.new_zeros(())
            if teacher is not None:
                with torch.no_grad():
                    _, clogits = trunk_forward(teacher, ids[:tc.snip_data_rows])
                kl = ul.kl_to_teacher(logits[:tc.snip_data_rows, :-1], clogits[:, :-1])
            loss = lm + tc.mtp_weight * sum(mls) + tc.ul_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        if step % 25 == 0 or step == sched - 1:
            with torch.no_grad():
                d = tc.snip_data_rows
                ends = ids[d:, 1:] == eot            # the snippet rows' end-of-text targets
                rec = {"step": step, "lr": lr, "loss": loss.item(), "lm_corpus": ce[:d].mean().item(),
                       "lm_snippets": ce[d:].mean().item(), "nll_end_of_text": ce[d:][ends].mean().item(),
                       "kl": kl.item(), "mtp": [m.item() for m in mls], "grad_norm": gn.item(),
                       "t": time.time() - t0}
            out["history"].append(rec)
            log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}))
        done = step + 1
        if marks and done >= marks[0] and done < sched:
            marks.pop(0)
            if guard:
                out["snapshots"].append(guard.score(done))
            else:
                out["snapshots"].append({"step": done})
                save(f"snippet snapshot, step {done} of {sched}", f"snip-{len(out['snapshots'])}.tar", out)
        if done >= sched or (limit_s and time.time() - t0 > limit_s):
            break
    step += 1
    out.update(steps_done=step, schedule_steps=sched, seconds=time.time() - t0)
    if guard:
        last = guard.rows[-1] if guard.rows and guard.rows[-1]["step"] == step else guard.score(step)
        out.update(repetition_after=last, selection=guard.finish(step, save, out))
    log(f"snippet phase done: {step} steps in {out['seconds']:.1f}s")
    return out
