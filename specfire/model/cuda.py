"""One GPU's MTP head: the draft chain's step and the prompt catch-up in fewer launches (kernels/head).

The fc's input (the embedding rows gathered by token id, both norms, the concatenation) is one
kernel, and the rotary comes from a table the fused q/k kernel indexes by position
(layers/attention.py FusedGatedAttention); the values are the modules' path's.
"""
from __future__ import annotations

import torch

from ..kernels import head as kh
from ..kernels.attention import paged
from ..layers.attention import fuses
from .qwen35 import MtpHead, rotary


class FusedMtpHead(MtpHead):
    def step(self, emb, hidden, pos0, state, rows, ids=None, embed_weight=None):
        if not fuses(self, hidden):
            return super().step(emb, hidden, pos0, state, rows, ids, embed_weight)
        x = self.fc(self.fc_input(emb, hidden, rows, ids, embed_weight), rows)
        lc = state.layers[0]
        cos_sin = None
        if lc.k_scale is None and fuses(self.layers[0].self_attn, x):    # the fused q/k kernel reads the table
            cos_sin = kh.rope_table(x.device, self.cfg.rotary_dim, self.cfg.rope_theta, paged.capacity(lc))
        if cos_sin is None:
            cos_sin = rotary(self.target, self.cfg, pos0, x.shape[0], x.device, rows)
        return self.block(x, cos_sin, pos0, state, rows)

    def fc_input(self, emb, hidden, rows, ids=None, embed_weight=None):
        if (emb is None and fuses(self, hidden) and isinstance(embed_weight, torch.Tensor)
                and embed_weight.dtype == hidden.dtype):
            e, hn = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden      # gather + both norms + cat: one launch
            return kh.fc_input(ids, embed_weight, hidden, e.weight, hn.weight, e.eps, hn.eps)
        return super().fc_input(emb, hidden, rows, ids, embed_weight)
