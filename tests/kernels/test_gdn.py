"""Gated DeltaNet rows kernels (Triton, interpreted on the CPU in float32) vs the float32
reference recurrence and conv window; row invariance (verify rows == chained decode rows)."""

import pytest
import torch

from specfire.kernels import gdn as G
from specfire.kernels.gdn.kernel import commit_rows_triton, conv_window_triton, gdn_rows_triton


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
    o, (delta, dec) = gdn_rows_triton(q, k, v, g, beta, s, log=True, bv=bv)
    ro, (rdelta, rdec) = G.gdn_rows_ref(q, k, v, g, beta, s, log=True)
    assert torch.equal(s, s0)                                     # the live state is not modified
    assert o.shape == (t, h, dv) and delta.shape == (t, h, dv) and dec.shape == (t, h)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta, rdelta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec, rdec, rtol=1e-6, atol=1e-6)
    o2, final = gdn_rows_triton(q, k, v, g, beta, s, log=False, bv=bv)
    _, rfinal = G.gdn_rows_ref(q, k, v, g, beta, s)
    assert torch.equal(o2, o)
    torch.testing.assert_close(final, rfinal, rtol=1e-5, atol=1e-5)
    # the commit kernel replays the logged rows into the state the rows kernel carried, bit for bit
    st = s.clone()[None]
    commit_rows_triton(st, k.contiguous()[None], delta[None], dec[None], t)
    assert torch.equal(st[0], final)


def test_rows_strided_inputs():
    """q, k, v as views with a row stride (as split from the conv output) give the same result."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, s = _inputs(4, 2, 8, 12, gen)
    wide = torch.cat([v.reshape(4, -1), torch.randn(4, 7, generator=gen)], dim=1)
    vs = wide[:, :24].view(4, 2, 12)
    assert not vs.is_contiguous()
    o, _ = gdn_rows_triton(q, k, vs, g, beta, s, log=True, bv=4)
    ro, _ = G.gdn_rows_ref(q, k, v, g, beta, s, log=True)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)


def test_rows_invariant():
    """T rows at once == T chained one-row calls, each from the state the commit of the previous
    row left, bit for bit (outputs, logs, states)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, s = _inputs(6, 3, 16, 24, gen)
    o, (delta, dec) = gdn_rows_triton(q, k, v, g, beta, s, log=True, bv=8)
    cur = s.clone()[None]
    for i in range(6):
        o1, (d1, e1) = gdn_rows_triton(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], cur[0],
                                       log=True, bv=8)
        assert torch.equal(o1[0], o[i]) and torch.equal(d1[0], delta[i]) and torch.equal(e1[0], dec[i]), i
        commit_rows_triton(cur, k[i:i + 1].contiguous()[None], d1[None], e1[None], 1)
        whole = s.clone()[None]
        commit_rows_triton(whole, k.contiguous()[None], delta[None], dec[None], i + 1)
        assert torch.equal(whole, cur), i                     # commit(i) == i+1 single rows committed


@pytest.mark.parametrize("n_l,t,hv,dk,dv,bv", [(3, 4, 2, 6, 10, 4), (2, 1, 3, 16, 24, 8), (1, 5, 1, 5, 7, 32)])
def test_commit_kernel_matches_reference(n_l, t, hv, dk, dv, bv):
    """The commit kernel (every layer in one launch, odd sizes, masked tails) == the reference, for
    every row count 0..T, in place; a bad log shape is a clear error."""
    gen = torch.Generator().manual_seed(n_l * 10 + t)
    s = torch.randn(n_l, hv, dk, dv, generator=gen)
    k = torch.randn(n_l, t, hv, dk, generator=gen)
    d = torch.randn(n_l, t, hv, dv, generator=gen)
    dec = torch.rand(n_l, t, hv, generator=gen)
    for rows in range(t + 1):
        a, b = s.clone(), s.clone()
        ptr = a.data_ptr()
        commit_rows_triton(a, k, d, dec, rows, bv=bv)
        G.commit_rows_ref(b, k, d, dec, rows)
        assert a.data_ptr() == ptr
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(a, s) == (rows == 0)
    with pytest.raises(ValueError, match="commit"):
        commit_rows_triton(s, k[:, :, :, :-1], d, dec, 1)
    with pytest.raises(ValueError, match="row count"):
        G.commit_rows(s, k, d, dec, t + 1)


def test_commit_ref_equals_the_rows_reference_final_state():
    """CPU: the reference rows forward's own final state == its log replayed by commit, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, s = _inputs(5, 3, 12, 20, gen)
    _, (delta, dec) = G.gdn_rows_ref(q, k, v, g, beta, s, log=True)
    for rows in range(1, 6):
        _, final = G.gdn_rows_ref(q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows], s)
        st = s.clone()[None]
        G.commit_rows(st, k[None], delta[None], dec[None], rows)
        assert torch.equal(st[0], final), rows


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
