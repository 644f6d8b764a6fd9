"""What one sequence carries between forwards of the trunk: per-layer KV rows (attention) or conv
window + recurrent state with the per-row capture that rollback installs (Gated DeltaNet)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..config import FULL, ModelConfig
from ..ops import attention as attn_ops

# A copying commit (under CUDA graphs) as one multi-tensor copy over every GDN layer instead of two
# copy kernels a layer; SPECFIRE_COMMIT_FOREACH=0 keeps the per-layer copies (bench/cycle_profile.py).
COMMIT_FOREACH = os.environ.get("SPECFIRE_COMMIT_FOREACH", "1") != "0"


@dataclass
class LayerCache:
    """State of one layer for one sequence. Attention: k, v [max_seq, n_kv, D] (with a Q8 cache,
    int8 plus k_scale, v_scale [max_seq, n_kv, 1] float16, v stored key-minor under that view; see
    ops/attention.py). GDN: conv window [K-1, conv_dim] and recurrent state [Hv, dk, dv], both float32, plus the per-row capture of
    the last rows-mode forward (conv `full` [K-1+R, C] and states [R, Hv, dk, dv])."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    rec: torch.Tensor | None = None
    cap_conv: torch.Tensor | None = None
    cap_rec: torch.Tensor | None = None


@dataclass
class SequenceState:
    """Everything one sequence carries between forwards. Attention rows are addressed by position,
    so rollback of attention is free; GDN layers roll back through the per-row capture."""

    layers: list[LayerCache] = field(default_factory=list)
    max_seq: int = 0

    @classmethod
    def allocate(cls, cfg: ModelConfig, n_layers_types: tuple[str, ...], max_seq: int,
                 device: torch.device, kv_dtype: torch.dtype,
                 n_kv: int | None = None, n_v_heads: int | None = None, conv_dim: int | None = None) -> "SequenceState":
        n_kv = n_kv if n_kv is not None else cfg.num_key_value_heads
        hv = n_v_heads if n_v_heads is not None else cfg.linear_num_value_heads
        cd = conv_dim if conv_dim is not None else cfg.conv_dim
        layers = []
        for t in n_layers_types:
            if t == FULL:
                lc = LayerCache(k=torch.zeros(max_seq, n_kv, cfg.head_dim, device=device, dtype=kv_dtype))
                if kv_dtype == attn_ops.Q8_KV:
                    lc.v = attn_ops.q8_value_cache(max_seq, n_kv, cfg.head_dim, device)
                    ns = cfg.head_dim // attn_ops.q8_group(cfg.head_dim)
                    lc.k_scale = torch.zeros(max_seq, n_kv, ns, device=device, dtype=torch.float16)
                    lc.v_scale = torch.zeros(max_seq, n_kv, ns, device=device, dtype=torch.float16)
                else:
                    lc.v = torch.zeros(max_seq, n_kv, cfg.head_dim, device=device, dtype=kv_dtype)
                layers.append(lc)
            else:
                layers.append(LayerCache(
                    conv=torch.zeros(cfg.linear_conv_kernel_dim - 1, cd, device=device, dtype=torch.float32),
                    rec=torch.zeros(hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                    device=device, dtype=torch.float32)))
        return cls(layers=layers, max_seq=max_seq)

    @torch.inference_mode()
    def reset(self) -> None:
        """Start a new sequence: zero the recurrent state. KV rows need no clearing (reads are
        bounded by position). In inference mode: after an eager commit the live state is a
        verify's capture, an inference tensor."""
        for lc in self.layers:
            if lc.rec is not None:
                lc.rec.zero_()
                lc.conv.zero_()
                lc.cap_conv = lc.cap_rec = None

    @torch.inference_mode()
    def commit(self, n: int, in_place: bool = True) -> None:
        """Make the recurrent state that after row n of the last rows-mode forward. `in_place`
        False: the live state becomes row n's capture itself (no copy; an eager forward's captures
        are fresh tensors), only where nothing keeps the live state's address (no captured graph)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for lc in self._gdn_captured():
            kk = lc.conv.shape[0] + 1
            rec, conv = lc.cap_rec[n], lc.cap_conv[n + 1:n + kk]
            if not in_place and _same(rec, lc.rec) and _same(conv, lc.conv):
                lc.rec, lc.conv = rec, conv
            else:
                dst += [lc.rec, lc.conv]
                src += [rec, conv]
            lc.cap_conv = lc.cap_rec = None
        if dst and COMMIT_FOREACH:
            torch._foreach_copy_(dst, src)
        else:
            for d, s in zip(dst, src):
                d.copy_(s)

    def _gdn_captured(self) -> list[LayerCache]:
        out = [lc for lc in self.layers if lc.rec is not None]
        if any(lc.cap_rec is None for lc in out):
            raise RuntimeError("commit() without a preceding rows-mode forward")
        return out


def _same(new: torch.Tensor, live: torch.Tensor) -> bool:
    """`new` can stand for `live`: same dtype, contiguous (a forward makes its captures from the
    live state: same shape and device)."""
    return new.dtype == live.dtype and new.is_contiguous()
