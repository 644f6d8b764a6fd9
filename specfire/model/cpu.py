"""One CPU device's trunk and MTP head: decode and verify rows on packed float32 weights, in fewer calls.

Why: on a small model a CPU decode step is ~1000 small ATen calls besides the products. The rows
forward here computes the model's math (model/qwen35.py) in ~800 cheaper ones: weights packed per
layer and checked once per forward (not per module call), norms as sum of squares + sqrt + divide,
a rotary table with the rotation as one gather, the q/k norms of a layer in one call with the
attention scale folded into the q-norm weight, the GDN gates as one sigmoid and one pow over a
zero-padded 64-wide block of the in-projection (exp(-c softplus(z)) = sigmoid(-z)^c), the GDN
state update as kernels/gdn `update`'s multiply and add per row (the commit replays it).

Row invariance (a verify row computes exactly what a one-row decode computes), how:
* products: one `mm` per row on the same packed W^T (kernels/gemv linear_one_cpu);
* reductions over a row's last dimension (sum of squares, the conv taps): each output reduced
  alike whatever the row count (tests/model/test_onecpu.py);
* elementwise ops that round alike in ATen's vector and scalar code (+, *, /, sqrt) on any shape;
  transcendental ones (sigmoid, SiLU, pow) only on rows of whole 64-element steps, else per row
  (layers/rows.py), which is why the GDN gate inputs sit in a padded 64-wide block;
* the recurrence and attention per row.
Bits differ from the modules' path in the last places; prefill, other dtypes, 4-bit weights and
the Q8 KV cache take the modules' path (layers/*: the `cpu` target).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import FULL
from ..kernels.attention import gather, kv_write
from ..kernels.gemv import fused_t, linear_one_cpu, transposed
from ..kernels.small import rope_cos_sin
from ..layers.rows import GRAIN, STEP
from .qwen35 import MtpHead, Qwen35Trunk
from .state import Segments

ROPE_BLOCK = 256      # rotary table rows computed per call (a position's values never change as it grows)


def usable(x: torch.Tensor) -> bool:
    """This path applies: a float32 CPU tensor."""
    return x.dtype == torch.float32 and x.device.type == "cpu"


def _rows(fn, whole: bool, *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) (elementwise, may round differently in ATen's vector and scalar code) on all rows at
    once when `whole` (every row a whole number of STEP elements: all on the vector path) and no
    loop is split between threads; else one row at a time, as a decode computes it."""
    t = xs[0].shape[0]
    if t == 1 or whole and (torch.get_num_threads() == 1 or all(x.numel() <= GRAIN for x in xs)):
        return fn(*xs)
    return torch.cat([fn(*(x[i:i + 1] for x in xs)) for i in range(t)])


def _whole(*widths: int) -> bool:
    return all(w % STEP == 0 for w in widths)


def _norm(x: torch.Tensor, w: torch.Tensor, eps_d: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps_d) * w over the last dim (w carries sqrt(d) for an RMSNorm, so
    this is x rsqrt(mean(x^2) + eps) w with eps_d = d eps; a one-element tensor: a Python float
    operand costs ATen a scalar conversion, ~2x the op)."""
    den = (x * x).sum(-1, keepdim=True).add_(eps_d).sqrt_()
    return (x / den).mul_(w)


@dataclass
class NormPack:
    w: torch.Tensor       # sqrt(d) (1 + w)
    eps_d: torch.Tensor   # [1]: d eps


def _rms(mod) -> NormPack:
    """A zero-centred RMSNorm module's pack."""
    d = mod.weight.shape[-1]
    return NormPack((1.0 + mod.weight.float()) * d ** 0.5, torch.tensor([d * mod.eps]))


def add_norm(x: torch.Tensor, h: torch.Tensor | None, p: NormPack):
    """norm(x) when h is None, else (x + h, norm(x + h))."""
    if h is None:
        return _norm(x, p.w, p.eps_d)
    s = x + h
    return s, _norm(s, p.w, p.eps_d)


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet
# ----------------------------------------------------------------------------------------------

@dataclass
class GdnPack:
    wt: torch.Tensor        # [H, conv_dim + value_dim + P]: qkv, z, then [b | -a | 0] (P = 64-multiple)
    wc: torch.Tensor        # conv taps [conv_dim, K]
    off: torch.Tensor       # [P]: -dt_bias at the a lanes, else 0
    pw: torch.Tensor        # [P]: exp(A_log) at the a lanes, else 1
    qk_scale: torch.Tensor  # [2 Hk, 1]: dk^-1/2 for q heads, 1 for k heads
    rep: torch.Tensor | None  # [2 Hv] key head of each value head (q then k), None when Hk == Hv
    nw: torch.Tensor        # gated norm weight * sqrt(dv)
    eps_d: torch.Tensor     # [1]: dv eps
    l2_eps: torch.Tensor    # [1]: 1e-6 (the q/k L2 norms)
    out_t: torch.Tensor     # out_proj W^T (the prefill's copy)
    dims: tuple[int, ...]   # conv_dim, value_dim, key_dim, Hk, Hv, dk, dv
    whole: tuple[bool, bool]  # conv channels, dv on whole vector steps
    split: tuple[int, int, int]   # conv_dim, value_dim, P


def _gdn_pack(m) -> GdnPack:
    """beta = sigmoid(b) and the decay exp(-exp(A_log) softplus(a + dt_bias)) = sigmoid(-(a +
    dt_bias)) ^ exp(A_log) come from one sigmoid and one pow over the padded block."""
    hv, h = m.hv, m.in_proj_qkv.weight.shape[1]
    p = STEP * -(-2 * hv // STEP)
    ws = (m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight, -m.in_proj_a.weight)
    wt = torch.cat([*ws, torch.zeros(p - 2 * hv, h, dtype=ws[0].dtype)]).float().t().contiguous()
    off = torch.zeros(p)
    off[hv:2 * hv] = -m.dt_bias.float()
    pw = torch.ones(p)
    pw[hv:2 * hv] = torch.exp(m.A_log.float())
    qk_scale = torch.ones(2 * m.hk, 1)
    qk_scale[:m.hk] = m.dk ** -0.5
    r = hv // m.hk
    rep = None if r == 1 else torch.cat([torch.arange(hv) // r, m.hk + torch.arange(hv) // r])
    return GdnPack(wt, m.conv1d.weight[:, 0, :].float().contiguous(), off, pw, qk_scale, rep,
                   m.norm.weight.float() * m.dv ** 0.5, torch.tensor([m.dv * m.norm.eps]), torch.tensor([1e-6]),
                   transposed(m.out_proj.weight),
                   (m.conv_dim, m.value_dim, m.key_dim, m.hk, hv, m.dk, m.dv), (_whole(m.conv_dim), _whole(m.dv)),
                   (m.conv_dim, m.value_dim, p))


def _recurrence(q, k, v, dec, beta, s, t):
    """Per row: S = dec S; S += k (beta (v - S^T k))^T; o = S^T q. Returns (o [T, Hv, dv], each
    row's delta = beta (v - S^T k) [T, Hv, dv]); the update is kernels/gdn `update`'s exactly rounded
    operations (commit replays them). q, k [T, Hv, dk], v [T, Hv, dv], dec, beta [T, Hv]."""
    hv, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    if t == 1:                    # a decode: the same calls as a verify row, without the row views
        s = s * dec.view(hv, 1, 1)
        d = (v.view(hv, 1, dv) - torch.bmm(k.view(hv, 1, dk), s)).mul_(beta.view(hv, 1, 1))
        s = s + k.view(hv, dk, 1) * d
        return torch.bmm(q.view(hv, 1, dk), s).view(1, hv, dv), d.view(1, hv, dv)
    deltas = torch.empty(t, hv, 1, dv)
    out = torch.empty(t, hv, 1, dv)
    rows = zip(q.unsqueeze(2).unbind(0), k.unsqueeze(2).unbind(0), k.unsqueeze(3).unbind(0),
               v.unsqueeze(2).unbind(0), dec[:, :, None, None].unbind(0), beta[:, :, None, None].unbind(0),
               deltas.unbind(0), out.unbind(0))
    for qr, kr, kc, vr, de, be, d, o in rows:
        s = s * de
        torch.sub(vr, torch.bmm(kr, s), out=d).mul_(be)       # [Hv, 1, dv]
        s = s + kc * d
        torch.bmm(qr, s, out=o)
    return out.view(t, hv, dv), deltas.view(t, hv, dv)


def _gate(n: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return n.mul_(F.silu(z))


def gdn(p: GdnPack, x: torch.Tensor, lcs, segs=None) -> torch.Tensor:
    """The layer over one sequence's rows (lcs its cache), or several (`segs`, lcs their caches):
    the products over all rows, the conv and recurrence over each sequence's own state."""
    qkv, z, blk = linear_one_cpu(x, p.wt, True).split(p.split, 1)
    if segs is None:
        o = _gdn_core(p, qkv, z, blk, lcs)
    else:
        o = segs.cat([_gdn_core(p, qkv[a:b], z[a:b], blk[a:b], lc) for (a, b), lc in zip(segs.spans, lcs)])
    return linear_one_cpu(o.view(x.shape[0], p.dims[1]), p.out_t, True)


def _gdn_core(p: GdnPack, qkv, z, blk, lc) -> torch.Tensor:
    t = qkv.shape[0]
    cd, vd, kd, hk, hv, dk, dv = p.dims
    full = torch.cat([lc.conv, qkv])                                  # [K-1+T, C]
    conv = _rows(F.silu, p.whole[0], (full.unfold(0, p.wc.shape[1], 1) * p.wc).sum(-1))   # causal taps
    qk, v = conv.split((2 * kd, vd), 1)
    qk = qk.view(t, 2 * hk, dk)
    den = (qk * qk).sum(-1, keepdim=True).add_(p.l2_eps).sqrt_()
    qk = (qk / den).mul_(p.qk_scale)                                  # l2-normed q (scaled), k
    if p.rep is not None:
        qk = qk.index_select(1, p.rep)
    q, k = qk.split(hv, 1)
    sg = torch.sigmoid(blk + p.off)                                   # [T, P]: beta | sigmoid(-(a + dt_bias))
    dec = sg.pow(p.pw)[:, hv:2 * hv]
    o, delta = _recurrence(q, k, v.view(t, hv, dv), dec, sg[:, :hv], lc.rec, t)
    lc.set_log(k, delta, dec, full)
    den = (o * o).sum(-1, keepdim=True).add_(p.eps_d).sqrt_()
    return _rows(_gate, p.whole[1], (o / den).mul_(p.nw), z.reshape(t, hv, dv))


# ----------------------------------------------------------------------------------------------
# Gated attention
# ----------------------------------------------------------------------------------------------

@dataclass
class AttnPack:
    wt: torch.Tensor        # W^T of q (each head's d query then d gate columns), k, v (the prefill's copy)
    qk_w: torch.Tensor      # [Hq + Hkv, D]: sqrt(D) (1 + w) of q_norm (times the attention scale), k_norm
    perm: torch.Tensor      # [D] rotary partner of each dim (itself past rotary_dim)
    rot: int
    theta: float
    eps_d: torch.Tensor     # [1]: D eps
    out_t: torch.Tensor
    dims: tuple[int, int, int]   # Hq, Hkv, D
    whole: bool             # D on whole vector steps


def _attn_pack(m, rot: int, theta: float) -> AttnPack:
    d, hq = m.head_dim, m.n_heads
    qw = (1.0 + m.q_norm.weight.float()) * (d ** 0.5 * m.scale)
    kw = (1.0 + m.k_norm.weight.float()) * d ** 0.5
    w = torch.cat([qw.expand(hq, d), kw.expand(m.n_kv, d)])
    half = rot // 2
    perm = torch.arange(d)
    perm[:half] += half
    perm[half:rot] -= half
    wt = fused_t((m.q_proj.weight, m.k_proj.weight, m.v_proj.weight), m.q_proj)   # the prefill's copy (Linear.group)
    return AttnPack(wt, w.contiguous(), perm, rot, theta, torch.tensor([d * m.q_norm.eps]),
                    transposed(m.o_proj.weight), (hq, m.n_kv, d), _whole(d))


_ROPE: dict[tuple[int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(rot: int, theta: float, d: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, S) [>= n, 1, D] for x_rot = x C + x[perm] S: cos (1 past rot) and the signed sin (0
    past rot). Built in blocks of ROPE_BLOCK positions by one call each, so a position's values
    are the same whenever the table grows."""
    key = (rot, theta, d)
    have = _ROPE.get(key)
    done = 0 if have is None else have[0].shape[0]
    if done >= n:
        return have
    cs, ss = ([], []) if have is None else ([have[0]], [have[1]])
    half = rot // 2
    for b in range(done, max(n, 2 * done), ROPE_BLOCK):
        cos, sin = rope_cos_sin(torch.arange(b, b + ROPE_BLOCK), rot, theta)
        c = torch.ones(ROPE_BLOCK, 1, d)
        s = torch.zeros(ROPE_BLOCK, 1, d)
        c[:, 0, :rot] = cos
        s[:, 0, :half] = -sin[:, :half]
        s[:, 0, half:rot] = sin[:, half:]
        cs.append(c)
        ss.append(s)
    _ROPE[key] = (torch.cat(cs), torch.cat(ss))
    return _ROPE[key]


def _out_gate(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return o.mul_(torch.sigmoid(g))


def attention(p: AttnPack, x: torch.Tensor, pos0, lcs, segs=None) -> torch.Tensor:
    """The layer over one sequence's rows at pos0.. (lcs its cache), or several (`segs`, lcs their
    caches): the products over all rows, norms, rotary and attention per sequence."""
    t = x.shape[0]
    hq, hkv, d = p.dims
    qg, k, v = linear_one_cpu(x, p.wt, True).split((2 * hq * d, hkv * d, hkv * d), 1)
    qg = qg.view(t, hq, 2 * d)
    if segs is None:
        o = _attn_core(p, qg, k, v, pos0, lcs)
    else:
        o = segs.cat([_attn_core(p, qg[a:b], k[a:b], v[a:b], q0, lc)
                      for (a, b), q0, lc in zip(segs.spans, segs.pos0s, lcs)])
    return linear_one_cpu(o.view(t, hq * d), p.out_t, True)


def _attn_core(p: AttnPack, qg, k, v, pos0: int, lc) -> torch.Tensor:
    """One sequence's gated attention output [T, Hq, D]; writes its k, v."""
    t = qg.shape[0]
    hq, hkv, d = p.dims
    qk = torch.cat([qg[..., :d], k.reshape(t, hkv, d)], 1)           # [T, Hq + Hkv, D]
    den = (qk * qk).sum(-1, keepdim=True).add_(p.eps_d).sqrt_()
    qk = (qk / den).mul_(p.qk_w)
    c, s = rope_table(p.rot, p.theta, d, pos0 + t)
    qk = _rows(lambda a, cc, ss: (a * cc).addcmul_(a.index_select(-1, p.perm), ss), p.whole,
               qk, c[pos0:pos0 + t], s[pos0:pos0 + t])
    kv_write(lc, pos0, qk[:, hq:], v.reshape(t, hkv, d))
    keys, vals = gather(lc.k, lc.blocks, pos0 + t), gather(lc.v, lc.blocks, pos0 + t)   # (the values the rows hold)
    o = torch.empty(t, hq, d)
    rep = hq // hkv
    for r in range(t):
        n = pos0 + r + 1
        sc = torch.bmm(qk[r, :hq].view(hkv, rep, d), keys[:n].float().permute(1, 2, 0))
        torch.bmm(torch.softmax(sc, -1), vals[:n].float().transpose(0, 1), out=o[r].view(hkv, rep, d))
    return _rows(_out_gate, p.whole, o, qg[..., d:])


# ----------------------------------------------------------------------------------------------
# MLP, layers, trunk, MTP head
# ----------------------------------------------------------------------------------------------

def _act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g).mul_(u)


@dataclass
class LayerPack:
    full: bool              # gated attention (else Gated DeltaNet)
    n1: NormPack
    n2: NormPack
    mix: GdnPack | AttnPack
    gu_t: torch.Tensor      # MLP gate and up W^T (shared with prefill)
    down_t: torch.Tensor
    inter: int
    whole: bool             # intermediate size on whole vector steps


def _layer_pack(layer, cfg) -> LayerPack:
    full = layer.kind == FULL
    mix = _attn_pack(layer.self_attn, cfg.rotary_dim, cfg.rope_theta) if full else _gdn_pack(layer.linear_attn)
    m = layer.mlp
    return LayerPack(full, _rms(layer.input_layernorm), _rms(layer.post_attention_layernorm), mix,
                     fused_t((m.gate_proj.weight, m.up_proj.weight), m.gate_proj), transposed(m.down_proj.weight),
                     m.gate_proj.weight.shape[0], _whole(m.gate_proj.weight.shape[0]))


def layer(p: LayerPack, x, pos0, lc, pending, segs=None):
    """One decoder layer: (residual, this layer's MLP output), as DecoderLayer.forward (`segs`:
    several sequences' rows, `lc` their caches)."""
    h = add_norm(x, pending, p.n1)
    if pending is not None:
        x, h = h
    h = attention(p.mix, h, pos0, lc, segs) if p.full else gdn(p.mix, h, lc, segs)
    x, h = add_norm(x, h, p.n2)
    g, u = linear_one_cpu(h, p.gu_t, True).split(p.inter, 1)
    return x, linear_one_cpu(_rows(_act, p.whole, g, u), p.down_t, True)


def _packs(owner, build):
    """The packs of `owner` (a trunk or an MTP head), rebuilt when one of its parameters changed
    or was replaced; None when a weight is not a plain float32 CPU parameter (a 4-bit weight, an
    inference tensor): then this path does not apply."""
    hit = owner.__dict__.get("_specfire_rows")
    if hit is not None and all(d.get(n) is t and t._version == v for d, n, t, v in hit[0]):
        return hit[1]
    try:
        checks = [(m._parameters, n, t, t._version) for m in owner.modules() for n, t in m._parameters.items()]
    except (AttributeError, RuntimeError):        # an inference tensor has no version counter
        return None
    ok = all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
             for _, _, t, _ in checks) and not any("weight" in m.__dict__ for m in owner.modules())  # 4-bit
    with torch.no_grad():
        packs = build() if ok else None
    owner.__dict__["_specfire_rows"] = (checks, packs)
    return packs


class CpuQwen35Trunk(Qwen35Trunk):
    def forward(self, ids, pos0, state, rows, logits="all"):
        if rows and (got := self.packed_rows(ids, pos0, state, logits)) is not None:
            return got
        return super().forward(ids, pos0, state, rows, logits)

    def packed(self, ids, segs):
        if (got := self.packed_rows(ids, segs, None, "all")) is not None:
            return got
        return super().packed(ids, segs)

    def packed_rows(self, ids: torch.Tensor, pos0, state, logits: str):
        """The rows forward on the packs, or None where they do not apply."""
        w = self.embed_tokens.weight
        segs = pos0 if isinstance(pos0, Segments) else None        # several sequences' rows (`packed`)
        states = segs.states if segs is not None else [state]
        if not (segs is not None or isinstance(pos0, int)) or not usable(w) or any(
                lc.k_scale is not None for st in states for lc in st.layers):
            return None
        packs = _packs(self, lambda: ([_layer_pack(l, self.cfg) for l in self.layers], _rms(self.norm),
                                      transposed(self.lm_weight)))
        if packs is None:
            return None
        layers, final, lm_t = packs
        x = F.embedding(ids, w)
        pending = None
        for i, p in enumerate(layers):
            x, pending = (layer(p, x, None, segs.layer(i), pending, segs) if segs is not None else
                          layer(p, x, pos0, state.layers[i], pending))
        _, h = add_norm(x, pending, final)
        if logits == "none":
            return h, None
        return h, linear_one_cpu(h if logits == "all" else h[-1:], lm_t, True)


class CpuMtpHead(MtpHead):
    def step(self, emb, hidden, pos0, state, rows, ids=None, embed_weight=None):
        if emb is None:
            emb = F.embedding(ids, embed_weight)
        if rows and (got := self.packed_rows(emb, hidden, pos0, state)) is not None:
            return got
        return super().step(emb, hidden, pos0, state, rows)

    def packed_rows(self, emb: torch.Tensor, hidden: torch.Tensor, pos0, state):
        if not isinstance(pos0, int) or not usable(emb) or state.layers[0].k_scale is not None:
            return None
        packs = _packs(self, lambda: (_layer_pack(self.layers[0], self.cfg), _rms(self.pre_fc_norm_embedding),
                                      _rms(self.pre_fc_norm_hidden), _rms(self.norm), transposed(self.fc.weight)))
        if packs is None:
            return None
        lp, e, hd, fin, fc_t = packs
        x = torch.cat([_norm(emb, e.w, e.eps_d), _norm(hidden, hd.w, hd.eps_d)], dim=-1)
        x, h = layer(lp, linear_one_cpu(x, fc_t, True), pos0, state.layers[0], None)
        return add_norm(x, h, fin)
