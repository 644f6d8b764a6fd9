"""Full attention with an output gate (interleaved per head in q_proj), q / k norms and partial
rotary, over the position-addressed KV cache of kernels/attention.

`GatedAttention` is the layer on any device; `FusedGatedAttention` (CUDA) writes q, k, v after
their norms and rotary in one kernel and fuses the output gate (kernels/attention/fused.py) for
decode / verify rows and for the MTP head's prompt catch-up, which hands it a rotary table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..kernels import attention as ka
from ..kernels import lanes
from ..kernels.head import RopeTable
from ..kernels.small import apply_rope
from ..kernels.splitk import head_block

if TYPE_CHECKING:
    from ..model.state import LayerCache, Segments
    from . import Target


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, target: Target):
        super().__init__()
        share = target.share(cfg)
        self.n_heads, self.n_kv = share.n_heads, share.n_kv
        d = self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = target.column(h, self.n_heads * d * 2, cfg.num_attention_heads * d * 2)
        self.k_proj = target.column(h, self.n_kv * d, cfg.num_key_value_heads * d)
        self.v_proj = target.column(h, self.n_kv * d, cfg.num_key_value_heads * d)
        self.o_proj = target.row(cfg.num_attention_heads * d, h)
        self.q_norm = target.norm(d, cfg.rms_norm_eps)
        self.k_norm = target.norm(d, cfg.rms_norm_eps)
        self.scale = d ** -0.5
        self.rowmap = target.rowmap
        # a canonical prefill calls the attention library on a fixed number of heads (kernels/splitk)
        self.q_block = head_block(cfg.num_attention_heads) if target.exact else None

    def forward(self, x: torch.Tensor, pos0: int, cos_sin: tuple[torch.Tensor, torch.Tensor],
                lc: LayerCache, rows: bool) -> torch.Tensor:
        """x [T, H] at positions pos0.. -> [T, H]; writes the rows' k, v into the cache."""
        f = self.fused_rows(x, cos_sin, lc, rows)
        qg, k, v = self.project(x, rows)
        return self.out(self.core(qg, k, v, pos0, cos_sin, lc, rows, f), qg, rows, f)

    def packed(self, x: torch.Tensor, segs: Segments, lcs: list[LayerCache]) -> torch.Tensor:
        """Several sequences' rows (segs.spans of x) in one pass over the weights: the projections
        over all rows, each sequence's norms, rotary, KV write and attention over its own cache."""
        f = self.fused_rows(x, segs.cos_sins[0], lcs[0], True)      # (one model: every cache alike)
        qg, k, v = self.project(x, True)
        if f:
            o = self.core_multi(qg, k, v, segs, lcs)
        elif self.q8_rows(x, lcs[0]):
            o = self.core_multi_q8(qg, k, v, segs, lcs)
        else:
            o = segs.cat([self.core(qg[a:b], k[a:b], v[a:b], p, cs, lc, True, f)
                          for (a, b), p, cs, lc in zip(segs.spans, segs.pos0s, segs.cos_sins, lcs)])
        return self.out(o, qg, True, f)

    def core_multi(self, qg, k, v, segs: Segments, lcs: list[LayerCache]) -> torch.Tensor:
        """`core` (fused) of every sequence at once: one launch per kernel over all rows, each
        sequence's rows at its own positions into its own cache (kernels/attention/multi.py)."""
        from ..kernels.attention import fused as af
        pack = rows_pack(segs, qg.device)
        t, d = qg.shape[0], self.head_dim
        cos, sin, table = pack.rotary
        first = lcs[0]
        q = af.qk_norm_rope_write_triton(qg, k.view(t, self.n_kv, d), v.view(t, self.n_kv, d), self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, cos, sin, first.k, first.v, None,
                                         table=table, multi=pack.launch(lcs), blocks=first.blocks)
        return ka.attention_rows_multi(q, lcs, pack, self.scale)

    def core_multi_q8(self, qg, k, v, segs: Segments, lcs: list[LayerCache]) -> torch.Tensor:
        """`core` (unfused: a Q8 cache) of every sequence at once: the norms and rotary over all
        rows (row by row alike), then one launch writes each sequence's quantized rows into its
        cache and one attention launch (with its combine) serves them all."""
        from ..kernels.attention import fused as af
        pack = rows_pack(segs, qg.device)
        t, d = qg.shape[0], self.head_dim
        cos, sin, table = pack.rotary
        if table:
            raise ValueError("GatedAttention: a rotary table is read by the fused q/k kernel only")
        q = apply_rope(self.q_norm(qg[..., :d], True), cos, sin)
        k = apply_rope(self.k_norm(k.view(t, self.n_kv, d), True), cos, sin)
        af.q8_write_multi_triton(k, v.view(t, self.n_kv, d), lcs, pack.launch(lcs))
        return ka.attention_rows_multi(q, lcs, pack, self.scale).to(qg.dtype)

    def fused_rows(self, x: torch.Tensor, cos_sin, lc: LayerCache, rows: bool) -> bool:
        """Whether the fused q/k/write and output-gate kernels run (FusedGatedAttention)."""
        return False

    def q8_rows(self, x: torch.Tensor, lc: LayerCache) -> bool:
        """Whether a packed forward over Q8 caches writes and attends in one launch each."""
        return False

    def project(self, x: torch.Tensor, rows: bool):
        """q with its gate [T, Hq, 2D] (per head [q | gate]), k, v [T, n_kv * D]."""
        qg, k, v = self.q_proj.group(x, rows, self.k_proj, self.v_proj)
        return qg.view(x.shape[0], self.n_heads, 2 * self.head_dim), k, v

    def core(self, qg, k, v, pos0, cos_sin, lc: LayerCache, rows: bool, fused: bool) -> torch.Tensor:
        """One sequence's attention output [T, Hq, D]; writes its k, v into its cache."""
        t, d = qg.shape[0], self.head_dim
        if fused:
            from ..kernels.attention import fused as af
            q = af.qk_norm_rope_write_triton(qg, k.view(t, self.n_kv, d), v.view(t, self.n_kv, d),
                                             self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                             *cos_sin, lc.k, lc.v, pos0, table=isinstance(cos_sin, RopeTable),
                                             blocks=lc.blocks)
            return self.attend(q, lc, pos0, rows)
        q = apply_rope(self.q_norm(qg[..., :d], rows), *cos_sin)
        k = apply_rope(self.k_norm(k.view(t, self.n_kv, d), rows), *cos_sin)
        ka.kv_write(lc, pos0, k, v.view(t, self.n_kv, d))
        return self.attend(q, lc, pos0, rows).to(qg.dtype)

    def out(self, o: torch.Tensor, qg: torch.Tensor, rows: bool, fused: bool) -> torch.Tensor:
        """o_proj(o * sigmoid(gate))."""
        if fused:
            from ..kernels.attention import fused as af
            return self.o_proj(af.out_gate_triton(o, qg), rows)
        t, d = qg.shape[0], self.head_dim
        o = o.reshape(t, -1) * self.rowmap(lanes.sigmoid, rows, qg[..., d:].reshape(t, -1))
        return self.o_proj(o, rows)

    def attend(self, q: torch.Tensor, lc: LayerCache, pos0, rows: bool) -> torch.Tensor:
        if rows:
            return ka.attention_rows(q, lc.k, lc.v, pos0, self.scale, lc.k_scale, lc.v_scale, lc.blocks)
        return ka.attention_prefill(q, lc.k, lc.v, pos0, self.scale, lc.k_scale, lc.v_scale, q_block=self.q_block,
                                    blocks=lc.blocks)


def rows_pack(segs: Segments, device: torch.device) -> ka.RowsPack:
    """The attention tables of a packed forward's sequences, made by its first attention layer
    (once: a packed graph's warm-up makes them before its capture), with this forward's positions."""
    pack = segs.attn_pack
    if pack is None:
        pack = segs.attn_pack = ka.RowsPack(segs.spans, device)
    pack.at(segs.pos0s, segs.cos_sins)
    return pack


def fuses(mod: nn.Module, x: torch.Tensor) -> bool:
    """Whether a fused layer (or the MTP head) runs its Triton kernels: on CUDA, unless its `fused`
    says otherwise (a CPU test sets True: the interpreter)."""
    return x.is_cuda if mod.fused is None else mod.fused


class FusedGatedAttention(GatedAttention):
    fused: bool | None = None     # None: on CUDA (`fuses`)

    def fused_rows(self, x, cos_sin, lc, rows):
        table = isinstance(cos_sin, RopeTable)
        if (rows or table) and lc.k_scale is None and fuses(self, x):
            return True
        if table:
            raise ValueError("GatedAttention: a rotary table is read by the fused q/k kernel only")
        return False

    def q8_rows(self, x, lc):
        return lc.k_scale is not None and fuses(self, x)
