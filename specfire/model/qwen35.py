"""The Qwen3.5 / Qwen3.6 dense text trunk and its MTP head, for batch-1 inference.

Two forward modes share the weights and the math:
* "prefill": many rows at once (GEMM, chunked Gated DeltaNet, batched causal attention); the live
  recurrent state is advanced in place.
* "rows": a few rows (decode = 1 row, verify = k+1 rows), computed row-invariantly so row r equals
  what a one-row decode at that position computes, bit for bit on the CPU. The live recurrent
  state is left untouched; each row's update terms and the conv window are logged in the
  sequence state and `SequenceState.commit(n)` applies rows 0..n to the live state.

Parameter names follow the HF checkpoint (without the `model.language_model.` prefix), so loading
is a rename. Shapes are noted as [T, ...] for T rows of one sequence.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import FULL, ModelConfig
from ..kernels import attention as attn_ops
from ..kernels import gdn as gdn_ops
from ..kernels import head as head_fused
from ..kernels.cpu_exact import lanes
from ..kernels import norm as norm_ops
from ..kernels.cpu_exact import onecpu
from ..kernels import xsum
from ..kernels.small import silu_mul
from ..kernels.gemv import linear, linear_fused, linear_group, linear_prefix, one_cpu
from ..kernels.splitk import ChunkCache, KSplit, subtree
from ..kernels.canonical import enabled as splitk_enabled
from ..kernels.splitk import head_block
from ..kernels.small import apply_rope, rope_cos_sin
from ..kernels.cpu_exact.rowwise import rowwise, whole_steps
from . import cpu_rows
from .state import LayerCache, SequenceState  # noqa: F401  (imported from here by runtime/, parallel/, tests)


def positions(pos0, t: int, device: torch.device) -> torch.Tensor:
    """Positions [t] from pos0: an int, or a one-element device tensor (CUDA-graph replay)."""
    if isinstance(pos0, torch.Tensor):
        return pos0 + torch.arange(t, device=device)
    return torch.arange(pos0, pos0 + t, device=device)


class Linear(nn.Module):
    """A bias-free projection holding `weight` [out, in]; the matmul goes through ops.linear.

    `row_parallel`: the reduction over `in` is one tensor parallelism splits (o_proj, out_proj,
    down_proj), computed as the canonical float32 chunk tree of kernels/splitk on every degree of a
    mesh and in the canonical mode (one device's default is the plain product); a mesh sets `ksplit` to this rank's chunks and `combine` to the cross-rank tree. `launch_n`: the
    whole matrix's `out` when this is a column shard (CUDA launch settings, kernels/gemv)."""

    def __init__(self, in_features: int, out_features: int, row_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.ksplit = KSplit(in_features) if row_parallel else None
        self.combine = None               # mesh: float32 subtree [M, N] -> the whole tree, float32
        self.reserve = None               # mesh: (M, N) -> where the combine wants the subtree, or None
        self.launch_n: int | None = None
        self._chunks = ChunkCache()

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        """x's dtype, except on a mesh: there the combined sum stays float32, and the consumer
        (add_rms_norm) rounds it to the model dtype as its first step (the same bits as a cast
        here, one kernel less)."""
        if self.ksplit is None or (self.combine is None and not splitk_enabled(x)):
            return linear(x, self.weight, rows, self.launch_n)
        if self.combine is None:
            return subtree(x, self.weight, self.ksplit, rows, self._chunks, x.dtype)
        out = self.reserve(x.shape[0], self.weight.shape[0]) if self.reserve is not None else None
        return self.combine(subtree(x, self.weight, self.ksplit, rows, self._chunks, out=out))


def project(x: torch.Tensor, rows: bool, owner: nn.Module, *lins: Linear) -> list[torch.Tensor]:
    """Column projections of one input (MLP gate + up; attention q, k, v; GDN qkv, z, b, a): on
    one CPU device one product for all (kernels/gemv linear_fused, cached on `owner`); on CUDA
    one launch whose settings come from the whole matrices' shapes, so a shard computes every
    element as the whole does (kernels/gemv linear_group)."""
    if any(lin.ksplit is not None for lin in lins):
        return [lin(x, rows) for lin in lins]
    ws = [lin.weight for lin in lins]
    if one_cpu(x) and all(isinstance(w, torch.Tensor) and not w.is_inference() for w in ws):
        return list(linear_fused(x, tuple(ws), rows, owner))
    return linear_group(x, ws, rows, [lin.launch_n for lin in lins])


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (scale 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_cpu(x):
            return onecpu.rms_norm(x, self.weight, self.eps)
        return norm_ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if one_cpu(x):
            return onecpu.gated_rms_norm(x, z, self.weight, self.eps)
        return norm_ops.gated_rms_norm(x, z, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, row_parallel=True)

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        act = rowwise(silu_mul, rows, *project(x, rows, self, self.gate_proj, self.up_proj), batch=one_cpu(x))
        return self.down_proj(act, rows)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * lanes.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _rope(pos: torch.Tensor, cfg: ModelConfig, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not rows or pos.shape[0] == 1 or pos.device.type != "cpu":
        return rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
    cs = [rope_cos_sin(pos[i:i + 1], cfg.rotary_dim, cfg.rope_theta) for i in range(pos.shape[0])]
    return torch.cat([c for c, _ in cs]), torch.cat([s for _, s in cs])


# ---------------------------------------------------------------------------------------------
# Per-sequence state
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Mixers
# ---------------------------------------------------------------------------------------------

def _canon_block(whole_heads: int) -> int | None:
    """Heads per prefill library call inside a tensor-parallel invariant forward, else None."""
    return head_block(whole_heads) if lanes.invariant_now() else None


def fuses(mod: nn.Module, x: torch.Tensor) -> bool:
    """Whether `mod` (an attention or GDN layer, the MTP head) runs its fused Triton kernels around
    the GEMMs: on CUDA, unless its `fused` says otherwise (a CPU test sets True: the interpreter)."""
    return x.is_cuda if mod.fused is None else mod.fused


class GatedAttention(nn.Module):
    """Full attention with an output gate (interleaved per head in q_proj), q/k norms, partial rotary."""

    fused: bool | None = None   # the fused decode kernels (kernels/attention/fused.py); None: on CUDA (fuses)

    def __init__(self, cfg: ModelConfig, n_heads: int | None = None, n_kv: int | None = None):
        super().__init__()
        self.n_heads = n_heads if n_heads is not None else cfg.num_attention_heads
        self.n_kv = n_kv if n_kv is not None else cfg.num_key_value_heads
        self.whole_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.n_heads * self.head_dim * 2)
        self.k_proj = Linear(h, self.n_kv * self.head_dim)
        self.v_proj = Linear(h, self.n_kv * self.head_dim)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, row_parallel=True)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, pos0: int, cos_sin: tuple[torch.Tensor, torch.Tensor],
                lc: LayerCache, rows: bool) -> torch.Tensor:
        t = x.shape[0]
        d = self.head_dim
        qg, k, v = project(x, rows, self, self.q_proj, self.k_proj, self.v_proj)
        qg = qg.view(t, self.n_heads, 2 * d)                              # [T, Hq, 2D]
        table = isinstance(cos_sin, head_fused.RopeTable)
        # GPU: kernels/attention/fused.py; in prefill mode only where the caller handed a rotary table
        # (the MTP head's prompt catch-up, MtpHead._forward), never the trunk's prefill
        if (rows or table) and lc.k_scale is None and fuses(self, x):
            from ..kernels.attention import fused as af
            q = af.qk_norm_rope_write_triton(qg, k.view(t, self.n_kv, d), v.view(t, self.n_kv, d),
                                             self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                             *cos_sin, lc.k, lc.v, pos0, table=table)
            if rows:
                o = attn_ops.attention_rows(q, lc.k, lc.v, pos0, self.scale)
            else:
                o = attn_ops.attention_prefill(q, lc.k, lc.v, pos0, self.scale,
                                               q_block=_canon_block(self.whole_heads))
            return self.o_proj(af.out_gate_triton(o, qg), rows)
        if table:
            raise ValueError("GatedAttention: a rotary table is read by the fused q/k kernel only")
        q, gate = qg[..., :d], qg[..., d:]
        q = rowwise(self.q_norm, rows, q, batch=one_cpu(x))
        k = rowwise(self.k_norm, rows, k.view(t, self.n_kv, d), batch=one_cpu(x))
        v = v.view(t, self.n_kv, d)
        cos, sin = cos_sin
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn_ops.kv_write(lc, pos0, k, v)
        if rows:
            o = attn_ops.attention_rows(q, lc.k, lc.v, pos0, self.scale, lc.k_scale, lc.v_scale)
        else:      # canonical mode: library calls on a fixed number of heads (kernels/splitk head_block)
            o = attn_ops.attention_prefill(q, lc.k, lc.v, pos0, self.scale, lc.k_scale, lc.v_scale,
                                           q_block=_canon_block(self.whole_heads))
        o = o.to(x.dtype)                                                                 # [T, Hq, D]
        o = o.reshape(t, -1) * rowwise(lanes.sigmoid, rows, gate.reshape(t, -1), batch=one_cpu(x))
        return self.o_proj(o, rows)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule (see kernels/gdn for the recurrence)."""

    fused: bool | None = None   # the fused rows kernel (kernels/gdn/fused.py); None: on CUDA (fuses)

    def __init__(self, cfg: ModelConfig, n_k_heads: int | None = None, n_v_heads: int | None = None):
        super().__init__()
        self.hk = n_k_heads if n_k_heads is not None else cfg.linear_num_key_heads
        self.hv = n_v_heads if n_v_heads is not None else cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, self.conv_dim)
        self.in_proj_z = Linear(h, self.value_dim)
        self.in_proj_b = Linear(h, self.hv)
        self.in_proj_a = Linear(h, self.hv)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, cfg.linear_conv_kernel_dim), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, row_parallel=True)

    def _log_decay(self, a: torch.Tensor) -> torch.Tensor:
        return -lanes.exp(self.A_log.float()) * lanes.softplus(a.float() + self.dt_bias.float())

    def forward(self, x: torch.Tensor, lc: LayerCache, rows: bool) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = project(x, rows, self, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        w = self.conv1d.weight[:, 0, :]
        if rows and fuses(self, x) and w.shape[-1] <= gdn_ops.FUSED_MAX_CONV:   # GPU: kernels/gdn/fused.py
            from ..kernels.gdn.fused import gdn_decode_triton
            o, log, full = gdn_decode_triton(qkv, a, b, lc.conv, w, self.A_log, self.dt_bias, lc.rec,
                                             self.hk, self.dk, self.dv, z, self.norm.weight, self.norm.eps,
                                             out=lc.log_buffers(t))
            lc.set_log(*log, full)
            return self.out_proj(xsum.reshaped(o, (t, self.value_dim)), rows)   # the norm's group sums kept
        z = z.view(t, self.hv, self.dv)
        if rows and t > 1 and x.device.type == "cpu" and not (one_cpu(x) and whole_steps(qkv)):  # per row (kernels/cpu_exact/rowwise.py)
            xf = qkv.float()
            full = torch.cat([lc.conv.to(xf.dtype), xf], dim=0)
            kw = lc.conv.shape[0]
            conv_out = torch.cat([gdn_ops.conv_window(xf[i:i + 1], full[i:i + kw], w)[0] for i in range(t)])
        else:
            conv_out, full = gdn_ops.conv_window(qkv.float(), lc.conv, w)
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.hk, self.dk)
        k = k.reshape(t, self.hk, self.dk)
        v = v.reshape(t, self.hv, self.dv)
        if one_cpu(x):        # fewer calls (kernels/cpu_exact/onecpu.py); gates of Hv lanes per row, norms batched
            beta, g = rowwise(lambda *t: onecpu.gdn_gates(*t, self.A_log, self.dt_bias), rows, b, a)
            q, k = rowwise(onecpu.l2norm_qk, rows, q, k, batch=True)
        else:
            beta = rowwise(lanes.sigmoid, rows, b.float())
            g = rowwise(self._log_decay, rows, a)
            q = rowwise(_l2norm, rows, q) * (self.dk ** -0.5)
            k = rowwise(_l2norm, rows, k)
        if rows:
            rep = self.hv // self.hk
            if rep > 1:  # value head j reads key head j // rep
                q = q.repeat_interleave(rep, dim=1)
                k = k.repeat_interleave(rep, dim=1)
            o, (delta, dec) = gdn_ops.gdn_rows(q, k, v, g, beta, lc.rec, log=True)
            lc.set_log(k, delta, dec, full)
        else:   # key heads grouped: the chunked form maps them (or its GPU library reads them in place)
            o, s = gdn_ops.gdn_chunked(q, k, v, g, beta, lc.rec, canonical=lanes.invariant_now())
            lc.rec.copy_(s)
            lc.conv.copy_(full[-lc.conv.shape[0]:])
        o = rowwise(self.norm, rows, o.to(x.dtype), z, batch=one_cpu(x))  # [T, Hv, dv]
        return self.out_proj(o.reshape(t, self.value_dim), rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, **shard):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == FULL:
            self.self_attn = GatedAttention(cfg, shard.get("n_heads"), shard.get("n_kv"))
        else:
            self.linear_attn = GatedDeltaNet(cfg, shard.get("n_k_heads"), shard.get("n_v_heads"))
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, pos0: int, cos_sin, lc: LayerCache, rows: bool,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, `pending` the previous layer's MLP output not yet added to it
        (None: none). Returns (x, this layer's MLP output): the layer's output is their sum, which
        the next norm computes with its own add (add_rms_norm: one kernel, the same bits as
        `x + mlp` then the norm)."""
        h = _add_norm(self.input_layernorm, rows, x, pending)
        if pending is not None:
            x, h = h
        if self.kind == FULL:
            h = self.self_attn(h, pos0, cos_sin, lc, rows)
        else:
            h = self.linear_attn(h, lc, rows)
        x, h = _add_norm(self.post_attention_layernorm, rows, x, h)    # x += h; h = norm(x)
        return x, self.mlp(h, rows)


def _add_norm(norm: RMSNorm, rows: bool, x: torch.Tensor, h: torch.Tensor | None):
    """norm(x) when h is None, else (x + h, norm(x + h)) in one fused op (h rounded to x's dtype
    first: a mesh's row-parallel sums arrive in float32)."""
    if h is None:
        return rowwise(norm, rows, x, batch=one_cpu(x))
    if one_cpu(x):
        return rowwise(lambda a, b: onecpu.add_rms_norm(a, b, norm.weight, norm.eps), rows, x, h, batch=True)
    return rowwise(lambda a, b: norm_ops.add_rms_norm(a, b, norm.weight, norm.eps), rows, x, h)


# ---------------------------------------------------------------------------------------------
# Trunk and MTP head
# ---------------------------------------------------------------------------------------------

class Qwen35Trunk(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (tied to the embedding when absent)."""

    canonical = False    # a mesh rank's trunk: tensor-parallel invariant CPU math (kernels/cpu_exact/lanes.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_state(self, max_seq: int, kv_dtype: torch.dtype) -> SequenceState:
        dev = self.embed_tokens.weight.device
        return SequenceState.allocate(self.cfg, self.cfg.layer_types, max_seq, dev, kv_dtype)

    def logits(self, h: torch.Tensor, rows: bool, vocab: int | None = None, widen: bool = True) -> torch.Tensor:
        """h [T, H] post-norm -> float32 logits [T, V]; `vocab` n: over token ids 0..n-1 only, [T, n]
        (the MTP drafter's reduced vocabulary: kernels/gemv linear_prefix reads no other row).
        widen False: in the product's own dtype (a greedy pick's argmax is the same)."""
        y = linear_prefix(h, self.lm_weight, vocab, rows) if vocab is not None else linear(h, self.lm_weight, rows)
        return y.float() if widen else y

    def forward(self, ids: torch.Tensor, pos0: int, state: SequenceState, rows: bool,
                logits: str = "all") -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [T] at positions pos0.. -> (post-norm hidden [T, H], float32 logits [T or 1, V] or None)."""
        with lanes.invariant(self.canonical or splitk_enabled()):
            return self._forward(ids, pos0, state, rows, logits)

    def _forward(self, ids: torch.Tensor, pos0: int, state: SequenceState, rows: bool,
                 logits: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if rows and (got := cpu_rows.trunk_rows(self, ids, pos0, state, logits)) is not None:
            return got                                                  # one CPU device (model/cpu_rows.py)
        x = self.embed_tokens(ids)
        t = ids.shape[0]
        pos = positions(pos0, t, ids.device)
        cos_sin = _rope(pos, self.cfg, rows)
        pending = None
        for layer, lc in zip(self.layers, state.layers):
            x, pending = layer(x, pos0, cos_sin, lc, rows, pending)
        _, h = _add_norm(self.norm, rows, x, pending)
        if logits == "none":
            return h, None
        hl = h if logits == "all" else h[-1:]
        return h, self.logits(hl, rows)


class MtpHead(nn.Module):
    """The multi-token-prediction head (15 tensors): from the trunk's post-norm hidden at p and the
    token at p+1, predict the token at p+2 through one gated-attention decoder layer (own KV cache)."""

    fused: bool | None = None   # the fused rows step and catch-up (kernels/head); None: on CUDA (fuses)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL)])

    def new_state(self, max_seq: int, kv_dtype: torch.dtype) -> SequenceState:
        return SequenceState.allocate(self.cfg, (FULL,), max_seq, self.fc.weight.device, kv_dtype)

    def forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, pos0: int, state: SequenceState,
                rows: bool, ids: torch.Tensor | None = None,
                embed_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """emb [R, H] embeddings of tokens at p+1, hidden [R, H] at p (positions pos0..) ->
        (pre-norm block output [R, H], post-norm output [R, H] that the lm_head scores).
        emb None: the tokens `ids` [R] (device) and the trunk's embedding `embed_weight` [V, H]
        instead; a rows step with the fused head step on (kernels/head) gathers them inside
        its fc-input kernel, else they are looked up here."""
        if emb is None:
            if ids is None or embed_weight is None:
                raise ValueError("MtpHead: give emb, or ids and embed_weight")
        elif ids is not None:
            raise ValueError("MtpHead: give emb or ids, not both")
        with lanes.invariant(splitk_enabled()):
            return self._forward(emb, hidden, pos0, state, rows, ids, embed_weight)

    def _forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, pos0: int, state: SequenceState,
                 rows: bool, ids: torch.Tensor | None = None,
                 embed_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lc = state.layers[0]
        # a rows step (the draft chain), or the prompt catch-up in prefill mode: the fused step's
        # kernels around the GEMMs (kernels/head), fewer launches, the same values
        fused = not lanes.invariant_now() and fuses(self, hidden)
        if emb is None and not (fused and isinstance(embed_weight, torch.Tensor)
                                and embed_weight.dtype == hidden.dtype):
            emb, ids = F.embedding(ids, embed_weight), None
        if rows and emb is not None and (got := cpu_rows.mtp_rows(self, emb, hidden, pos0, state)) is not None:
            return got                                                  # one CPU device (model/cpu_rows.py)
        if emb is None:      # gather + both norms + cat + the fc's group sums: one launch
            e, hn = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
            x = head_fused.fc_input(ids, embed_weight, hidden, e.weight, hn.weight, e.eps, hn.eps)
        else:
            x = torch.cat([rowwise(self.pre_fc_norm_embedding, rows, emb),
                           rowwise(self.pre_fc_norm_hidden, rows, hidden)], dim=-1)
        x = self.fc(x, rows)
        t = x.shape[0]
        cos_sin = None
        if fused and lc.k_scale is None and fuses(self.layers[0].self_attn, x):   # the fused q/k kernel reads the table
            cos_sin = head_fused.rope_table(x.device, self.cfg.rotary_dim, self.cfg.rope_theta, lc.k.shape[0])
        if cos_sin is None:
            pos = positions(pos0, t, x.device)
            cos_sin = _rope(pos, self.cfg, rows)
        x, mlp = self.layers[0](x, pos0, cos_sin, lc, rows)
        return _add_norm(self.norm, rows, x, mlp)
