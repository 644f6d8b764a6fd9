"""The training losses every phase shares (pretraining, fine-tuning, evaluation): the trunk's LM
loss and the MTP head's per-step losses, with the metrics the evaluation reports."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import model as tm


def trunk_forward(trunk, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (post-norm hidden [B, T, H], float32 logits [B, T, V])."""
    h = tm.trunk_hidden(trunk, ids)
    return h, tm.lm_logits(trunk, h).float()


def optimizer(params: list, lr: float, weight_decay: float, dev: torch.device) -> torch.optim.AdamW:
    """AdamW (betas 0.9 / 0.95) with weight decay on the matrices only: every training phase's
    optimizer, over the trunk's and the MTP head's parameters."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")


def mtp_losses(trunk, head, ids: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, mtp_steps: int,
               distill: float, want_metrics: bool = False) -> tuple[list[torch.Tensor], dict]:
    """Per-step MTP losses (and metrics) given the trunk's hidden and logits for ids [B, T]."""
    v = trunk.cfg.vocab_size
    outs = tm.mtp_hidden(head, trunk, ids, h, mtp_steps)
    tgt = ids[:, 2:]                                                    # row p predicts p+2
    teacher_logits = logits[:, 1:-1].detach()                           # trunk row p+1 predicts p+2
    teacher = teacher_logits.softmax(-1) if distill > 0 else None
    losses, met, chain = [], {}, None     # chain: steps 1..s all agreed (set at s == 1)
    if want_metrics:
        trunk_next = teacher_logits.argmax(-1)                          # [B, T-2]
    for s, post in enumerate(outs, 1):
        ml = tm.lm_logits(trunk, post[:, :-1]).float()[:, s - 1:]       # valid rows p >= s-1
        ts = tgt[:, s - 1:]
        logp = ml.log_softmax(-1)
        ce = F.nll_loss(logp.reshape(-1, v), ts.reshape(-1))
        loss = ce
        if teacher is not None:
            soft = -(teacher[:, s - 1:] * logp).sum(-1).mean()
            loss = soft if distill == 1.0 else (1 - distill) * ce + distill * soft
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
    return losses, met


def compute_losses(trunk, head, ids: torch.Tensor, mtp_steps: int, distill: float,
                   want_metrics: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """ids [B, T] -> (trunk LM loss, per-step MTP losses, metrics if asked)."""
    h, logits = trunk_forward(trunk, ids)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    losses, met = mtp_losses(trunk, head, ids, h, logits, mtp_steps, distill, want_metrics)
    if want_metrics:
        met = {"lm_acc": (logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item(), **met}
    return lm, losses, met
