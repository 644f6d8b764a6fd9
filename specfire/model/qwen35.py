"""The Qwen3.5 / Qwen3.6 dense text trunk and its MTP head, for batch-1 inference.

Two forward modes share the weights and the math:
* "prefill": many rows at once (GEMM, chunked Gated DeltaNet, batched causal attention); the live
  recurrent state is advanced in place.
* "rows": a few rows (decode = 1 row, verify = k+1 rows), computed row-invariantly so row r equals
  what a one-row decode at that position computes, bit for bit. The live recurrent state is left
  untouched; each row's update terms and the conv window are logged in the sequence state and
  `SequenceState.commit(n)` applies rows 0..n to the live state.

Each layer kind's implementation comes from the model's `Target`, picked once when it is built
(layers/__init__.py: one GPU, one CPU device, the canonical math; a mesh rank's shards:
parallel/layers.py). Parameter names follow the HF checkpoint (without the `model.language_model.`
prefix), so loading is a rename. Shapes: [T, ...] for T rows of one sequence.
"""
from __future__ import annotations

from typing import Any, Generator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import FULL, ModelConfig
from ..kernels.gemv import linear_prefix
from ..kernels.small import silu_mul
from ..layers import Target, target_for
from .kvpool import KvPool
from .state import LayerCache, Segments, SequenceState  # noqa: F401  (imported from here by runtime/, parallel/, tests)


def drain(steps: Generator[None, None, Any]) -> Any:
    """Run a step generator (a forward or prefill that yields at its pauses) to its end: its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def positions(pos0, t: int, device: torch.device) -> torch.Tensor:
    """Positions [t] from pos0: an int, or a one-element device tensor (CUDA-graph replay)."""
    if isinstance(pos0, torch.Tensor):
        return pos0 + torch.arange(t, device=device)
    return torch.arange(pos0, pos0 + t, device=device)


def _default_target() -> Target:
    """One device's target for the device modules are being built on (training, tests)."""
    return target_for(torch.get_default_device().type)


def rotary(target: Target, cfg: ModelConfig, pos0, t: int, device: torch.device, rows: bool):
    """cos, sin [t, rotary_dim] of positions pos0.."""
    return target.rowmap.rotary(positions(pos0, t, device), cfg.rotary_dim, cfg.rope_theta, rows)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, target: Target):
        super().__init__()
        h, i = cfg.hidden_size, target.share(cfg).inter
        self.gate_proj = target.column(h, i, cfg.intermediate_size)
        self.up_proj = target.column(h, i, cfg.intermediate_size)
        self.down_proj = target.row(cfg.intermediate_size, h)
        self.rowmap = target.rowmap

    def forward(self, x: torch.Tensor, rows: bool) -> torch.Tensor:
        """down(silu(gate x) * up x)."""
        g, u = self.gate_proj.group(x, rows, self.up_proj)
        return self.down_proj(self.rowmap(silu_mul, rows, g, u), rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, target: Target):
        super().__init__()
        self.kind = kind
        self.input_layernorm = target.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = target.norm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == FULL:
            self.self_attn = target.attention(cfg, target)
        else:
            self.linear_attn = target.gdn(cfg, target)
        self.mlp = MLP(cfg, target)

    def forward(self, x: torch.Tensor, pos0: int, cos_sin, lc: LayerCache, rows: bool,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, `pending` the previous layer's MLP output not yet added to it
        (None: none). Returns (x, this layer's MLP output): the layer's output is their sum, which
        the next norm computes with its own add (one kernel, the same bits as `x + mlp` then the norm).
        `pos0` Segments (rows mode): x holds several sequences' rows and `lc` is their caches' list."""
        if pending is None:
            h = self.input_layernorm(x, rows)
        else:
            x, h = self.input_layernorm.add(x, pending, rows)
        if isinstance(pos0, Segments):      # several sequences' rows: `lc` is each one's cache
            h = self.self_attn.packed(h, pos0, lc) if self.kind == FULL else self.linear_attn.packed(h, pos0, lc)
        elif self.kind == FULL:
            h = self.self_attn(h, pos0, cos_sin, lc, rows)
        else:
            h = self.linear_attn(h, lc, rows)
        x, h = self.post_attention_layernorm.add(x, h, rows)           # x += h; h = norm(x)
        return x, self.mlp(h, rows)


class Qwen35Trunk(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (tied to the embedding when absent)."""

    def __init__(self, cfg: ModelConfig, target: Target | None = None):
        super().__init__()
        target = target or _default_target()
        self.cfg, self.target = cfg, target
        self.embed_tokens = target.embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, target) for t in cfg.layer_types)
        self.norm = target.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        target.column(cfg.hidden_size, target.share(cfg).vocab, cfg.vocab_size))

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_state(self, max_seq: int, kv_dtype: torch.dtype, pool: KvPool | None = None) -> SequenceState:
        """A sequence's state; its KV in `pool`'s first layers when given (model/kvpool.py)."""
        s = self.target.share(self.cfg)
        return SequenceState.allocate(self.cfg, self.cfg.layer_types, max_seq, self.embed_tokens.weight.device,
                                      kv_dtype, n_kv=s.n_kv, n_v_heads=s.n_v_heads, conv_dim=s.conv_dim, pool=pool)

    def kv_heads(self) -> list[int]:
        """Each attention layer's KV heads (a KV pool's layout)."""
        return [self.target.share(self.cfg).n_kv] * sum(t == FULL for t in self.cfg.layer_types)

    def logits(self, h: torch.Tensor, rows: bool, vocab: int | None = None, widen: bool = True) -> torch.Tensor:
        """h [T, H] post-norm -> float32 logits [T, V]; `vocab` n: over token ids 0..n-1 only, [T, n]
        (the MTP drafter's reduced vocabulary: kernels/gemv linear_prefix reads no other row).
        widen False: in the product's own dtype (a greedy pick's argmax is the same)."""
        y = linear_prefix(h, self.lm_weight, vocab, rows, exact=self.target.exact)
        return y.float() if widen else y

    def packed(self, ids: torch.Tensor, segs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows forward of several sequences at once (ids [sum T] packed by segs.spans): each
        row computes what it computes in its own sequence's forward, bit for bit (row-invariant
        products and elementwise math; attention and Gated DeltaNet over each sequence's own
        state), while every weight is read once for all of them. -> (post-norm hidden, float32
        logits) over all rows."""
        with self.target.scope():
            x = self.embed_tokens(ids)
            segs.cos_sins = [rotary(self.target, self.cfg, p, b - a, ids.device, True)
                             for p, (a, b) in zip(segs.pos0s, segs.spans)]
            pending = None
            for i, layer in enumerate(self.layers):
                x, pending = layer(x, segs, None, segs.layer(i), True, pending)
            _, h = self.norm.add(x, pending, True)
            return h, self.logits(h, True)

    def forward(self, ids: torch.Tensor, pos0: int, state: SequenceState, rows: bool,
                logits: str = "all") -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [T] at positions pos0.. -> (post-norm hidden [T, H], float32 logits [T or 1, V] or None)."""
        return drain(self.forward_steps(ids, pos0, state, rows, logits))

    def forward_steps(self, ids: torch.Tensor, pos0: int, state: SequenceState, rows: bool, logits: str = "all",
                      pause: int = 0) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """`forward`, yielding after every `pause` layers (0: never): a scheduler runs other
        requests' steps inside a long prefill forward, which computes what it computes unpaused.
        The target's scope is entered per run of layers, never held across a pause."""
        pairs = list(zip(self.layers, state.layers))
        every = pause if pause > 0 else len(pairs)
        with self.target.scope():
            x = self.embed_tokens(ids)
            cos_sin = rotary(self.target, self.cfg, pos0, ids.shape[0], ids.device, rows)
        pending = None
        for a in range(0, len(pairs), every):
            if a:
                yield
            with self.target.scope():
                for layer, lc in pairs[a:a + every]:
                    x, pending = layer(x, pos0, cos_sin, lc, rows, pending)
        with self.target.scope():
            _, h = self.norm.add(x, pending, rows)
            if logits == "none":
                return h, None
            return h, self.logits(h if logits == "all" else h[-1:], rows)


class MtpHead(nn.Module):
    """The multi-token-prediction head (15 tensors): from the trunk's post-norm hidden at p and the
    token at p+1, predict the token at p+2 through one gated-attention decoder layer (own KV cache)."""

    fused: bool | None = None   # the drafter's fused picks and embedding gather (layers/attention.py fuses)

    def __init__(self, cfg: ModelConfig, target: Target | None = None):
        super().__init__()
        target = target or _default_target()
        self.cfg, self.target = cfg, target
        h = cfg.hidden_size
        self.fc = target.replicated(2 * h, h)
        self.pre_fc_norm_embedding = target.norm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = target.norm(h, cfg.rms_norm_eps)
        self.norm = target.norm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL, target)])

    def new_state(self, max_seq: int, kv_dtype: torch.dtype, pool: KvPool | None = None, layer0: int = 0,
                  table=None) -> SequenceState:
        """The head's KV; in `pool`'s layer layer0 over the trunk sequence's `table` when given."""
        return SequenceState.allocate(self.cfg, (FULL,), max_seq, self.fc.weight.device, kv_dtype,
                                      n_kv=self.target.share(self.cfg).n_kv, pool=pool, layer0=layer0, table=table)

    def kv_heads(self) -> list[int]:
        return [self.target.share(self.cfg).n_kv]

    def forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, pos0: int, state: SequenceState,
                rows: bool, ids: torch.Tensor | None = None,
                embed_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """emb [R, H] embeddings of tokens at p+1, hidden [R, H] at p (positions pos0..) ->
        (pre-norm block output [R, H], post-norm output [R, H] that the lm_head scores).
        emb None: the tokens `ids` [R] (device) and the trunk's embedding `embed_weight` [V, H]
        instead (the fused head step gathers them inside its fc-input kernel: model/cuda.py)."""
        if emb is None:
            if ids is None or embed_weight is None:
                raise ValueError("MtpHead: give emb, or ids and embed_weight")
        elif ids is not None:
            raise ValueError("MtpHead: give emb or ids, not both")
        with self.target.scope():
            return self.step(emb, hidden, pos0, state, rows, ids, embed_weight)

    def step(self, emb, hidden, pos0, state, rows, ids=None, embed_weight=None):
        """fc(cat(norm(emb), norm(hidden))), then the decoder layer and the final norm."""
        x = self.fc(self.fc_input(emb, hidden, rows, ids, embed_weight), rows)
        return self.block(x, rotary(self.target, self.cfg, pos0, x.shape[0], x.device, rows), pos0, state, rows)

    def fc_input(self, emb, hidden, rows, ids=None, embed_weight=None) -> torch.Tensor:
        """cat(norm(emb), norm(hidden)) [R, 2H] (emb None: gathered from embed_weight by ids)."""
        if emb is None:
            emb = F.embedding(ids, embed_weight)
        return torch.cat([self.pre_fc_norm_embedding(emb, rows), self.pre_fc_norm_hidden(hidden, rows)], dim=-1)

    def packed(self, emb: torch.Tensor | None, hidden: torch.Tensor, segs: Segments, ids: torch.Tensor | None = None,
               embed_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows step of several sequences at once (rows segs.spans of emb / hidden, each over its
        own state in segs.states): the fc, projections, MLP and norms over every row once (every
        weight read once: the drafters of a round draft together), attention per sequence."""
        with self.target.scope():
            x = self.fc(self.fc_input(emb, hidden, True, ids, embed_weight), True)
            segs.cos_sins = [rotary(self.target, self.cfg, p, b - a, x.device, True)
                             for p, (a, b) in zip(segs.pos0s, segs.spans)]
            x, mlp = self.layers[0](x, segs, None, segs.layer(0), True)
            return self.norm.add(x, mlp, True)

    def block(self, x: torch.Tensor, cos_sin, pos0, state: SequenceState, rows: bool):
        """The decoder layer and the final norm over the fc's output x [R, H]."""
        x, mlp = self.layers[0](x, pos0, cos_sin, state.layers[0], rows)
        return self.norm.add(x, mlp, rows)
