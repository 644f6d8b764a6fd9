"""The Q8 KV cache (kv dtype `Q8_KV`): k, v hold int8 values and k_scale, v_scale [max_seq, n_kv,
D/G] float16 one scale per group of G elements, quantized symmetrically (absmax/127) when a row is
written, so a row's values never change after writing. The cache uses G = D (one scale per position
and KV head: the kernel scales scores and probabilities instead of elements) and stores values
key-minor (`q8_value_cache`); grouped scales (G = 32) remain readable by the kernels."""
from __future__ import annotations

import torch

from .paged import rows_of

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
    `pos0` is an int, or a one-element int64 device tensor (CUDA-graph capturable). A paged cache
    (`lc.blocks`, kernels/attention/paged.py) takes the rows at its table's pool rows."""
    t = k.shape[0]
    blocks = getattr(lc, "blocks", None)
    if lc.k.dtype == Q8_KV:
        kq, ks = quantize_q8(k)
        vq, vs = quantize_q8(v)
        pairs = ((lc.k, kq), (lc.v, vq), (lc.k_scale, ks), (lc.v_scale, vs))
    else:
        pairs = ((lc.k, k.to(lc.k.dtype)), (lc.v, v.to(lc.v.dtype)))
    if blocks is not None:
        idx = rows_of(blocks, pos0, t)
        for dst, src in pairs:
            dst.index_copy_(0, idx, src)
    elif isinstance(pos0, torch.Tensor):
        idx = pos0 + torch.arange(t, device=k.device)
        for dst, src in pairs:
            dst.index_copy_(0, idx, src)
    else:
        for dst, src in pairs:
            dst[pos0:pos0 + t] = src
