"""Gated DeltaNet: linear attention with the gated delta rule (the math: kernels/gdn).

`GatedDeltaNet` computes the layer with the kernels of kernels/gdn and the formulation of
kernels/gdn/ref.py that training shares. Its variants: `FusedGatedDeltaNet` (CUDA: a decode /
verify is one kernel from the conv to the gated norm, kernels/gdn/fused.py, for convs of up to
FUSED_MAX_CONV taps) and `CpuGatedDeltaNet` (one CPU device: the gates with -exp(A_log) kept,
the q / k norms as two rms_norm calls).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import gdn as kg
from ..kernels import xsum
from .attention import fuses
from .norm import cached

if TYPE_CHECKING:
    from ..model.state import LayerCache, Segments
    from . import Target


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, target: Target):
        super().__init__()
        share = target.share(cfg)
        self.hk, self.hv = share.n_k_heads, share.n_v_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h, vd = cfg.hidden_size, cfg.linear_num_value_heads * self.dv
        self.in_proj_qkv = target.column(h, self.conv_dim, cfg.conv_dim)
        self.in_proj_z = target.column(h, self.value_dim, vd)
        self.in_proj_b = target.column(h, self.hv, cfg.linear_num_value_heads)
        self.in_proj_a = target.column(h, self.hv, cfg.linear_num_value_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, cfg.linear_conv_kernel_dim), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = target.gated_norm(self.dv, cfg.rms_norm_eps)
        self.out_proj = target.row(vd, h)
        self.rowmap = target.rowmap
        self.exact = target.exact

    def forward(self, x: torch.Tensor, lc: LayerCache, rows: bool) -> torch.Tensor:
        """x [T, H] -> [T, H]. Rows mode logs each row's state update in `lc` (the live state is
        committed later); prefill advances the live state and conv window."""
        f = self.fused_rows(x, rows)
        qkv, z, b, a = self.project(x, rows)
        return self.out(self.core(qkv, z, b, a, lc, rows, f), rows)

    def packed(self, x: torch.Tensor, segs: Segments, lcs: list[LayerCache]) -> torch.Tensor:
        """Several sequences' rows (segs.spans of x) in one pass over the weights: the projections
        over all rows, each sequence's conv, recurrence and log over its own state (fused: one
        launch for all of them, the kernel a lone verify launches with one sequence)."""
        f = self.fused_rows(x, True)
        qkv, z, b, a = self.project(x, True)
        if f and self.booked(lcs):      # one launch for every sequence
            o = self.fused_core(qkv, z, b, a, lcs, segs.spans, segs.gdn_tables)
        else:
            o = segs.cat([self.core(qkv[i:j], z[i:j], b[i:j], a[i:j], lc, True, f)
                          for (i, j), lc in zip(segs.spans, lcs)])
        return self.out(o, True)

    def fused_rows(self, x: torch.Tensor, rows: bool) -> bool:
        """Whether the fused decode kernel runs (FusedGatedDeltaNet)."""
        return False

    def project(self, x: torch.Tensor, rows: bool):
        """qkv [T, conv_dim], z [T, value_dim], b, a [T, Hv]."""
        return self.in_proj_qkv.group(x, rows, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def out(self, o: torch.Tensor, rows: bool) -> torch.Tensor:
        """out_proj of the gated norm's output [T, Hv, dv]."""
        return self.out_proj(xsum.reshaped(o, (o.shape[0], self.value_dim)), rows)   # the norm's group sums kept

    def core(self, qkv, z, b, a, lc: LayerCache, rows: bool, fused: bool) -> torch.Tensor:
        """One sequence's gated-norm output [T, Hv, dv] (x's dtype) over its state."""
        t = qkv.shape[0]
        if fused and self.booked([lc]):
            return self.fused_core(qkv, z, b, a, [lc], [(0, t)], lc.book.gdn_tables)
        if fused:                       # a state without a book (SequenceState.allocate makes one)
            from ..kernels.gdn.fused import gdn_decode_triton
            o, log, full = gdn_decode_triton(qkv, a, b, lc.conv, self.conv1d.weight[:, 0, :], self.A_log, self.dt_bias,
                                             lc.rec, self.hk, self.dk, self.dv, z, self.norm.weight, self.norm.eps,
                                             out=lc.log_buffers(t))
            lc.set_log(*log, full)
            return o
        conv, full = self.rowmap.conv(qkv.float(), lc.conv, self.conv1d.weight[:, 0, :], rows)
        q, k, v = self.heads(conv)
        beta, g = self.gates(b, a, rows)
        q, k = self.qk_norm(q, k, rows)
        if rows:
            rep = self.hv // self.hk
            if rep > 1:  # value head j reads key head j // rep
                q = q.repeat_interleave(rep, dim=1)
                k = k.repeat_interleave(rep, dim=1)
            o, (delta, dec) = kg.gdn_rows(q, k, v, g, beta, lc.rec, log=True)
            lc.set_log(k, delta, dec, full)
        else:   # key heads grouped: the chunked form maps them (or its GPU library reads them in place)
            o, s = kg.gdn_chunked(q, k, v, g, beta, lc.rec, canonical=self.exact)
            lc.rec.copy_(s)
            lc.conv.copy_(full[-lc.conv.shape[0]:])
        return self.norm(o.to(z.dtype), z.view(t, self.hv, self.dv), rows)                # [T, Hv, dv]

    def booked(self, lcs: list[LayerCache]) -> bool:
        """Whether the fused kernel can take these caches' states from their books (RowsBook): each
        its own book, this layer at one slot of all of them, the books of this layer's shapes."""
        slot = lcs[0].slot
        return len({id(lc.book) for lc in lcs}) == len(lcs) and all(
            lc.book is not None and lc.slot == slot and lc.book.rec.shape[1:] == (self.hv, self.dk, self.dv)
            and lc.book.conv.shape[2] == self.conv_dim for lc in lcs)

    def fused_core(self, qkv, z, b, a, lcs: list[LayerCache], spans: list[tuple[int, int]],
                   tables: dict) -> torch.Tensor:
        """Every sequence's rows (spans of qkv) through one fused launch (kernels/gdn/fused.py
        gdn_rows_triton) over their books at this layer's slot; their table is made on the first
        call and kept in `tables` (a Segments' or a book's: as long as a graph replaying it)."""
        from ..kernels.gdn import fused as gf
        key = (tuple(spans), tuple(id(lc.book) for lc in lcs))
        table = tables.get(key)
        if table is None:
            bufs = [(lc.book.rec, lc.book.conv, *lc.book.log(j - i)) for lc, (i, j) in zip(lcs, spans)]
            table = tables[key] = gf.seq_table(spans, bufs, qkv.device)
        o = gf.gdn_rows_triton(qkv, a, b, self.conv1d.weight[:, 0, :], self.A_log, self.dt_bias, self.hk, self.dk,
                               self.dv, table, lcs[0].slot, z, self.norm.weight, self.norm.eps)
        for lc, (i, j) in zip(lcs, spans):
            lc.set_log(*lc.log_buffers(j - i))       # the launch wrote the book's buffers: no copy
        return o

    def heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [..., C] -> q, k [..., Hk, dk], v [..., Hv, dv]."""
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = conv.shape[:-1]
        return q.reshape(*lead, self.hk, self.dk), k.reshape(*lead, self.hk, self.dk), v.reshape(*lead, self.hv, self.dv)

    def gates(self, b: torch.Tensor, a: torch.Tensor, rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """beta and the log decay g [..., Hv] (kernels/gdn gates_ref)."""
        return self.rowmap.each(lambda b, a: kg.gates_ref(b, a, self.A_log, self.dt_bias), rows, b, a)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor, rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised q (scaled by dk^-1/2) and k."""
        return self.rowmap.each(lambda q, k: (kg.l2norm_ref(q, self.dk ** -0.5), kg.l2norm_ref(k)), rows, q, k)


class FusedGatedDeltaNet(GatedDeltaNet):
    fused: bool | None = None     # None: on CUDA (`fuses`)

    def fused_rows(self, x, rows):
        return rows and fuses(self, x) and self.conv1d.weight.shape[-1] <= kg.FUSED_MAX_CONV


class CpuGatedDeltaNet(GatedDeltaNet):
    def gates(self, b, a, rows=False):
        neg_a = cached(self.A_log, "_specfire_nega", lambda t: -torch.exp(t.float()))
        dt_bias = self.dt_bias
        return self.rowmap.each(lambda b, a: (torch.sigmoid(b.float()), neg_a * F.softplus(a.float() + dt_bias.float())),
                                rows, b, a)

    def qk_norm(self, q, k, rows=False):
        """x rsqrt(sum x^2 + 1e-6) is rms_norm with eps 1e-6/dk times dk^-1/2, folded into its weight."""
        dk = self.dk
        wq, wk = _const(dk, 1.0 / dk), _const(dk, dk ** -0.5)
        return self.rowmap(lambda q, k: (F.rms_norm(q, (dk,), wq, 1e-6 / dk), F.rms_norm(k, (dk,), wk, 1e-6 / dk)),
                           rows, q, k)


_CONSTS: dict[tuple[int, float], torch.Tensor] = {}


def _const(n: int, v: float) -> torch.Tensor:
    """A float32 CPU vector of n copies of v (made once)."""
    t = _CONSTS.get((n, v))
    if t is None:
        t = _CONSTS[(n, v)] = torch.full((n,), v, dtype=torch.float32)
    return t
