"""The unlikelihood fine-tune phase: likelihood + MTP on corpus batches, token-level unlikelihood on
the same batches, sequence-level unlikelihood on the model's own greedy continuations of prompts cut
at `def` / `class` lines of the corpus, and the MTP head distilled on those continuations too (it
must keep agreeing with the trunk on exactly the text greedy decoding now writes).

Continuations come from pools of `ul_pool` rollouts regenerated whenever the steps have used a
pool up, so the penalised repeats are always the current model's. Greedy repetition on held-out
prompts (the model card's line measure) is logged before, at each snapshot and after. Optionally
(`ul_kl_weight`) a KL term holds the corpus distribution at the starting model's, and (`ul_select`)
each snapshot is scored (select.py: repetition on the benchmark's prompts, held-out perplexity) and
the phase ends on the one the rule of select.py picks, instead of exporting every snapshot.
"""
from __future__ import annotations

import copy
import json
import math
import random
import time

import torch
import torch.nn.functional as F

from . import unlikelihood as ul
from .phase import Guard, Prompts, fit_schedule
from .rollout import greedy_rollout


@torch.no_grad()
def repetition(trunk, tok, prompts: torch.Tensor, new_tokens: int, eos_ids: tuple[int, ...], ngram: int,
               autocast: bool) -> dict:
    """Greedy continuations of `prompts`: the repeated-line share (ul.line_stats, the model card's
    measure, stopping at end-of-text), distinct 4-grams and the share of tokens in a repeated n-gram."""
    was = trunk.training
    trunk.eval()
    seq = greedy_rollout(trunk, prompts, new_tokens, autocast)
    trunk.train(was)
    p = prompts.shape[1]
    alive = ul.alive_mask(seq, p, eos_ids)
    mask = ul.ngram_repeat_mask(seq, p, ngram)
    lines = rep = rep_all = g_distinct = g_all = short = ended_n = 0
    for i in range(seq.shape[0]):
        cont = seq[i, p:][alive[i, p:]].tolist()
        ended = bool(cont) and cont[-1] in eos_ids
        if ended:
            cont = cont[:-1]
        n, r, ra = ul.line_stats(tok.decode(seq[i, :p].tolist()), tok.decode(cont), cut=not ended)
        short += n < 2
        ended_n += ended
        lines, rep, rep_all = lines + n, rep + r, rep_all + ra
        grams = {tuple(cont[j:j + 4]) for j in range(len(cont) - 3)}
        g_distinct, g_all = g_distinct + len(grams), g_all + max(0, len(cont) - 3)
    return {"repeated_line_frac": rep / max(1, lines), "repeated_line_frac_with_prompt": rep_all / max(1, lines),
            "distinct_4gram_frac": g_distinct / max(1, g_all),
            f"repeated_{ngram}gram_token_frac": float((mask & alive).sum() / alive.sum().clamp_min(1)),
            "lines": lines, "prompts": int(seq.shape[0]), "prompts_under_2_lines": short, "ended": ended_n}


def _lr(step: int, sched: int, tc) -> float:
    if step < tc.ul_warmup:
        return tc.ul_lr * (step + 1) / tc.ul_warmup
    frac = min(1.0, (step - tc.ul_warmup) / max(1, sched - tc.ul_warmup))
    floor = tc.ul_min_lr_frac
    return tc.ul_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def run_phase(tc, trunk, head, train_ids: torch.Tensor, train_docs, held_docs, val_docs, tok,
              eos_ids: tuple[int, ...], limit_s: float, save, log) -> dict:
    """Fine-tune in place for `tc.ul_steps` steps or `limit_s` seconds (schedule fitted after a
    probe), then the anneal phase if set (`_anneal`); `save(tag, pack_name)` exports a snapshot.
    Rollout prompts come from `train_docs` only; the rule scores `val_docs` (select.py). Returns
    the phase's metrics."""
    from .losses import mtp_losses, optimizer, trunk_forward

    dev = train_ids.device
    autocast = dev.type == "cuda"
    params = [p for m in (trunk, head) for p in m.parameters()]
    opt = optimizer(params, tc.ul_lr, tc.weight_decay, dev)
    gen = torch.Generator(device="cpu").manual_seed(tc.seed + 7)
    offs = torch.arange(tc.seq_len, device=dev)
    sampler = Prompts(tok, train_docs, tc.seed)
    held = Prompts(tok, held_docs, tc.seed + 1)
    held_prompts = (held.batch(tc.ul_eval_prompts, tc.ul_eval_prompt_tokens, dev)
                    if tc.ul_eval_prompts and held.snippets else None)
    if tc.ul_eval_prompts and not held.snippets:
        log("UL: the held-out documents have no `def` / `class` line: no repetition log")

    def rep_eval() -> dict | None:
        if held_prompts is None:
            return None
        return repetition(trunk, tok, held_prompts, tc.ul_new_tokens, eos_ids, tc.ul_ngram, False)

    teacher = None
    if tc.ul_seq_anchor or tc.ul_kl_weight:   # the phase's starting trunk, frozen: the anchor of the
                                              # sequence-level loss and the KL term's reference
        teacher = copy.deepcopy(trunk).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    edges = ul.word_edges(tok, trunk.cfg.vocab_size) if tc.ul_word_bans else None
    newline = ul.newline_tokens(tok, trunk.cfg.vocab_size) if tc.ul_line_ngram else None
    guard = Guard(tc, trunk, head, tok, held_docs, val_docs, eos_ids, held_prompts, log) if tc.ul_select else None
    out = {"repetition_before": guard.start if guard else rep_eval(), "history": [], "snapshots": []}
    log("UL phase, held-out greedy repetition before: " + json.dumps(out["repetition_before"]))
    pool, used, p_len = None, 0, 0
    t0 = time.time()
    sched, t_probe, history = tc.ul_steps, 0.0, out["history"]

    def fit(step: int, note: str) -> None:
        """Fit the cosine schedule to the time left at the mean step time since the probe began
        (refitted at each pool refresh, whose rollouts the probe's steps do not include)."""
        nonlocal sched, marks
        per = (time.time() - t_probe) / (step - 3)
        sched = fit_schedule(step, per, limit_s - (time.time() - t0), tc.ul_steps)
        marks = [round(sched * (i + 1) / (tc.ul_snapshots + 1)) for i in range(tc.ul_snapshots)]
        log(f"UL: {per * 1e3:.0f} ms/step{note}: schedule fitted to {sched} steps for {limit_s:.0f}s")

    marks = [max(1, round(sched * (i + 1) / (tc.ul_snapshots + 1))) for i in range(tc.ul_snapshots)]
    step = 0
    for step in range(tc.ul_steps):
        if limit_s and step == 3:
            t_probe = time.time()
        if limit_s and step == 3 + tc.ul_probe_steps:
            fit(step, "")
        refresh = pool is None or used + tc.ul_batch > pool[0].shape[0]
        if refresh and limit_s and step > 3 + tc.ul_probe_steps:
            fit(step, " with rollouts")
        if refresh:
            p_len = random.Random(tc.seed * 1000 + step).randint(tc.ul_prompt_min, tc.ul_prompt_max)
            trunk.eval()
            seq = greedy_rollout(trunk, sampler.batch(tc.ul_pool, p_len, dev), tc.ul_new_tokens)
            trunk.train()
            pool = (seq, ul.ngram_repeat_mask(seq, p_len, tc.ul_ngram), ul.alive_mask(seq, p_len, eos_ids))
            used = 0
        seq, mask, alive = (x[used:used + tc.ul_batch] for x in pool)
        used += tc.ul_batch
        lr = _lr(step, sched, tc)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
            ids, logits, lm, mls, kl = _corpus_terms(tc, trunk, head, teacher, train_ids, offs, gen)
            tok_ul = ul.token_unlikelihood(logits[:, :-1], ids) if tc.ul_token_weight else lm.new_zeros(())
            rh, rlogits = trunk_forward(trunk, seq)
            ban = None
            if tc.ul_seq_anchor:
                with torch.no_grad():
                    _, tlogits = trunk_forward(teacher, seq)
                if tc.ul_seq_ban:
                    ban = ul.repeat_continuations(seq, p_len, tc.ul_ngram, rlogits.shape[-1], edges)
                    if newline is not None:
                        ban |= ul.line_repeat_continuations(seq, p_len, tc.ul_line_ngram, rlogits.shape[-1],
                                                            newline, edges)
                    seq_ul = ul.banned_anchored_unlikelihood(rlogits[:, :-1], tlogits[:, :-1], ban, alive)
                else:
                    seq_ul = ul.anchored_unlikelihood(rlogits[:, :-1], tlogits[:, :-1], seq, mask, alive)
            else:
                seq_ul = ul.sequence_unlikelihood(rlogits[:, :-1], seq, mask, alive)
            rmls, _ = mtp_losses(trunk, head, seq, rh, rlogits, tc.mtp_steps, 1.0)
            loss = (lm + tc.mtp_weight * (sum(mls) + sum(rmls)) + tc.ul_token_weight * tok_ul
                    + tc.ul_seq_weight * seq_ul + tc.ul_kl_weight * kl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        if step % 25 == 0 or step == sched - 1:
            with torch.no_grad():     # the mean probability of the repeating tokens, which the loss pushes down
                m = (mask & alive)[:, 1:]
                probs = rlogits[:, :-1].float().softmax(-1)
                p_rep = probs.gather(-1, seq[:, 1:, None])[..., 0][m].mean()
                # the model's probability mass on repeat-completing tokens at alive positions
                p_ban = (probs * ban[:, 1:]).sum(-1)[alive[:, 1:]].mean().item() if ban is not None else float("nan")
                del probs
            rec = {"step": step, "lr": lr, "loss": loss.item(), "lm": lm.item(), "kl": kl.item(), "token_ul": tok_ul.item(),
                   "p_repeat": p_rep.item(), "p_banned": p_ban,
                   "seq_ul": seq_ul.item(), "mtp": [m.item() for m in mls], "mtp_rollout": [m.item() for m in rmls],
                   "rollout_repeat_frac": float((mask & alive).sum() / alive.sum().clamp_min(1)),
                   "prompt_tokens": p_len, "grad_norm": gn.item(), "t": time.time() - t0}
            history.append(rec)
            log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}))
        done = step + 1
        if len(out["snapshots"]) < len(marks) and done >= marks[len(out["snapshots"])] and done < sched:
            if guard:
                out["snapshots"].append(guard.score(done))
            else:
                snap = {"step": done, "repetition": rep_eval()}
                out["snapshots"].append(snap)
                log(f"UL snapshot at step {done}: " + json.dumps(snap["repetition"]))
                save(f"UL snapshot, step {done} of {sched}", f"ul-{len(out['snapshots'])}.tar", out)
        if done >= sched or (limit_s and time.time() - t0 > limit_s):
            break
    out.update(steps_done=step + 1, schedule_steps=sched, seconds=time.time() - t0)
    step += 1
    if guard and not (guard.rows and guard.rows[-1]["step"] == step):
        guard.score(step)                                      # the end of the UL phase is a candidate too
    if tc.ul_anneal_s or tc.ul_anneal_steps:
        out["anneal"] = _anneal(tc, trunk, head, teacher, opt, params, train_ids, gen, step, guard, log)
        step += out["anneal"]["steps_done"]
    if guard:
        last = guard.rows[-1] if guard.rows and guard.rows[-1]["step"] == step else guard.score(step)
        out.update(repetition_after=last, selection=guard.finish(step, save, out))
    else:
        out["repetition_after"] = rep_eval()
    log("UL phase done, held-out greedy repetition after: " + json.dumps(out["repetition_after"]))
    return out


def _corpus_terms(tc, trunk, head, teacher, train_ids, offs, gen):
    """One corpus batch's (ids, logits, LM loss, MTP losses, KL to the starting model; zero without
    a teacher or a KL weight), shared by both phases; called inside their autocast."""
    from .losses import mtp_losses, trunk_forward

    starts = torch.randint(0, train_ids.numel() - tc.seq_len, (tc.ul_data_batch,), generator=gen).to(offs.device)
    ids = train_ids[starts[:, None] + offs]
    h, logits = trunk_forward(trunk, ids)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    mls, _ = mtp_losses(trunk, head, ids, h, logits, tc.mtp_steps, tc.mtp_distill)
    kl = lm.new_zeros(())
    if tc.ul_kl_weight and teacher is not None:
        with torch.no_grad():
            _, clogits = trunk_forward(teacher, ids)
        kl = ul.kl_to_teacher(logits[:, :-1], clogits[:, :-1])
    return ids, logits, lm, mls, kl


def _anneal(tc, trunk, head, teacher, opt, params, train_ids, gen, step0: int, guard, log) -> dict:
    """The second phase: likelihood + MTP + KL to the starting model on corpus batches only (no
    rollouts, no unlikelihood), the lr falling linearly from ul_anneal_lr to 0 over ul_anneal_s
    seconds (or ul_anneal_steps steps): it recovers perplexity after the UL phase; each of its
    ul_anneal_snapshots even fractions is a candidate of the rule (scored by `guard`)."""
    dev = train_ids.device
    autocast = dev.type == "cuda"
    offs = torch.arange(tc.seq_len, device=dev)
    limit, cap = tc.ul_anneal_s, tc.ul_anneal_steps or 10**9
    marks = [(i + 1) / tc.ul_anneal_snapshots for i in range(tc.ul_anneal_snapshots)]
    t0, step, history = time.time(), 0, []
    while step < cap:
        frac = (time.time() - t0) / limit if limit else step / cap
        if frac >= 1.0:
            break
        lr = tc.ul_anneal_lr * (1.0 - frac)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
            _, _, lm, mls, kl = _corpus_terms(tc, trunk, head, teacher, train_ids, offs, gen)
            loss = lm + tc.mtp_weight * sum(mls) + tc.ul_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        step += 1
        if step % 50 == 1:
            rec = {"anneal_step": step0 + step, "lr": lr, "lm": lm.item(), "kl": kl.item(), "t": time.time() - t0}
            history.append(rec)
            log(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in rec.items()}))
        done = (time.time() - t0) / limit if limit else step / cap
        while guard and marks and done >= marks[0] - 1e-9:
            marks.pop(0)
            if guard.rows[-1]["step"] != step0 + step:
                guard.score(step0 + step)
    if guard and (not guard.rows or guard.rows[-1]["step"] != step0 + step):
        guard.score(step0 + step)
    log(f"UL anneal: {step} steps in {time.time() - t0:.1f}s")
    return {"steps_done": step, "seconds": time.time() - t0, "history": history}
