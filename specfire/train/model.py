"""The batched training forward over the inference modules' own parameters.

Qwen35Trunk and MtpHead hold the weights under their checkpoint names; these functions read those
parameters and compute a batch [B, T] at once (GEMMs, SDPA, Gated DeltaNet by the functions of
kernels/gdn/ref.py that inference uses, the chunked rule with batch and heads folded together), so training and inference cannot disagree on
names or math: tests/train/test_train.py checks the logits against LLM.score() and the chained MTP rows
against the MtpHead run step by step.

MTP training follows the inference convention exactly. Step 1 at position p sees the trunk's
post-norm hidden at p and the embedding of token p+1 and predicts token p+2. Step s >= 2 at
position p sees step s-1's post-norm output at p-1 (the drafter's "post" feed) and token
p+1 (teacher forcing: a wrong draft ends acceptance anyway), and attends to what the head's KV
cache holds at that moment during decoding: step-1 rows at positions <= p-s+1 and the step-j row
at position p-s+j for 2 <= j <= s.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import FULL, ModelConfig
from ..kernels.gdn import ref as gdn_ref
from ..layers import GatedAttention, GatedDeltaNet
from ..model.qwen35 import DecoderLayer, MtpHead, Qwen35Trunk
from ..kernels.norm import gated_rms_norm_ref, rms_norm_ref
from ..kernels.small import apply_rope_ref, rope_cos_sin


# ---------------------------------------------------------------------------------------------
# Building and initialising
# ---------------------------------------------------------------------------------------------

def build(cfg: ModelConfig, device: torch.device | str, seed: int) -> tuple[Qwen35Trunk, MtpHead]:
    """Fresh trainable trunk and MTP head (float32 master weights) with a seeded initialisation."""
    with torch.device(device):
        trunk, head = Qwen35Trunk(cfg), MtpHead(cfg)
    init_weights(trunk, head, seed)
    for m in (trunk, head):
        for p in m.parameters():
            p.requires_grad_(True)
    return trunk, head


@torch.no_grad()
def init_weights(trunk: Qwen35Trunk, head: MtpHead, seed: int) -> None:
    """GPT-style init: N(0, 0.02) matrices, residual-output projections scaled by 1/sqrt(2 L);
    zero-centred norms at 0 (scale 1), the GDN output norm at 1; A_log = log U(1, 16) and
    dt_bias = 1 as in the reference implementation; conv taps U(+-1/sqrt(K))."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_layers = trunk.cfg.num_hidden_layers + 1
    out_std = 0.02 / math.sqrt(2 * n_layers)

    def normal_(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * std)

    for prefix, mod in (("", trunk), ("mtp.", head)):
        for name, p in mod.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                normal_(p, out_std)
            else:
                normal_(p, 0.02)


def count_params(trunk: Qwen35Trunk, head: MtpHead) -> dict[str, int]:
    t = sum(p.numel() for p in trunk.parameters())
    h = sum(p.numel() for p in head.parameters())
    emb = trunk.embed_tokens.weight.numel()
    return {"trunk": t, "mtp": h, "total": t + h, "embedding": emb}


# ---------------------------------------------------------------------------------------------
# Blocks, batched: x [B, T, H]
# ---------------------------------------------------------------------------------------------

def _gdn(m: GatedDeltaNet, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The layer's formulation of kernels/gdn/ref.py (inference's too), batched: x [B, T, H]."""
    b, t, _ = x.shape
    qkv = F.linear(x, m.in_proj_qkv.weight)                            # [B, T, conv_dim]
    z = F.linear(x, m.in_proj_z.weight).view(b, t, m.hv, m.dv)
    beta_in = F.linear(x, m.in_proj_b.weight)
    a = F.linear(x, m.in_proj_a.weight)
    with torch.autocast(device_type=x.device.type, enabled=False):
        w = m.conv1d.weight[:, 0, :]
        window = torch.zeros(b, w.shape[1] - 1, m.conv_dim, device=x.device, dtype=torch.float32)
        conv, _ = gdn_ref.conv_window_ref(qkv.float(), window, w)
        q, k, v = m.heads(conv)
        beta, g = gdn_ref.gates_ref(beta_in, a, m.A_log, m.dt_bias)
        q, k = gdn_ref.l2norm_ref(q, m.dk ** -0.5), gdn_ref.l2norm_ref(k)
        rep = m.hv // m.hk
        if rep > 1:
            q = q.repeat_interleave(rep, dim=2)
            k = k.repeat_interleave(rep, dim=2)

        def fold(y: torch.Tensor) -> torch.Tensor:  # [B, T, Hv, ...] -> [T, B*Hv, ...]
            return y.transpose(0, 1).reshape(t, b * m.hv, *y.shape[3:])

        s0 = torch.zeros(b * m.hv, m.dk, m.dv, device=x.device, dtype=torch.float32)
        o, _ = gdn_ref.gdn_chunked_ref(fold(q), fold(k), fold(v), fold(g), fold(beta), s0, chunk=chunk)
        o = o.reshape(t, b, m.hv, m.dv).transpose(0, 1)                 # [B, T, Hv, dv]
    o = gated_rms_norm_ref(o.to(x.dtype), z, m.norm.weight, m.norm.eps)
    return F.linear(o.reshape(b, t, m.value_dim), m.out_proj.weight)


def _qkv(m: GatedAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """-> q [B, Hq, T, D], gate [B, T, Hq*D], k, v [B, Hkv, T, D]."""
    b, t, _ = x.shape
    d = m.head_dim
    qg = F.linear(x, m.q_proj.weight).view(b, t, m.n_heads, 2 * d)     # [B, T, Hq, 2D]
    q, gate = qg[..., :d], qg[..., d:]
    q = rms_norm_ref(q, m.q_norm.weight, m.q_norm.eps)
    k = rms_norm_ref(F.linear(x, m.k_proj.weight).view(b, t, m.n_kv, d), m.k_norm.weight, m.k_norm.eps)
    v = F.linear(x, m.v_proj.weight).view(b, t, m.n_kv, d)
    q = apply_rope_ref(q, cos, sin)
    k = apply_rope_ref(k, cos, sin)
    return q.transpose(1, 2), gate.reshape(b, t, -1), k.transpose(1, 2), v.transpose(1, 2)


def _attend(m: GatedAttention, q, gate, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal (mask None) or masked GQA attention, output gate, o_proj."""
    rep = m.n_heads // m.n_kv
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=m.scale)
    b, _, t, _ = o.shape
    o = o.transpose(1, 2).reshape(b, t, -1).to(gate.dtype) * torch.sigmoid(gate)
    return F.linear(o, m.o_proj.weight)


def _mlp(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    m = layer.mlp
    return F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)


def _norm(mod, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_ref(x, mod.weight, mod.eps)


# ---------------------------------------------------------------------------------------------
# Trunk and MTP head
# ---------------------------------------------------------------------------------------------

def trunk_hidden(trunk: Qwen35Trunk, ids: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """ids [B, T] from position 0 -> post-norm hidden [B, T, H]."""
    cfg = trunk.cfg
    x = F.embedding(ids, trunk.embed_tokens.weight)
    t = ids.shape[1]
    cos, sin = rope_cos_sin(torch.arange(t, device=ids.device), cfg.rotary_dim, cfg.rope_theta)
    for layer in trunk.layers:
        h = _norm(layer.input_layernorm, x)
        if layer.kind == FULL:
            h = _attend(layer.self_attn, *_qkv(layer.self_attn, h, cos, sin), mask=None)
        else:
            h = _gdn(layer.linear_attn, h, chunk)
        x = x + h
        x = x + _mlp(layer, _norm(layer.post_attention_layernorm, x))
    return _norm(trunk.norm, x)


def lm_logits(trunk: Qwen35Trunk, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, trunk.lm_weight)


def _mtp_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """Boolean [L, step*L]: which keys (step-1 rows, then step-2.. rows) a step-`step` row at
    position p reads; see the module docstring."""
    p = torch.arange(length, device=device)[:, None]
    kpos = torch.arange(length, device=device)[None, :]
    blocks = [kpos <= p - step + 1]
    for j in range(2, step + 1):
        blocks.append(kpos == p - step + j)
    m = torch.cat(blocks, dim=1)
    m[:, 0] |= ~m.any(dim=1)  # rows with no valid key (p < step-1, never used) read something finite
    return m


def mtp_hidden(head: MtpHead, trunk: Qwen35Trunk, ids: torch.Tensor, h: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
    """ids [B, T], trunk post-norm hidden h [B, T, H] -> per step s, the head's post-norm output
    [B, T-1, H] at positions 0..T-2 (row p predicts token p+2; valid for p >= s-1)."""
    cfg = head.cfg
    length = ids.shape[1] - 1
    emb = _norm(head.pre_fc_norm_embedding, F.embedding(ids[:, 1:], trunk.embed_tokens.weight))
    cos, sin = rope_cos_sin(torch.arange(length, device=ids.device), cfg.rotary_dim, cfg.rope_theta)
    layer = head.layers[0]
    att = layer.self_attn
    hid = h[:, :-1]
    ks, vs, outs = [], [], []
    for s in range(1, steps + 1):
        x = F.linear(torch.cat([emb, _norm(head.pre_fc_norm_hidden, hid)], dim=-1), head.fc.weight)
        a_in = _norm(layer.input_layernorm, x)
        q, gate, k, v = _qkv(att, a_in, cos, sin)
        ks.append(k)
        vs.append(v)
        if s == 1:
            a = _attend(att, q, gate, k, v, mask=None)
        else:
            a = _attend(att, q, gate, torch.cat(ks, dim=2), torch.cat(vs, dim=2),
                        mask=_mtp_mask(length, s, ids.device))
        x = x + a
        x = x + _mlp(layer, _norm(layer.post_attention_layernorm, x))
        post = _norm(head.norm, x)
        outs.append(post)
        hid = F.pad(post[:, :-1], (0, 0, 1, 0))                        # step s+1 at p reads step s at p-1
    return outs
