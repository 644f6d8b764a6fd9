"""The CUDA-graph form of the rows forward reads the position from a device tensor. On the CPU
(attention kernel under TRITON_INTERPRET=1) check that this form gives exactly the int form: the
attention kernel over the whole cache with the position loaded from memory, and the KV write."""

import pytest
import torch

from specfire.model.qwen35 import LayerCache, positions
from specfire.kernels import attention as A
from specfire.kernels.attention.kernel import attention_rows_triton

SMALL = dict(block_m=16, split=32, block_n=16)


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("rows,pos0", [(1, 0), (3, 37), (4, 70)])
def test_position_tensor_equals_int(q8, rows, pos0):
    gen = torch.Generator().manual_seed(rows * 100 + pos0)
    n, hq, hkv, d = 101, 6, 2, 32      # cache longer than the rows' reach: spans past them are skipped
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    ks = vs = None
    if q8:   # the cache's layout (values key-minor): the per-token Q8 kernel
        (k, ks), (vq, vs) = A.quantize_q8(k), A.quantize_q8(v)
        v = A.q8_value_cache(n, hkv, d, "cpu")
        v.copy_(vq)
    q = torch.randn(rows, hq, d, generator=gen)
    a = attention_rows_triton(q, k, v, pos0, 0.17, ks, vs, **SMALL)
    b = attention_rows_triton(q, k, v, torch.tensor([pos0]), 0.17, ks, vs, **SMALL)
    assert torch.equal(a, b)


@pytest.mark.parametrize("q8", [False, True])
def test_kv_write_position_tensor(q8):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(3, 2, 32, generator=gen)
    v = torch.randn(3, 2, 32, generator=gen)

    def cache():
        dt = A.Q8_KV if q8 else torch.float32
        lc = LayerCache(k=torch.zeros(16, 2, 32, dtype=dt), v=torch.zeros(16, 2, 32, dtype=dt))
        if q8:
            lc.k_scale = torch.zeros(16, 2, 1, dtype=torch.float16)
            lc.v_scale = torch.zeros(16, 2, 1, dtype=torch.float16)
        return lc

    a, b = cache(), cache()
    A.kv_write(a, 5, k, v)
    A.kv_write(b, torch.tensor([5]), k, v)
    for x, y in ((a.k, b.k), (a.v, b.v), (a.k_scale, b.k_scale), (a.v_scale, b.v_scale)):
        assert (x is None and y is None) or torch.equal(x, y)
    assert torch.equal(positions(torch.tensor([7]), 3, torch.device("cpu")), positions(7, 3, torch.device("cpu")))
