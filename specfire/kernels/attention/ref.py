"""PyTorch references of causal grouped-query attention over the position-addressed KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .q8 import dequantize_q8


def _dequant_prefix(cache: torch.Tensor, scale: torch.Tensor | None, n: int) -> torch.Tensor:
    return cache[:n] if scale is None else dequantize_q8(cache[:n], scale[:n])


def attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          pos0: int, scale: float) -> torch.Tensor:
    """Many rows at once (prefill). q [T, Hq, D] at positions pos0..pos0+T-1 -> [T, Hq, D] float32."""
    t, hq, d = q.shape
    n = pos0 + t
    k = k_cache[:n].float()
    v = v_cache[:n].float()
    rep = hq // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, n, D]
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    qpos = torch.arange(pos0, n, device=q.device)[:, None]
    mask = torch.arange(n, device=q.device)[None, :] <= qpos  # [T, n]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def attention_rows_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       pos0: int, scale: float) -> torch.Tensor:
    """Few rows (decode, verify), each computed exactly as a one-row decode would be: row r reads
    keys 0..pos0+r with the same reduction shape whatever R is. q [R, Hq, D] -> [R, Hq, D] float32."""
    r_rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    outs = []
    for r in range(r_rows):
        n = pos0 + r + 1
        k = k_cache[:n].float().permute(1, 2, 0)                    # [Hkv, D, n]
        v = v_cache[:n].float().transpose(0, 1)                     # [Hkv, n, D]
        qr = q[r].float().view(hkv, rep, d)                         # [Hkv, rep, D]
        s = torch.bmm(qr, k) * scale                                # [Hkv, rep, n]
        p = torch.softmax(s, dim=-1)
        outs.append(torch.bmm(p, v).reshape(hq, d))
    return torch.stack(outs)


def attention_rows_q8_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int,
                          scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """Reference for a Q8 cache: dequantize the rows read, then attention_rows_ref."""
    n = pos0 + q.shape[0]
    return attention_rows_ref(q, dequantize_q8(k_cache[:n], k_scale[:n]),
                              dequantize_q8(v_cache[:n], v_scale[:n]), pos0, scale)
