"""The draft vocabulary's row-prefix weights (kernels/gemv vocab_rows) through the GPU kernels
(TRITON_INTERPRET=1): the first n rows of a bf16/fp32 weight and of a 4-bit weight (64-row tiles
and rows, n inside a tile) give the whole matrix's first n outputs, read from the same storage."""

import pytest
import torch

from specfire.kernels.gemv import linear_prefix, vocab_rows
from specfire.kernels.q4 import QuantWeight
from specfire.kernels.gemv.kernel import gemv, gemv_config
from specfire.kernels.q4.gemv import Q4Config, q4_gemv


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 37, 64, 100])
def test_dense_prefix_is_a_view_with_the_whole_products_first_columns(n):
    w = torch.randn(150, 96, generator=_g(n))
    x = torch.randn(3, 96, generator=_g(1))
    v = vocab_rows(w, n)
    assert v.shape == (n, 96) and v.data_ptr() == w.data_ptr()
    cfg = gemv_config(150, 96)
    assert torch.equal(gemv(x, v, cfg), gemv(x, w, cfg)[:, :n])
    assert vocab_rows(w, 150) is w and vocab_rows(w, 400) is w


@pytest.mark.parametrize("tile,n", [(64, 37), (64, 64), (64, 100), (0, 37), (0, 101)])
def test_q4_prefix_shares_the_codes_and_gives_the_first_rows(tile, n):
    made = QuantWeight.quantize(torch.randn(150, 256, generator=_g(7)), 64)
    qw = QuantWeight(made.qweight, made.scales_t, made.zeros_t, False, torch.float32, tile)
    p = vocab_rows(qw, n)
    assert p.shape == (n, 256) and p.tile == tile
    assert p.qtiled.data_ptr() == qw.qtiled.data_ptr()                 # the codes: a view, no copy
    assert p.qtiled.shape[0] == (-(-n // tile) if tile else n)         # only the tiles holding rows < n
    assert vocab_rows(qw, n) is p                                      # built once, kept on the weight
    x = torch.randn(3, 256, generator=_g(8))
    for cfg in (Q4Config(16), Q4Config(32, split_k=2), Q4Config(16, split_k=2, wa=True, rows=8)):
        assert torch.equal(q4_gemv(x, p, cfg), q4_gemv(x, qw, cfg)[:, :n]), cfg
    ref = x @ qw.dequantize()[:n].t()
    got = linear_prefix(x, qw, n)                                      # CPU tensors: the reference path
    assert got.shape == (3, n) and float((got - ref).norm() / ref.norm()) < 1e-5
