"""Causal grouped-query attention over a position-addressed KV cache.

Cache layout per layer: k, v [max_seq, n_kv, head_dim]; row p holds position p. Query rows sit at
consecutive positions pos0 .. pos0+R-1 and read keys 0 .. their own position, so rows past the
committed length (rejected drafts) are never read and are simply overwritten later.

Q8 cache (kv dtype `Q8_KV`): k, v hold int8 values and k_scale, v_scale [max_seq, n_kv, D/G]
float16 hold one scale per group of G elements, quantized symmetrically (absmax/127) when a row is
written, so a row's values never change after writing. The cache uses G = D (one scale per position
and KV head: the kernel scales scores and probabilities instead of elements) and stores values
key-minor (`q8_value_cache`); grouped scales (G = 32) remain readable by the kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Q8_KV = torch.int8          # the kv dtype that selects the Q8 cache layout
Q8_GROUP = 32               # the grouped format's group (still read by the kernels)
Q8_PAD = 64                 # key-minor value storage is a whole number of kernel key blocks


def q8_group(head_dim: int, group: int | None = None) -> int:
    """Elements per Q8 scale: the whole head (the cache's format) unless `group` is given."""
    g = head_dim if group is None else min(group, head_dim)
    if head_dim % g:
        raise ValueError(f"Q8 KV cache needs head_dim divisible by {g}, got head_dim={head_dim}")
    return g


def q8_value_cache(max_seq: int, n_kv: int, head_dim: int, device) -> torch.Tensor:
    """Zeroed int8 value cache [max_seq, n_kv, D] stored key-minor ([n_kv, D, keys], keys padded to
    Q8_PAD): the p.V MMA reads pairs of adjacent keys, so the kernel loads them as they lie."""
    pad = -(-max_seq // Q8_PAD) * Q8_PAD
    return torch.zeros(n_kv, head_dim, pad, device=device, dtype=Q8_KV)[:, :, :max_seq].permute(2, 0, 1)


def quantize_q8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float16 scales [..., D/G]). Divides by the stored (fp16) scale,
    so dequantisation reproduces exactly what the rounding saw."""
    d = x.shape[-1]
    g = q8_group(d, group)
    xg = x.float().reshape(*x.shape[:-1], d // g, g)
    scale = (xg.abs().amax(-1) / 127.0).to(torch.float16)
    div = scale.float().masked_fill(scale == 0, 1.0)
    q = torch.round(xg / div[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_q8, float32 (exact: int8 x fp16 fits a float32 mantissa)."""
    g = q.shape[-1] // scale.shape[-1]
    return (q.float().reshape(*scale.shape, g) * scale.float()[..., None]).reshape(q.shape)


def kv_write(lc, pos0, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store rows k, v [T, n_kv, D] at positions pos0.. of a layer cache (quantizing for Q8).
    `pos0` is an int, or a one-element int64 device tensor (CUDA-graph capturable)."""
    t = k.shape[0]
    if lc.k.dtype == Q8_KV:
        kq, ks = quantize_q8(k)
        vq, vs = quantize_q8(v)
        pairs = ((lc.k, kq), (lc.v, vq), (lc.k_scale, ks), (lc.v_scale, vs))
    else:
        pairs = ((lc.k, k.to(lc.k.dtype)), (lc.v, v.to(lc.v.dtype)))
    if isinstance(pos0, torch.Tensor):
        idx = pos0 + torch.arange(t, device=k.device)
        for dst, src in pairs:
            dst.index_copy_(0, idx, src)
    else:
        for dst, src in pairs:
            dst[pos0:pos0 + t] = src


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


KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def _use_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.shape[-1] in KERNEL_HEAD_DIMS


def attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int, scale: float,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode / verify rows (contract of attention_rows_ref); the Triton kernel on CUDA."""
    if _use_kernel(q):
        from .attention_kernels import attention_rows_triton
        return attention_rows_triton(q, k_cache, v_cache, pos0, scale, k_scale, v_scale)
    if k_scale is not None:
        return attention_rows_q8_ref(q, k_cache, v_cache, pos0, scale, k_scale, v_scale)
    return attention_rows_ref(q, k_cache, v_cache, pos0, scale)


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
                      q_block: int | None = None) -> torch.Tensor:
    """Prefill rows (contract of attention_prefill_ref); a Q8 cache is dequantized for the rows read.
    A 16-bit cache on CUDA takes the fused path (the float32 reference at 33k positions would run
    without tensor cores). `q_block` (canonical mode, ops/splitk.py head_block): the fused call
    runs on blocks of that many query heads, so a tensor-parallel rank's heads see the same kernel
    choice as the whole model's."""
    n = pos0 + q.shape[0]
    if q.is_cuda and k_scale is None and k_cache.dtype in (torch.bfloat16, torch.float16):
        if q_block is not None and q_block < q.shape[1]:
            return attention_prefill_blocks(q, k_cache, v_cache, pos0, scale, q_block)
        return attention_prefill_fused(q, k_cache, v_cache, pos0, scale)
    return attention_prefill_ref(q, _dequant_prefix(k_cache, k_scale, n), _dequant_prefix(v_cache, v_scale, n),
                                 pos0, scale)
