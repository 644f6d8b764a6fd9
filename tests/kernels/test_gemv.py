"""Row-invariant Triton GEMV (under TRITON_INTERPRET=1 on the CPU) against the batched reference."""

import pytest
import torch

from specfire.kernels.gemv import linear, linear_rows_ref
from specfire.kernels.gemv.kernel import GemvConfig, gemv, gemv_config

CASES = [  # (M, N, K, config): odd sizes, masked N and K tails, split-K with a short last split
    (1, 37, 70, GemvConfig(16, 32)),
    (3, 100, 300, GemvConfig(32, 64, split_k=3)),
    (5, 65, 129, GemvConfig(64, 128, split_k=2)),
    (16, 48, 96, None),
]


@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_gemv_matches_reference(m, n, k, cfg):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(gemv(x, w, cfg), linear_rows_ref(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_gemv_row_invariant_bitwise(m, n, k, cfg):
    """Every row of an M-row call equals the one-row call on that row, bit for bit, and so does
    every prefix (the k+1-row verify vs shorter ones)."""
    g = torch.Generator().manual_seed(7 + m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = gemv(x, w, cfg)
    for i in range(m):
        assert torch.equal(gemv(x[i:i + 1], w, cfg)[0], y[i]), f"row {i}"
    assert torch.equal(gemv(x[: max(1, m // 2)], w, cfg), y[: max(1, m // 2)])


@pytest.mark.parametrize("n,k,want", [
    (248320, 5120, GemvConfig(128, 128, 1, 8, 3)),      # lm_head
    (17408, 5120, GemvConfig(64, 128, 1, 8, 3)),        # MLP gate / up
    (8192, 5120, GemvConfig(64, 128, 1, 4, 4)),         # attention q, GDN qkv
    (5120, 17408, GemvConfig(64, 256, 1, 4, 4)),        # MLP down
    (48, 5120, GemvConfig(16, 128, 10, 4, 3)),          # GDN b / a (measured: split-K, one grouped launch)
])
def test_config_table(n, k, want):
    """The launch configuration is the swept table entry for the weight's shape (it takes no row
    count, so every M gets the same one; the bitwise test above checks the M = 16 default)."""
    assert gemv_config(n, k) == want


def test_gemv_many_rows_run_in_16_row_tiles():
    """M > 16 (prefill on CUDA) runs in one launch of 16-row tiles: every row equals its one-row call."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 40, generator=g), torch.randn(21, 40, generator=g)
    y = gemv(x, w, GemvConfig(16, 32))
    for i in (0, 15, 16, 36):
        assert torch.equal(gemv(x[i:i + 1], w, GemvConfig(16, 32))[0], y[i]), f"row {i}"
    torch.testing.assert_close(y, linear_rows_ref(x, w), rtol=1e-5, atol=1e-4)


def test_linear_cpu_rows_path_is_reference():
    """On a CPU mesh rank (`exact`) the rows path is the reference in panels; one CPU device's own
    rows path is row-invariant and close to it."""
    g = torch.Generator().manual_seed(20)
    x, w = torch.randn(3, 20, generator=g), torch.randn(32, 20, generator=g)  # whole panels: the reference itself
    w9 = torch.randn(9, 20, generator=g)                    # a padded tail panel
    assert torch.equal(linear(x, w, rows=True, exact=True), linear_rows_ref(x, w))
    torch.testing.assert_close(linear(x, w9, rows=True, exact=True), linear_rows_ref(x, w9), rtol=1e-6, atol=1e-6)
    for ww in (w, w9):
        y = linear(x, ww, rows=True)
        torch.testing.assert_close(y, linear_rows_ref(x, ww), rtol=1e-5, atol=1e-5)
        assert all(torch.equal(linear(x[i:i + 1], ww, rows=True)[0], y[i]) for i in range(3))


def test_grouped_split_k_equals_separate_split_launches():
    """gemv_group with a split-K config (one launch, the partials added in split order by the last
    program of each tile): each
    output is bit for bit gemv with the same settings on its weight alone (odd N, a masked K tail
    and a short last split), and every row equals its one-row call."""
    from specfire.kernels.gemv.kernel import _LOCKS, gemv_group

    g = torch.Generator().manual_seed(5)
    k = 330
    ws = [torch.randn(n, k, generator=g) for n in (21, 48, 5)]
    x = torch.randn(5, k, generator=g)
    for cfg in (GemvConfig(16, 64, split_k=3, num_warps=1), GemvConfig(32, 128, split_k=2)):
        got = gemv_group(x, ws, [None] * 3, cfg=cfg)          # partials combined in the kernel
        assert all(int(b.abs().sum()) == 0 for b in _LOCKS.values())   # its counters are back at zero
        for y, w in zip(got, ws):
            assert torch.equal(y, gemv(x, w, cfg))
            torch.testing.assert_close(y, linear_rows_ref(x, w), rtol=1e-5, atol=1e-4)
        for i in (0, 3):
            assert all(torch.equal(a[0], b[i]) for a, b in zip(gemv_group(x[i:i + 1], ws, [None] * 3, cfg=cfg), got))
