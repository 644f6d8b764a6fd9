"""Causal grouped-query attention over a position-addressed KV cache (k, v [max_seq, n_kv, D], row p
holds position p; a row reads keys 0..its own position, so rejected drafts' rows are never read),
contiguous or paged (a pool's rows through the sequence's block table: paged.py).
Decode / verify rows: kernel.py on CUDA (several sequences' rows in one launch: multi.py; device
functions it shares with fused.py: device.py); the Q8 cache: q8.py; references: ref.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .multi import RowsPack
from .paged import BLOCK, gather
from .q8 import (Q8_GROUP, Q8_KV, Q8_PAD, dequantize_q8, kv_write, q8_group, q8_value_cache,
                 quantize_q8)
from .ref import _dequant_prefix, attention_prefill_ref, attention_rows_q8_ref, attention_rows_ref

__all__ = ["BLOCK", "KERNEL_HEAD_DIMS", "gather", "Q8_GROUP", "Q8_KV", "Q8_PAD", "attention_prefill", "attention_prefill_blocks",
           "attention_prefill_fused", "attention_prefill_ref", "attention_rows", "attention_rows_q8_ref",
           "attention_rows_multi", "attention_rows_ref", "dequantize_q8", "kv_write", "q8_group", "q8_value_cache", "quantize_q8", "RowsPack"]


KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def _use_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.shape[-1] in KERNEL_HEAD_DIMS


def attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int, scale: float,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode / verify rows (contract of attention_rows_ref); the Triton kernel on CUDA. `blocks`:
    a paged cache (the references read its rows gathered: the same values in the same order)."""
    if _use_kernel(q):
        from .kernel import attention_rows_triton
        return attention_rows_triton(q, k_cache, v_cache, pos0, scale, k_scale, v_scale, blocks=blocks)
    if blocks is not None:
        n = int(pos0) + q.shape[0]
        k_cache, v_cache, k_scale, v_scale = (gather(x, blocks, n) for x in (k_cache, v_cache, k_scale, v_scale))
    if k_scale is not None:
        return attention_rows_q8_ref(q, k_cache, v_cache, pos0, scale, k_scale, v_scale)
    return attention_rows_ref(q, k_cache, v_cache, pos0, scale)


def attention_rows_multi(q: torch.Tensor, lcs: list, pack: RowsPack, scale: float) -> torch.Tensor:
    """attention_rows for several sequences' rows (pack.spans of q, each over its layer cache in
    `lcs` at its position in `pack`): one launch per kernel on CUDA, each sequence's rows the bits
    of its own call; elsewhere each sequence's attention_rows, concatenated."""
    first = lcs[0]
    if _use_kernel(q):
        from .kernel import attention_rows_triton
        return attention_rows_triton(q, first.k, first.v, None, scale, first.k_scale, first.v_scale,
                                     multi=pack.launch(lcs), blocks=getattr(first, "blocks", None))
    outs = [attention_rows(q[a:b], lc.k, lc.v, p, scale, lc.k_scale, lc.v_scale, getattr(lc, "blocks", None))
            for (a, b), p, lc in zip(pack.spans, pack.pos0s, lcs)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attention_prefill_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            pos0: int, scale: float) -> torch.Tensor:
    """Contract of attention_prefill_ref in the cache's dtype through one fused SDPA call: causal
    aligned to the bottom right (query row t sees keys 0..pos0+t) and grouped KV heads read in
    place, so no mask or repeated KV is built (on CUDA in bf16: the flash kernel, tensor cores).
    Prefill numerics may differ from the rows path: decode and verify do not use it."""
    from torch.nn.attention.bias import causal_lower_right

    t, n = q.shape[0], pos0 + q.shape[0]
    qh = q.to(k_cache.dtype).transpose(0, 1).unsqueeze(0)               # [1, Hq, T, D]
    kh = k_cache[:n].transpose(0, 1).unsqueeze(0)                      # [1, Hkv, n, D]
    vh = v_cache[:n].transpose(0, 1).unsqueeze(0)
    gqa = kh.shape[1] != qh.shape[1]
    if gqa and q.is_cuda and not _flash_takes(qh, kh, vh):    # no grouped heads in this flash build
        rep = qh.shape[1] // kh.shape[1]
        kh, vh, gqa = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1), False
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, n), scale=scale,
                                         enable_gqa=gqa)
    return out[0].transpose(0, 1).float()


def attention_prefill_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int,
                             scale: float, q_block: int) -> torch.Tensor:
    """attention_prefill_fused on blocks of q_block query heads with their KV heads, each block's
    inputs contiguous: every call has the same shape on every tensor-parallel degree."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    rep = hq // hkv
    if hq % q_block or not (rep % q_block == 0 or q_block % rep == 0):
        q_block = 1
    n = pos0 + q.shape[0]
    outs = []
    for h0 in range(0, hq, q_block):
        k0, k1 = h0 // rep, (h0 + q_block - 1) // rep + 1
        outs.append(attention_prefill_fused(q[:, h0:h0 + q_block].contiguous(), k_cache[:n, k0:k1].contiguous(),
                                            v_cache[:n, k0:k1].contiguous(), pos0, scale))
    return torch.cat(outs, dim=1)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the CUDA flash kernel accepts these grouped-head inputs as they are."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True))


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int, scale: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      q_block: int | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill rows (contract of attention_prefill_ref); a Q8 cache is dequantized for the rows read.
    A 16-bit cache on CUDA takes the fused path (the float32 reference at 33k positions would run
    without tensor cores). `q_block` (canonical mode, kernels/splitk head_block): the fused call
    runs on blocks of that many query heads, so a tensor-parallel rank's heads see the same kernel
    choice as the whole model's. `blocks`: a paged cache, whose rows 0..pos0+T-1 are gathered into one
    contiguous tensor first (the tensor a contiguous cache's slice is: the same bits)."""
    n = pos0 + q.shape[0]
    if blocks is not None:
        k_cache, v_cache, k_scale, v_scale = (gather(x, blocks, n) for x in (k_cache, v_cache, k_scale, v_scale))
    if q.is_cuda and k_scale is None and k_cache.dtype in (torch.bfloat16, torch.float16):
        if q_block is not None and q_block < q.shape[1]:
            return attention_prefill_blocks(q, k_cache, v_cache, pos0, scale, q_block)
        return attention_prefill_fused(q, k_cache, v_cache, pos0, scale)
    return attention_prefill_ref(q, _dequant_prefix(k_cache, k_scale, n), _dequant_prefix(v_cache, v_scale, n),
                                 pos0, scale)
