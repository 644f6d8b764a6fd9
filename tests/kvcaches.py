"""One sequence's attention layer cache with random contents, for the attention kernel tests
(tests/kernels/test_attention_multi.py, test_paged.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from specfire.kernels import attention as A


def layer_cache(kind: str, hkv: int, d: int, gen: torch.Generator, n: int) -> SimpleNamespace:
    """n positions: 'bf' a 16-bit-style (float32) cache, 'q8g' grouped Q8 scales, 'q8t' the Q8
    cache's own layout (one scale per position and head, values key-minor)."""
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    if kind == "bf":
        return SimpleNamespace(k=k, v=v, k_scale=None, v_scale=None)
    if kind == "q8g":
        (kq, ks), (vq, vs) = A.quantize_q8(k, 16), A.quantize_q8(v, 16)
        return SimpleNamespace(k=kq, v=vq, k_scale=ks, v_scale=vs)
    (kq, ks), (vq, vs) = A.quantize_q8(k * 3), A.quantize_q8(v)
    vc = A.q8_value_cache(n, hkv, d, "cpu")
    vc.copy_(vq)
    return SimpleNamespace(k=kq, v=vc, k_scale=ks, v_scale=vs)
