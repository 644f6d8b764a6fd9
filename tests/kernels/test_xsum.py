"""Group sums folded into the kernels that write a 4-bit GEMV's input (kernels/xsum.py), under
TRITON_INTERPRET=1 on the CPU: each producer's sums equal the reference pairwise tree of its
written (rounded) output bit for bit, the GEMV's own sum(x) kernel makes the same bits, and the
GEMV handed the sums gives the bits it gives without them."""

import pytest
import torch

from specfire.kernels.attention import fused as attn_fused
from specfire.kernels import xsum
from specfire.kernels.q4 import gemv as tq
from specfire.kernels.small import kernel as ts
from specfire.kernels.gemv import linear_rows_ref
from specfire.kernels.q4 import QuantWeight, q4_rows


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def fold_on(monkeypatch):
    """These tests take the tree form unless they say (the default is `plain`: kernels/xsum.py mode),
    on a device where a 4-bit GEMV has run."""
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "1")
    monkeypatch.setattr(xsum, "_CONSUMERS", {"cpu"})


def _sums(y):
    hit = getattr(y, "_specfire_xs", None)
    return None if hit is None else hit[0]


def _check(y, rows_alone=None):
    """y's attached sums: the reference tree's bits (mode tree) or near the plain sum (mode plain),
    and, given rows_alone (the producer's output for each leading row alone), each row's sums
    those of the row made alone (row-invariant)."""
    xs = _sums(y)
    assert xs is not None, "the producer attached no sums"
    ref = xsum.group_sums_ref(y)
    assert xs.dtype == torch.float32 and xs.shape == ref.shape
    if xsum.mode() == xsum.TREE:
        assert torch.equal(xs, ref)
    # the tree (or tl.sum's order) differs from a plain sum only by rounding
    torch.testing.assert_close(xs, y.float().reshape(-1, xsum.G).sum(1), rtol=1e-5, atol=1e-4)
    if rows_alone is not None:
        per = xs.view(y.shape[0], -1)
        for i, yi in enumerate(rows_alone):
            assert torch.equal(yi, y[i:i + 1]) and torch.equal(_sums(yi), per[i]), f"row {i}"


MODES = pytest.mark.parametrize("mode", ["1", "plain"])


def test_reference_tree_is_pairwise():
    v = torch.randn(3, 8, generator=_g(0))
    a = v[:, 0::2] + v[:, 1::2]
    b = a[:, 0::2] + a[:, 1::2]
    assert torch.equal(xsum.group_sums_ref(v, 8), b[:, 0] + b[:, 1])


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (3, 384), (5, 640), (2, 3, 256)])   # masked block tails (384, 640)
def test_rms_norm_sums(shape, dtype, mode, monkeypatch):
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", mode)
    g = _g(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g) * 0.3
    _check(ts.rms_norm_triton(x, w, 1e-6), [ts.rms_norm_triton(x[i:i + 1], w, 1e-6) for i in range(shape[0])])
    h = torch.randn(shape, generator=g)
    s, y = ts.add_rms_norm_triton(x, h, w, 1e-6)
    _check(y, [ts.add_rms_norm_triton(x[i:i + 1], h[i:i + 1], w, 1e-6)[1] for i in range(shape[0])])
    assert _sums(s) is None                      # the residual feeds no GEMV


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d", [(1, 3, 128), (3, 5, 128), (2, 2, 256)])
def test_gated_norm_sums(t, h, d, dtype, mode, monkeypatch):
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", mode)
    g = _g(2)
    x = torch.randn(t, h, d, generator=g).to(dtype)
    z = torch.randn(t, h, d, generator=g).to(dtype)
    nw = torch.randn(d, generator=g).to(dtype)
    y = ts.gated_rms_norm_triton(x, z, nw, 1e-6)
    _check(y, [ts.gated_rms_norm_triton(x[i:i + 1], z[i:i + 1], nw, 1e-6) for i in range(t)])
    y2 = xsum.reshaped(y, (t, h * d))            # what the model hands out_proj
    assert torch.equal(xsum.take(y2, 128), _sums(y).view(t, h * d // 128))


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 128), (3, 1152), (2, 2432)])   # blocks of 1024: a short last block
def test_silu_mul_sums(t, d, dtype, mode, monkeypatch):
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", mode)
    g = _g(3)
    a, b = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    _check(ts.silu_mul_triton(a, b), [ts.silu_mul_triton(a[i:i + 1], b[i:i + 1]) for i in range(t)])


@MODES
@pytest.mark.parametrize("t,hq,d", [(1, 2, 256), (3, 3, 128)])
def test_out_gate_sums(t, hq, d, mode, monkeypatch):
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", mode)
    g = _g(4)
    o = torch.randn(t, hq, d, generator=g)
    qg = torch.randn(t, hq, 2 * d, generator=g)
    y = attn_fused.out_gate_triton(o, qg)
    torch.testing.assert_close(y, attn_fused.out_gate_ref(o, qg))
    _check(y, [attn_fused.out_gate_triton(o[i:i + 1], qg[i:i + 1]) for i in range(t)])


def test_no_sums_where_they_cannot_serve(monkeypatch):
    g = _g(5)
    w = torch.randn(200, generator=g)
    assert _sums(ts.rms_norm_triton(torch.randn(2, 200, generator=g), w, 1e-6)) is None    # not whole groups
    w = torch.randn(256, generator=g)
    assert _sums(ts.rms_norm_triton(torch.randn(17, 256, generator=g), w, 1e-6)) is None   # a prefill's rows
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "0")
    assert _sums(ts.rms_norm_triton(torch.randn(2, 256, generator=g), w, 1e-6)) is None    # switched off


def test_take_only_the_producers_tensor_unchanged():
    g = _g(6)
    y = ts.rms_norm_triton(torch.randn(4, 256, generator=g), torch.randn(256, generator=g), 1e-6)
    assert xsum.take(y, 128).shape == (4, 2)
    assert xsum.take(y, 64) is None                                   # another group size
    assert xsum.take(y[1:], 128) is None                              # a view is another tensor
    assert xsum.take(y.clone(), 128) is None
    y.mul_(2)                                                         # written since: stale
    assert xsum.take(y, 128) is None
    with torch.inference_mode():
        yi = ts.rms_norm_triton(torch.randn(2, 256, generator=g), torch.randn(256, generator=g), 1e-6)
        assert xsum.take(yi, 128) is not None                         # no version counter: taken as made


@pytest.mark.parametrize("g,gb,k", [(128, 16, 640), (64, 16, 448), (32, 16, 2080), (128, 16, 128)])
def test_gemv_sum_kernel_is_the_tree(g, gb, k):
    x = torch.randn(3, k, generator=_g(7))
    xs = torch.empty(3, k // g)
    tq._xsum_kernel[(3, -(-(k // g) // gb))](x, xs, k, x.stride(0), G=g, GB=gb, TREE=True)
    assert torch.equal(xs.reshape(-1), xsum.group_sums_ref(x, g))
    plain = torch.empty(3, k // g)
    tq._xsum_kernel[(3, -(-(k // g) // gb))](x, plain, k, x.stride(0), G=g, GB=gb)     # the fold off: tl.sum
    torch.testing.assert_close(plain, xs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 37, 384, None), (5, 70, 640, tq.Q4Config(32, split_k=3, wa=True, rows=8)),
    (11, 45, 256, tq.Q4Config(16, split_k=2, sem=False, wa=True, rows=8, rows_hi=16))])
def test_gemv_with_handed_sums_is_bitwise_the_same(m, n, k, cfg):
    qw = QuantWeight.quantize(torch.randn(n, k, generator=_g(8)), 128)
    x = torch.randn(m, k, generator=_g(9))
    own = tq.q4_group(x, [qw], cfg)[0]
    handed = tq.q4_group(x, [qw], cfg, xsum.group_sums_ref(x).view(m, k // 128))[0]
    assert torch.equal(own, handed)
    ref = linear_rows_ref(x, qw.dequantize())
    assert float((handed - ref).norm() / ref.norm()) < 3e-5
    with pytest.raises(ValueError, match="xs must be"):
        tq.q4_group(x, [qw], cfg, torch.zeros(m, k // 64))


def test_q4_rows_takes_the_producers_sums(monkeypatch):
    """A norm's output through two grouped 4-bit weights: the sum(x) launch skipped (recorded),
    the bits those of the unfolded path; a rotated weight keeps its own launch."""
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
    y = ts.rms_norm_triton(x, w, 1e-6)
    folded = q4_rows(y, qws, [None, None])
    assert calls == []
    own = q4_rows(y.clone(), qws, [None, None])          # a copy carries no sums: the GEMV's own (tree)
    assert len(calls) == 1
    for a, b in zip(folded, own):
        assert torch.equal(a, b)
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "0")
    y0 = ts.rms_norm_triton(x, w, 1e-6)
    assert torch.equal(y0, y) and xsum.take(y0, 128) is None
    plain = q4_rows(y0, qws, [None, None])               # the fold off: main's plain reduction
    assert len(calls) == 2
    for a, b in zip(folded, plain):                      # the sums' order only: last bits
        assert float((a - b).norm() / b.norm()) < 3e-6
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "1")
    had = QuantWeight.quantize(torch.randn(40, 384, generator=g), 128, hadamard=True)
    q4_rows(ts.rms_norm_triton(x, w, 1e-6), [had], [None])
    assert len(calls) == 3


def test_default_is_plain():
    """Without SPECFIRE_XSUM_FOLD the fold is on in its plain form (the measured faster one)."""
    import os
    saved = os.environ.pop("SPECFIRE_XSUM_FOLD", None)
    try:
        assert xsum.mode() == xsum.PLAIN and xsum.enabled()
    finally:
        if saved is not None:
            os.environ["SPECFIRE_XSUM_FOLD"] = saved


def test_off_is_unchanged(monkeypatch):
    """SPECFIRE_XSUM_FOLD=0: the producers attach nothing and the GEMV's sum(x) launch is the
    plain reduction (no TREE argument)."""
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "0")
    assert not xsum.enabled()
    g = _g(11)
    y = ts.rms_norm_triton(torch.randn(2, 256, generator=g), torch.randn(256, generator=g), 1e-6)
    assert _sums(y) is None and xsum.take(y, 128) is None
    kws = []
    real = tq._xsum_kernel

    class Rec:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                kws.append(kw)
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(tq, "_xsum_kernel", Rec())
    qw = QuantWeight.quantize(torch.randn(30, 256, generator=g), 128)
    tq.q4_gemv(y, qw)
    assert len(kws) == 1 and "TREE" not in kws[0]
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "1")
    tq.q4_gemv(y, qw)                       # fold on, no sums handed (y made with it off): the tree
    assert kws[1].get("TREE") is True


def test_mode_values(monkeypatch):
    for v, want in (("0", xsum.OFF), ("1", xsum.TREE), ("tree", xsum.TREE), ("plain", xsum.PLAIN)):
        monkeypatch.setenv("SPECFIRE_XSUM_FOLD", v)
        assert xsum.mode() == want
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "yes")
    with pytest.raises(ValueError, match="SPECFIRE_XSUM_FOLD"):
        xsum.mode()


def test_plain_mode_gemv_near_its_own(monkeypatch):
    """plain: the GEMV handed the producer's tl.sum sums agrees with its own sum(x) to the sums'
    rounding (the sum(x) kernel then runs main's tl.sum, not the tree)."""
    monkeypatch.setenv("SPECFIRE_XSUM_FOLD", "plain")
    g = _g(12)
    x, w = torch.randn(5, 640, generator=g), torch.randn(640, generator=g) * 0.2
    qw = QuantWeight.quantize(torch.randn(60, 640, generator=g), 128)
    y = ts.rms_norm_triton(x, w, 1e-6)
    folded = q4_rows(y, [qw], [None])[0]
    own = q4_rows(y.clone(), [qw], [None])[0]
    assert float((folded - own).norm() / own.norm()) < 3e-6
    for i in range(5):                                   # row-invariant: each row as made alone
        yi = ts.rms_norm_triton(x[i:i + 1], w, 1e-6)
        assert torch.equal(q4_rows(yi, [qw], [None])[0][0], folded[i])


def test_no_fold_before_a_4bit_gemv(monkeypatch):
    """A producer folds only on a device where a 4-bit GEMV has run (a bf16 model pays nothing);
    the first q4 GEMV there turns it on."""
    monkeypatch.setattr(xsum, "_CONSUMERS", set())
    g = _g(12)
    x, w = torch.randn(3, 256, generator=g), torch.randn(256, generator=g)
    assert _sums(ts.rms_norm_triton(x, w, 1e-6)) is None
    qw = QuantWeight.quantize(torch.randn(20, 256, generator=g), 128)
    q4_rows(x, [qw], [None])
    y = ts.rms_norm_triton(x, w, 1e-6)
    assert _sums(y) is not None and torch.equal(_sums(y), xsum.group_sums_ref(y))
