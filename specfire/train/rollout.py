"""Batched greedy decoding with the trainer's weights, for sequence-level unlikelihood training.

Sequence-level unlikelihood needs the model's own greedy continuations of many prompts at every
refresh; a full forward per new token would cost O(T^2), so this keeps per-layer recurrent state
(GDN conv window and delta-rule state, attention KV cache) and advances B sequences one token per
step with the same math as `model.py`'s batched forward (tests/train/test_train.py checks the two agree).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import FULL
from ..kernels.gdn import ref as gdn_ref
from ..kernels.norm import gated_rms_norm_ref
from ..kernels.small import rope_cos_sin
from . import model as tm


class _State:
    """Per layer: GDN (conv window [B, K-1, C], delta state [B, Hv, dk, dv]) or attention (K, V
    caches [B, Hkv, max_len, D])."""

    def __init__(self, trunk, batch: int, max_len: int, device: torch.device):
        self.layers = []
        for layer in trunk.layers:
            if layer.kind == FULL:
                a = layer.self_attn
                shape = (batch, a.n_kv, max_len, a.head_dim)
                self.layers.append((torch.zeros(shape, device=device), torch.zeros(shape, device=device)))
            else:
                m = layer.linear_attn
                k_size = m.conv1d.weight.shape[-1]
                self.layers.append((torch.zeros(batch, k_size - 1, m.conv_dim, device=device),
                                    torch.zeros(batch, m.hv, m.dk, m.dv, device=device)))


def _gdn_step(m, x: torch.Tensor, st: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B, H] -> [B, H]; advances the conv window and the delta-rule state in place (the
    formulation of kernels/gdn/ref.py, batch folded into the heads of the recurrence)."""
    b = x.shape[0]
    win, s = st
    qkv = F.linear(x, m.in_proj_qkv.weight)
    z = F.linear(x, m.in_proj_z.weight).view(b, m.hv, m.dv)
    beta_in = F.linear(x, m.in_proj_b.weight)
    a = F.linear(x, m.in_proj_a.weight)
    with torch.autocast(device_type=x.device.type, enabled=False):
        conv, full = gdn_ref.conv_window_ref(qkv.float()[:, None], win, m.conv1d.weight[:, 0, :])   # [B, 1, C]
        win.copy_(full[:, 1:])
        q, k, v = m.heads(conv[:, 0])
        beta, g = gdn_ref.gates_ref(beta_in, a, m.A_log, m.dt_bias)
        q, k = gdn_ref.l2norm_ref(q, m.dk ** -0.5), gdn_ref.l2norm_ref(k)
        rep = m.hv // m.hk
        if rep > 1:
            q = q.repeat_interleave(rep, dim=1)
            k = k.repeat_interleave(rep, dim=1)
        n = b * m.hv
        o, s1 = gdn_ref.gdn_rows_ref(q.reshape(1, n, m.dk), k.reshape(1, n, m.dk), v.reshape(1, n, m.dv),
                                     g.reshape(1, n), beta.reshape(1, n), s.view(n, m.dk, m.dv))
        s.copy_(s1.view_as(s))
        o = o.view(b, m.hv, m.dv)
    o = gated_rms_norm_ref(o.to(x.dtype), z, m.norm.weight, m.norm.eps)
    return F.linear(o.reshape(b, m.value_dim), m.out_proj.weight)


def _attn_step(m, x: torch.Tensor, pos: int, cos_sin, st) -> torch.Tensor:
    kc, vc = st
    q, gate, k, v = tm._qkv(m, x[:, None], *cos_sin)                   # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
    kc[:, :, pos] = k[:, :, 0].float()
    vc[:, :, pos] = v[:, :, 0].float()
    mask = torch.ones(1, pos + 1, dtype=torch.bool, device=x.device)
    return tm._attend(m, q, gate, kc[:, :, :pos + 1].to(q.dtype), vc[:, :, :pos + 1].to(q.dtype), mask)[:, 0]


def step_logits(trunk, tokens: torch.Tensor, pos: int, state: _State) -> torch.Tensor:
    """tokens [B] at position `pos` -> next-token logits [B, V]; advances `state`."""
    cfg = trunk.cfg
    x = F.embedding(tokens, trunk.embed_tokens.weight)
    cos_sin = rope_cos_sin(torch.tensor([pos], device=tokens.device), cfg.rotary_dim, cfg.rope_theta)
    for layer, st in zip(trunk.layers, state.layers):
        h = tm._norm(layer.input_layernorm, x)
        if layer.kind == FULL:
            h = _attn_step(layer.self_attn, h, pos, cos_sin, st)
        else:
            h = _gdn_step(layer.linear_attn, h, st)
        x = x + h
        x = x + tm._mlp(layer, tm._norm(layer.post_attention_layernorm, x))
    return tm.lm_logits(trunk, tm._norm(trunk.norm, x))


@torch.no_grad()
def greedy_rollout(trunk, prompts: torch.Tensor, new_tokens: int, autocast: bool = False,
                   lengths: list[int] | None = None) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: each prompt followed by its greedy continuation
    (end-of-text is not special here: callers mask what follows it). With `lengths`, row b's
    prompt is its first lengths[b] tokens (the rest is padding, overwritten) and its continuation
    fills [lengths[b], lengths[b] + new_tokens): prompts of several lengths in one batch."""
    b, p = prompts.shape
    dev = prompts.device
    total = p + new_tokens
    state = _State(trunk, b, total, dev)
    out = torch.empty(b, total, dtype=torch.long, device=dev)
    out[:, :p] = prompts
    first = p
    if lengths is not None:
        if len(lengths) != b or min(lengths) < 1 or max(lengths) > p:
            raise ValueError(f"greedy_rollout: lengths must be {b} values in [1, {p}], got {lengths}")
        lens = torch.tensor(lengths, device=dev)
        first = min(lengths)
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
        for pos in range(total - 1):
            logits = step_logits(trunk, out[:, pos], pos, state)
            if pos + 1 >= first:
                nxt = logits.float().argmax(-1)
                if lengths is not None:     # rows still inside their prompt keep the prompt's token
                    nxt = torch.where(lens <= pos + 1, nxt, out[:, pos + 1])
                out[:, pos + 1] = nxt
    return out
