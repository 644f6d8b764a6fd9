"""Train the bundled model end to end: corpus -> tokenizer -> trunk + MTP head -> held-out eval -> export.

Reproducible: one seed drives the initialisation and the batch order; the corpus and the tokenizer
are deterministic functions of the interpreter's standard library. Loss = trunk LM loss + mtp_weight
x (sum over MTP steps of the step's loss), where a step's loss mixes cross-entropy on the true
token p+2 with cross-entropy against the trunk's own (detached) distribution for that token
(`mtp_distill`): acceptance is agreement with the trunk, so the trunk is the better teacher.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from ..config import FULL, LINEAR, ModelConfig
from . import model as tm
from .corpus import HELD_OUT_PACKAGES, build_corpus, build_site_corpus, subsample
from .evaluate import evaluate, pack, windows
from .export import export_checkpoint, write_attribution
from .tok import ENDOFTEXT, IM_END, save_tokenizer, train_tokenizer

PRESETS: dict[str, dict] = {
    # the shipped model: 12 layers in the real 3:1 pattern on a 4096-token vocabulary, trained on the
    # `site` corpus (the stdlib + permissive site-packages) for a wall-clock budget: the cosine
    # schedule's length is fixed from the step time measured after `probe_steps` steps so it ends
    # when the budget does (`steps` caps it; the run's metrics record the length it chose).
    "bundled": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=12,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                    steps=20000, batch_size=128, seq_len=512, lr=2.5e-3, min_lr_frac=0.05, warmup=100,
                    corpus="site", deadline_s=520.0, reserve_s=40.0, checkpoint_every_s=150.0),
    # the first bundled model (stdlib only, 8 layers, vocab 8192): planned for 2200 steps, stopped by
    # a 360 s limit after step 2107; stop_after_steps replays that schedule.
    "stdlib-v1": dict(vocab_size=8192, hidden_size=256, intermediate_size=640, num_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                      steps=2200, stop_after_steps=2107, batch_size=64, seq_len=512, lr=2e-3, warmup=150),
    # a CPU smoke test of the whole pipeline
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=32,
                 steps=8, batch_size=4, seq_len=128, lr=3e-3, warmup=2, eval_windows=8, max_files=60),
}


@dataclass
class TrainConfig:
    out: str
    preset: str = "bundled"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 12
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 64
    rope_theta: float = 10_000_000.0
    steps: int = 2200
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_steps: int = 3
    mtp_weight: float = 0.3
    mtp_distill: float = 0.5
    seed: int = 0
    device: str = "cuda"
    eval_windows: int = 256
    time_limit_s: float = 0.0           # 0: none; otherwise stop training early (recorded in metrics)
    stop_after_steps: int = 0           # 0: none; otherwise stop after this many steps of the `steps` schedule
    corpus: str = "stdlib"              # stdlib | site (stdlib + permissive site-packages, corpus.py)
    held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES
    deadline_s: float = 0.0             # 0: none; else the whole run ends by this many seconds after start:
    reserve_s: float = 75.0             #   training stops reserve_s before it (eval + export), and the
    probe_steps: int = 30               #   schedule length is fitted to the budget after probe_steps steps
    checkpoint_every_s: float = 0.0     # 0: none; else export (and pack) an interim checkpoint this often
    pack_dir: str | None = None         # also pack every export into tar parts here (pack())
    tokenizer_sample_bytes: int = 48_000_000
    max_train_bytes: int = 320_000_000  # a larger corpus is subsampled by file (corpus.subsample)
    corpus_root: str | None = None
    extra_corpus_roots: tuple[str, ...] = ()
    max_files: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "steps", "batch_size",
                     "seq_len", "mtp_steps", "eval_windows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"train option {name} must be a positive integer, got {v!r}")
        if self.num_layers % 4:
            raise ValueError(f"train option num_layers must be a multiple of 4 (3:1 GDN:attention), got {self.num_layers}")
        if self.seq_len < self.mtp_steps + 3:
            raise ValueError(f"train option seq_len must be at least mtp_steps + 3, got {self.seq_len}")
        if self.corpus not in ("stdlib", "site"):
            raise ValueError(f"train option corpus must be 'stdlib' or 'site', got {self.corpus!r}")
        if not 0.0 <= self.mtp_distill <= 1.0:
            raise ValueError(f"train option mtp_distill must be in [0, 1], got {self.mtp_distill}")

    def model_config(self, eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        types = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_layers))
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, layer_types=types, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            rope_theta=self.rope_theta, partial_rotary_factor=0.25, max_position_embeddings=32768,
            tie_word_embeddings=True, mtp_num_hidden_layers=1, eos_token_ids=eos_ids)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------

def compute_losses(trunk, head, ids: torch.Tensor, mtp_steps: int, distill: float,
                   want_metrics: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """ids [B, T] -> (trunk LM loss, per-step MTP losses, metrics if asked)."""
    v = trunk.cfg.vocab_size
    h = tm.trunk_hidden(trunk, ids)
    logits = tm.lm_logits(trunk, h).float()                            # [B, T, V]
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
    outs = tm.mtp_hidden(head, trunk, ids, h, mtp_steps)
    tgt = ids[:, 2:]                                                    # row p predicts p+2
    teacher_logits = logits[:, 1:-1].detach()                           # trunk row p+1 predicts p+2
    teacher = teacher_logits.softmax(-1) if distill > 0 else None
    losses, met = [], {}
    if want_metrics:
        trunk_pred = logits[:, :-1].argmax(-1)
        met["lm_acc"] = (trunk_pred == ids[:, 1:]).float().mean().item()
        trunk_next = teacher_logits.argmax(-1)                          # [B, T-2]
    for s, post in enumerate(outs, 1):
        ml = tm.lm_logits(trunk, post[:, :-1]).float()[:, s - 1:]       # valid rows p >= s-1
        ts = tgt[:, s - 1:]
        logp = ml.log_softmax(-1)
        ce = F.nll_loss(logp.reshape(-1, v), ts.reshape(-1))
        loss = ce
        if teacher is not None:
            soft = -(teacher[:, s - 1:] * logp).sum(-1).mean()
            loss = (1 - distill) * ce + distill * soft
        losses.append(loss)
        if want_metrics:
            pred = ml.argmax(-1)
            agree = pred == trunk_next[:, s - 1:]
            met[f"mtp{s}_ce"] = ce.item()
            met[f"mtp{s}_acc"] = (pred == ts).float().mean().item()
            met[f"mtp{s}_agree"] = agree.float().mean().item()
            # agree_s[:, i] belongs to the draft cycle whose step 1 is at row i (step s at row i+s-1)
            chain = agree if s == 1 else chain[:, :agree.shape[1]] & agree
            met[f"mtp_chain{s}"] = chain.float().mean().item()
    return lm, losses, met


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
        return build_site_corpus(tuple(tc.held_out_packages), tc.max_files, log=log)
    return build_corpus(tc.corpus_root, tc.max_files, tc.extra_corpus_roots)


def run(tc: TrainConfig, log=print) -> dict:
    t_start = time.time()
    torch.manual_seed(tc.seed)
    dev = torch.device(tc.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(tc.out, exist_ok=True)

    # ---- corpus and tokenizer ------------------------------------------------------------------
    corpus = _corpus(tc, log)
    if sum(len(t) for _, t in corpus.train) > tc.max_train_bytes:
        n = len(corpus.train)
        corpus.train = subsample(corpus.train, tc.max_train_bytes)
        log(f"corpus subsampled to {len(corpus.train)} of {n} files (max_train_bytes {tc.max_train_bytes})")
    csum = corpus.summary()
    log(f"corpus ({tc.corpus}): {csum['train_files']} train files ({csum['train_bytes'] / 1e6:.1f} MB), "
        f"{csum['held_out_files']} held-out files ({csum['held_out_bytes'] / 1e6:.2f} MB); "
        f"{time.time() - t_start:.1f}s")
    tok = train_tokenizer(_tokenizer_sample(corpus.train, tc.tokenizer_sample_bytes), tc.vocab_size)
    special = save_tokenizer(tok, tc.out, model_max_length=32768)
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
    cfg = tc.model_config((eot, special[IM_END]))
    trunk, head = tm.build(cfg, dev, tc.seed)
    counts = tm.count_params(trunk, head)
    log(f"params: {counts}")
    params = [p for m in (trunk, head) for p in m.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    autocast = dev.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(tc.seed + 1)
    offs = torch.arange(tc.seq_len, device=dev)
    base = {"train_config": asdict(tc), "params": counts, "corpus": csum,
            "tokens": {"train": int(train_ids.numel()), **{k: int(v.numel()) for k, v in held.items()}},
            "env": {"python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}}

    def save(tag: str, extra: dict) -> None:
        files = export_checkpoint(trunk, head, tc.out, [eot, special[IM_END]])
        with open(os.path.join(tc.out, "train_metrics.json"), "w") as f:
            json.dump({**base, **extra, "checkpoint": tag, "files": files}, f, indent=2)
        if tc.pack_dir:
            pack(tc.out, tc.pack_dir)
        log(f"checkpoint ({tag}) written at {time.time() - t_start:.1f}s")

    # ---- training --------------------------------------------------------------------------------
    from tqdm import tqdm

    t_train = time.time()
    budget = tc.deadline_s - tc.reserve_s - (t_train - t_start) if tc.deadline_s else 0.0
    if tc.deadline_s and budget <= 0:
        raise RuntimeError(f"no training time left: prep took {t_train - t_start:.0f}s of deadline_s {tc.deadline_s}")
    limit = min(x for x in (tc.time_limit_s, budget, float("inf")) if x > 0)
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

    # ---- evaluation and export ------------------------------------------------------------------
    trunk.eval()
    head.eval()
    t_eval = time.time()
    evals = {}
    for name, data in held.items():
        if data.numel() > tc.seq_len:
            evals[name] = evaluate(trunk, head, windows(data, tc.seq_len, tc.eval_windows), tc.mtp_steps, dev, autocast)
            log(f"{name}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in evals[name].items()}))
    # the same measure on training text (windows spread over the stream) shows the train/held-out gap
    evals["train_sample"] = evaluate(trunk, head, windows(train_ids, tc.seq_len, tc.eval_windows, spread=True),
                                     tc.mtp_steps, dev, autocast)
    log("train_sample: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                       for k, v in evals["train_sample"].items()}))
    eval_s = time.time() - t_eval
    metrics = {
        **evals, "train_seconds": train_s, "eval_seconds": eval_s,
        "total_seconds": time.time() - t_start, "peak_gpu_gib": peak_gb, "steps_done": steps_done,
        "schedule_steps": sched, "tokens_seen": steps_done * tc.batch_size * tc.seq_len,
        "epochs": steps_done * tc.batch_size * tc.seq_len / train_ids.numel(), "history": history,
    }
    save("final", metrics)
    log(f"done: train {train_s:.1f}s, eval {eval_s:.1f}s, total {time.time() - t_start:.1f}s -> {tc.out}")
    return {**base, **metrics}
