"""Causal grouped-query attention over a position-addressed KV cache.

Cache layout per layer: k, v [max_seq, n_kv, head_dim]; row p holds position p. Query rows sit at
consecutive positions pos0 .. pos0+R-1 and read keys 0 .. their own position, so rows past the
committed length (rejected drafts) are never read and are simply overwritten later.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


attention_prefill = attention_prefill_ref
attention_rows = attention_rows_ref
