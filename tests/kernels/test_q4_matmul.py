"""4-bit products of many rows (kernels/q4/matmul.py) under TRITON_INTERPRET=1 against the PyTorch
reference: the dequantize kernel gives the reference's weight bits, the scratch path its products
(odd sizes, masked row / column / group tails, both code layouts)."""

import pytest
import torch
import torch.nn.functional as F

from specfire.kernels.q4 import QuantWeight
from specfire.kernels.q4.matmul import DQ_DEFAULT, DequantConfig, dequant_config, q4_dequantize, q4_linear_dequant


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _qw(n, k, g, seed, tile=64, had=False):
    qw = QuantWeight.quantize(torch.randn(n, k, generator=_g(seed)), g, had)
    return QuantWeight(qw.qweight, qw.scales_t, qw.zeros_t, had, torch.float32, tile)


@pytest.mark.parametrize("n,k,g,tile,rows,gb", [
    (37, 128, 32, 0, slice(None), 4),          # odd N, rows layout, 4 groups in one program
    (70, 384, 64, 64, slice(5, 67), 4),        # tiles of 64 (N padded), a row slice across tiles, 6 groups: masked tail
    (130, 640, 128, 64, slice(64, 130), 2),    # a slice starting on a tile, 5 groups in programs of 2
    (45, 160, 32, 16, slice(3, 44), 3),        # 16-row tiles, 5 groups in programs of 3
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_equals_reference_bits(n, k, g, tile, rows, gb, dtype):
    qw = _qw(n, k, g, n + k, tile)
    ref = qw.dequantize(rows).to(dtype)
    out = torch.full((ref.numel() + 7,), float("nan"), dtype=dtype)     # a longer buffer, as the scratch is
    w = q4_dequantize(qw, rows, out, dtype, DequantConfig(16, gb, 1))
    assert w.shape == ref.shape and w.dtype == dtype
    assert torch.equal(w, ref)
    assert torch.isnan(out[ref.numel():]).all()                         # nothing written past the rows


def test_dequantize_kernel_default_blocks_and_empty_slice():
    qw = _qw(67, 256, 128, 3)
    assert torch.equal(q4_dequantize(qw, dtype=torch.float32), qw.dequantize())     # 2 programs: 1 group each
    assert torch.equal(q4_dequantize(qw, dtype=torch.float32, cfg=DQ_DEFAULT), qw.dequantize())
    assert q4_dequantize(qw, slice(10, 10), dtype=torch.float32).shape == (0, 256)
    with pytest.raises(ValueError, match="contiguous"):
        q4_dequantize(qw, slice(0, 10, 2))


@pytest.mark.parametrize("limit", [None, 20 * 384, 7 * 384 + 5])
def test_scratch_path_equals_dense_product(limit):
    """Whole, and in chunks of 20 / 7 output rows (the last one short) through one reused buffer.
    A float32 product over K = 384 in another blocking: the tolerance of its rounding (a CPU
    without AVX-512 differed by 1.3e-5 at one element)."""
    qw = _qw(45, 384, 128, 5)
    x = torch.randn(33, 384, generator=_g(6))
    ref = F.linear(x, qw.dequantize())
    y = q4_linear_dequant(x, qw, limit)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_dequant_config_spreads_small_weights():
    """Programs of 4 groups while that leaves enough of them, else fewer groups a program."""
    assert dequant_config(17408, 5120, 128) == DQ_DEFAULT                      # 272 x 10 programs
    assert dequant_config(1024, 5120, 128) == DequantConfig(64, 1, 4)          # 16 x 40: still few, gb 1
    assert dequant_config(2048, 5120, 128) == DequantConfig(64, 2, 4)          # 32 x 10 < 528 <= 32 x 20
    assert dequant_config(5120, 6144, 128) == DQ_DEFAULT                       # 80 x 12
    assert dequant_config(67, 256, 128) == DequantConfig(64, 1, 4)


def test_bad_input_is_a_clear_error():
    qw = _qw(20, 256, 128, 10)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        q4_linear_dequant(torch.randn(3, 255), qw)
