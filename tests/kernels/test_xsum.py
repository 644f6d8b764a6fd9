"""Group sums folded into the kernels that write a 4-bit GEMV's input (kernels/xsum.py), under
TRITON_INTERPRET=1 on the CPU: each producer's sums are those of its written (rounded) output and
row-invariant, and the GEMV handed them agrees with its own sum(x) launch to the sums' rounding."""

import pytest
import torch

from specfire.kernels.attention import fused as attn_fused
from specfire.kernels import xsum
from specfire.kernels.q4 import gemv as tq
from specfire.kernels.small import kernel as ts
from specfire.kernels.norm import kernel as nk
from specfire.kernels.gemv import linear_rows_ref
from specfire.kernels.q4 import QuantWeight, q4_rows


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def fold_on(monkeypatch):
    """On a device where a 4-bit GEMV has run (the producers fold there)."""
    monkeypatch.setattr(xsum, "_CONSUMERS", {"cpu"})


def _sums(y):
    hit = getattr(y, "_specfire_xs", None)
    return None if hit is None else hit[0]


def _check(y, rows_alone=None):
    """y's attached sums: near the reference's (tl.sum's order differs only by rounding), and, given
    rows_alone (the producer's output for each leading row alone), each row's sums those of the
    row made alone (row-invariant)."""
    xs = _sums(y)
    assert xs is not None, "the producer attached no sums"
    ref = xsum.group_sums_ref(y)
    assert xs.dtype == torch.float32 and xs.shape == ref.shape
    torch.testing.assert_close(xs, ref, rtol=1e-5, atol=1e-4)
    if rows_alone is not None:
        per = xs.view(y.shape[0], -1)
        for i, yi in enumerate(rows_alone):
            assert torch.equal(yi, y[i:i + 1]) and torch.equal(_sums(yi), per[i]), f"row {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (3, 384), (5, 640), (2, 3, 256)])   # masked block tails (384, 640)
def test_rms_norm_sums(shape, dtype):
    g = _g(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g) * 0.3
    _check(nk.rms_norm_triton(x, w, 1e-6), [nk.rms_norm_triton(x[i:i + 1], w, 1e-6) for i in range(shape[0])])
    h = torch.randn(shape, generator=g)
    s, y = nk.add_rms_norm_triton(x, h, w, 1e-6)
    _check(y, [nk.add_rms_norm_triton(x[i:i + 1], h[i:i + 1], w, 1e-6)[1] for i in range(shape[0])])
    assert _sums(s) is None                      # the residual feeds no GEMV


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d", [(1, 3, 128), (3, 5, 128), (2, 2, 256)])
def test_gated_norm_sums(t, h, d, dtype):
    g = _g(2)
    x = torch.randn(t, h, d, generator=g).to(dtype)
    z = torch.randn(t, h, d, generator=g).to(dtype)
    nw = torch.randn(d, generator=g).to(dtype)
    y = nk.gated_rms_norm_triton(x, z, nw, 1e-6)
    _check(y, [nk.gated_rms_norm_triton(x[i:i + 1], z[i:i + 1], nw, 1e-6) for i in range(t)])
    y2 = xsum.reshaped(y, (t, h * d))            # what the model hands out_proj
    assert torch.equal(xsum.take(y2, 128), _sums(y).view(t, h * d // 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 128), (3, 1152), (2, 2432)])   # blocks of 1024: a short last block
def test_silu_mul_sums(t, d, dtype):
    g = _g(3)
    a, b = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    _check(ts.silu_mul_triton(a, b), [ts.silu_mul_triton(a[i:i + 1], b[i:i + 1]) for i in range(t)])


@pytest.mark.parametrize("t,hq,d", [(1, 2, 256), (3, 3, 128)])
def test_out_gate_sums(t, hq, d):
    g = _g(4)
    o = torch.randn(t, hq, d, generator=g)
    qg = torch.randn(t, hq, 2 * d, generator=g)
    y = attn_fused.out_gate_triton(o, qg)
    torch.testing.assert_close(y, attn_fused.out_gate_ref(o, qg))
    _check(y, [attn_fused.out_gate_triton(o[i:i + 1], qg[i:i + 1]) for i in range(t)])


def test_no_sums_where_they_cannot_serve():
    g = _g(5)
    w = torch.randn(200, generator=g)
    assert _sums(nk.rms_norm_triton(torch.randn(2, 200, generator=g), w, 1e-6)) is None    # not whole groups
    w = torch.randn(256, generator=g)
    assert _sums(nk.rms_norm_triton(torch.randn(17, 256, generator=g), w, 1e-6)) is None   # a prefill's rows


def test_take_only_the_producers_tensor_unchanged():
    g = _g(6)
    y = nk.rms_norm_triton(torch.randn(4, 256, generator=g), torch.randn(256, generator=g), 1e-6)
    assert xsum.take(y, 128).shape == (4, 2)
    assert xsum.take(y, 64) is None                                   # another group size
    assert xsum.take(y[1:], 128) is None                              # a view is another tensor
    assert xsum.take(y.clone(), 128) is None
    y.mul_(2)                                                         # written since: stale
    assert xsum.take(y, 128) is None
    with torch.inference_mode():
        yi = nk.rms_norm_triton(torch.randn(2, 256, generator=g), torch.randn(256, generator=g), 1e-6)
        assert xsum.take(yi, 128) is not None                         # no version counter: taken as made


@pytest.mark.parametrize("g,gb,k", [(128, 16, 640), (64, 16, 448), (32, 16, 2080), (128, 16, 128)])
def test_gemv_sum_kernel_matches_reference(g, gb, k):
    """The 4-bit GEMV's own sum(x) launch: odd group counts in blocks of GB (a masked tail)."""
    x = torch.randn(3, k, generator=_g(7))
    xs = torch.empty(3, k // g)
    tq._xsum_kernel[(3, -(-(k // g) // gb))](x, xs, k, x.stride(0), G=g, GB=gb)
    torch.testing.assert_close(xs.reshape(-1), xsum.group_sums_ref(x, g), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 37, 384, None), (5, 70, 640, tq.Q4Config(32, split_k=3, wa=True, rows=8)),
    (11, 45, 256, tq.Q4Config(16, split_k=2, wa=True, rows=8, rows_hi=16))])
def test_gemv_with_handed_sums(m, n, k, cfg):
    """Sums handed in skip the sum(x) launch and give the bits of the launch that sums alike."""
    qw = QuantWeight.quantize(torch.randn(n, k, generator=_g(8)), 128)
    x = torch.randn(m, k, generator=_g(9))
    own = tq.q4_group(x, [qw], cfg)[0]
    xs = torch.empty(m, k // 128)
    tq._xsum_kernel[(m, 1)](x, xs, k, x.stride(0), G=128, GB=16)
    handed = tq.q4_group(x, [qw], cfg, xs)[0]
    assert torch.equal(own, handed)
    ref = linear_rows_ref(x, qw.dequantize())
    assert float((handed - ref).norm() / ref.norm()) < 3e-5
    with pytest.raises(ValueError, match="xs must be"):
        tq.q4_group(x, [qw], cfg, torch.zeros(m, k // 64))


def test_q4_rows_takes_the_producers_sums(monkeypatch):
    """A norm's output through two grouped 4-bit weights: the sum(x) launch skipped (recorded), the
    result that of the unfolded path to the sums' rounding; a rotated weight keeps its own launch."""
    g = _g(10)
    x = torch.randn(3, 384, generator=g)
    w = torch.randn(384, generator=g) * 0.2
    qws = [QuantWeight.quantize(torch.randn(n, 384, generator=g), 128) for n in (50, 70)]
    calls = []
    real = tq._xsum_kernel

    class Rec:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(tq, "_xsum_kernel", Rec())
    y = nk.rms_norm_triton(x, w, 1e-6)
    folded = q4_rows(y, qws, [None, None])
    assert calls == []
    own = q4_rows(y.clone(), qws, [None, None])          # a copy carries no sums: the GEMV's own
    assert len(calls) == 1
    for a, b in zip(folded, own):                        # the sums' order only: last bits
        assert float((a - b).norm() / b.norm()) < 3e-6
    had = QuantWeight.quantize(torch.randn(40, 384, generator=g), 128, hadamard=True)
    q4_rows(nk.rms_norm_triton(x, w, 1e-6), [had], [None])
    assert len(calls) == 2


def test_folded_gemv_is_row_invariant():
    """Each row of a folded 4-bit GEMV equals the row made and multiplied alone."""
    g = _g(12)
    x, w = torch.randn(5, 640, generator=g), torch.randn(640, generator=g) * 0.2
    qw = QuantWeight.quantize(torch.randn(60, 640, generator=g), 128)
    folded = q4_rows(nk.rms_norm_triton(x, w, 1e-6), [qw], [None])[0]
    for i in range(5):
        yi = nk.rms_norm_triton(x[i:i + 1], w, 1e-6)
        assert torch.equal(q4_rows(yi, [qw], [None])[0][0], folded[i])


def test_no_fold_before_a_4bit_gemv(monkeypatch):
    """A producer folds only on a device where a 4-bit GEMV has run (a bf16 model pays nothing);
    the first q4 GEMV there turns it on."""
    monkeypatch.setattr(xsum, "_CONSUMERS", set())
    g = _g(12)
    x, w = torch.randn(3, 256, generator=g), torch.randn(256, generator=g)
    assert _sums(nk.rms_norm_triton(x, w, 1e-6)) is None
    qw = QuantWeight.quantize(torch.randn(20, 256, generator=g), 128)
    q4_rows(x, [qw], [None])
    y = nk.rms_norm_triton(x, w, 1e-6)
    assert _sums(y) is not None
    torch.testing.assert_close(_sums(y), xsum.group_sums_ref(y), rtol=1e-5, atol=1e-4)
