"""Gated DeltaNet rows kernels (Triton, interpreted on the CPU in float32) vs the float32
reference recurrence and conv window; row invariance (verify rows == chained decode rows)."""

import pytest
import torch

from specfire.ops import gdn as G
from specfire.ops.gdn_kernels import conv_window_triton, gdn_chunked_triton, gdn_rows_triton


def _inputs(t, h, dk, dv, gen):
    q = torch.randn(t, h, dk, generator=gen) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    s = torch.randn(h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, s


@pytest.mark.parametrize("t,h,dk,dv,bv", [(1, 2, 8, 12, 8), (5, 3, 6, 10, 4), (16, 2, 16, 32, 16), (3, 1, 32, 20, 32)])
def test_rows_match_reference(t, h, dk, dv, bv):
    gen = torch.Generator().manual_seed(t * 100 + dk + dv)
    q, k, v, g, beta, s = _inputs(t, h, dk, dv, gen)
    s0 = s.clone()
    o, caps = gdn_rows_triton(q, k, v, g, beta, s, capture=True, bv=bv)
    ro, rcaps = G.gdn_rows_ref(q, k, v, g, beta, s, capture=True)
    assert torch.equal(s, s0)                                     # the live state is not modified
    assert o.shape == (t, h, dv) and caps.shape == (t, h, dk, dv)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caps, rcaps, rtol=1e-5, atol=1e-5)
    o2, final = gdn_rows_triton(q, k, v, g, beta, s, capture=False, bv=bv)
    assert torch.equal(o2, o) and torch.equal(final, caps[-1])


def test_rows_strided_inputs():
    """q, k, v as views with a row stride (as split from the conv output) give the same result."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, s = _inputs(4, 2, 8, 12, gen)
    wide = torch.cat([v.reshape(4, -1), torch.randn(4, 7, generator=gen)], dim=1)
    vs = wide[:, :24].view(4, 2, 12)
    assert not vs.is_contiguous()
    o, caps = gdn_rows_triton(q, k, vs, g, beta, s, capture=True, bv=4)
    ro, rcaps = G.gdn_rows_ref(q, k, v, g, beta, s, capture=True)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)


def test_rows_invariant():
    """T rows at once == T chained one-row calls from the captured states, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, s = _inputs(6, 3, 16, 24, gen)
    o, caps = gdn_rows_triton(q, k, v, g, beta, s, capture=True, bv=8)
    cur = s
    for i in range(6):
        o1, c1 = gdn_rows_triton(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], cur,
                                 capture=True, bv=8)
        assert torch.equal(o1[0], o[i]) and torch.equal(c1[0], caps[i]), i
        cur = c1[0]


@pytest.mark.parametrize("t,c,kk,block", [(1, 20, 4, 8), (5, 37, 4, 16), (3, 10, 2, 16)])
def test_conv_window_matches_reference_and_is_row_invariant(t, c, kk, block):
    gen = torch.Generator().manual_seed(t + c)
    x = torch.randn(t, c, generator=gen)
    win = torch.randn(kk - 1, c, generator=gen)
    w = torch.randn(c, kk, generator=gen)
    out, full = conv_window_triton(x, win, w, block_c=block)
    ro, rf = G.conv_window_ref(x, win, w)
    assert torch.equal(full, rf)
    torch.testing.assert_close(out, ro, rtol=1e-5, atol=1e-5)
    for i in range(t):                       # each row alone, from the window before it
        o1, _ = conv_window_triton(x[i:i + 1], full[i:i + kk - 1], w, block_c=block)
        assert torch.equal(o1[0], out[i]), i


@pytest.mark.parametrize("t,h,dk,dv,chunk", [(37, 3, 16, 32, 16), (64, 2, 32, 16, 16), (5, 1, 16, 16, 16)])
def test_chunked_scan_matches_recurrence(t, h, dk, dv, chunk):
    """Prefill through the chunk-scan kernel equals the row-by-row recurrence (tails padded)."""
    gen = torch.Generator().manual_seed(t * 7 + dk)
    q, k, v, g, beta, s = _inputs(t, h, dk, dv, gen)
    o, final = gdn_chunked_triton(q, k, v, g, beta, s, chunk=chunk, bv=16)
    ro, rfinal = G.gdn_rows_ref(q, k, v, g, beta, s)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, rfinal, rtol=1e-5, atol=1e-5)
