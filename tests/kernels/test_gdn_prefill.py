"""Gated DeltaNet prefill passes (kernels/gdn/prefill.py, interpreted on the CPU in float32) vs the
reference chunked form (kernels/gdn/ref.py): each pass, the whole prefill with its state and conv
window, odd T (masked tail chunks), value heads grouped over key heads, a wrong head map failing.

The interpreter computes tl.dot in float32 whatever input_precision says, so the tolerance is
float32 rounding through a few chunks (1e-4); on the GPU the passes use tf32x3 products, checked
against the reference by bench/gdn_prefill.py."""

import pytest
import torch

from specfire.kernels import gdn as G
from specfire.kernels.gdn import prefill as P
from specfire.kernels.gdn.kernel import conv_window_triton

TOL = dict(rtol=1e-4, atol=1e-4)


def _inputs(t, hk, r, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * r
    q = torch.randn(t, hk, dk, generator=gen) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    s = torch.randn(hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, s


def _grouped(x, r):
    return x.repeat_interleave(r, dim=1)


def _terms(q, k, v, g, beta, r, chunk):
    """The terms pass alone: (W, U, G) [Hv, N, C, ...]."""
    t, hv, dk, dv = k.shape[0], v.shape[1], k.shape[2], v.shape[2]
    n = -(-t // chunk)
    w, u = torch.empty(hv, n, chunk, dv), torch.empty(hv, n, chunk, dk)
    gc = torch.empty(hv, n, chunk)
    P._terms_kernel[(n, hv)](k, v, g, beta, w, u, gc, t, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             g.stride(0), beta.stride(0), R=r, C=chunk, DK=dk, DV=dv, PREC=P.PRECISION)
    return w, u, gc


@pytest.mark.parametrize("t,r", [(1, 1), (63, 3), (65, 1)])
def test_terms_pass_matches_chunk_terms(t, r):
    chunk, hk, dk, dv = 32, 2, 16, 32
    q, k, v, g, beta, _ = _inputs(t, hk, r, dk, dv, seed=t + r)
    w, u, gc = _terms(q, k, v, g, beta, r, chunk)
    ref = G.chunk_terms(_grouped(q, r), _grouped(k, r), v, g, beta, chunk)
    torch.testing.assert_close(gc, ref.G, **TOL)
    torch.testing.assert_close(w, ref.Wv, **TOL)
    torch.testing.assert_close(u, ref.Uk, **TOL)


def test_state_and_output_passes_match_the_reference_scan():
    """The state pass's start states, deltas and final state, and the output pass, against the
    reference chunk loop fed the same terms."""
    t, r, chunk, hk, dk, dv = 70, 3, 32, 1, 16, 32
    q, k, v, g, beta, s0 = _inputs(t, hk, r, dk, dv, seed=4)
    hv, n = hk * r, -(-t // chunk)
    w, u, gc = _terms(q, k, v, g, beta, r, chunk)
    ref = G.chunk_terms(_grouped(q, r), _grouped(k, r), v, g, beta, chunk)
    sc, d = torch.empty(hv, n, dk, dv), torch.empty(hv, n, chunk, dv)
    fin = torch.empty(hv, dk, dv)
    P._state_kernel[(hv, dv // 16)](k, u, w, gc, s0, sc, d, fin, t, n, k.stride(0), k.stride(1),
                                    R=r, C=chunk, DK=dk, DV=dv, BV=16, PREC=P.PRECISION)
    s = s0
    for i in range(n):
        torch.testing.assert_close(sc[:, i], s, **TOL)
        delta = ref.Wv[:, i] - ref.Uk[:, i] @ s
        torch.testing.assert_close(d[:, i], delta, **TOL)
        s = ref.G[:, i, -1].exp()[:, None, None] * s + ref.kdec[:, i].transpose(-1, -2) @ delta
    torch.testing.assert_close(fin, s, **TOL)
    o = torch.full((t, hv, dv), float("nan"))
    P._output_kernel[(n, hv, dv // 16)](q, k, gc, d, sc, o, t, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                        o.stride(0), o.stride(1), R=r, C=chunk, DK=dk, DV=dv, BV=16, PREC=P.PRECISION)
    ro, _ = G.gdn_chunked_ref(_grouped(q, r), _grouped(k, r), v, g, beta, s0, chunk)
    torch.testing.assert_close(o, ro, **TOL)


@pytest.mark.parametrize("t,r,dk,dv,piece", [(1, 1, 16, 16, 2048), (65, 3, 16, 32, 2048), (130, 1, 32, 16, 64),
                                             (63, 3, 32, 32, 32)])
def test_prefill_matches_reference_with_conv(t, r, dk, dv, piece):
    """The whole prefill as the layer runs it: the conv window over [T, conv_dim] (a nonzero
    window), q, k, v split from its output (row-strided views), a nonzero state; output, final
    state and the conv window after the last row; pieces of `piece` rows give the same bits as one."""
    chunk, hk, kk = 32, 2, 4
    hv = hk * r
    gen = torch.Generator().manual_seed(t * 10 + r + dk)
    cdim = 2 * hk * dk + hv * dv
    x = torch.randn(t, cdim, generator=gen)
    win = torch.randn(kk - 1, cdim, generator=gen)
    wconv = torch.randn(cdim, kk, generator=gen) * 0.5
    conv, full = conv_window_triton(x, win, wconv, block_c=64, block_t=16)
    rconv, rfull = G.conv_window_ref(x, win, wconv)
    torch.testing.assert_close(conv, rconv, rtol=1e-5, atol=1e-5)
    assert torch.equal(full[-(kk - 1):], rfull[-(kk - 1):])
    q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    assert t == 1 or not v.is_contiguous()
    q, k = G.l2norm_ref(q, dk ** -0.5), G.l2norm_ref(k)
    g = -torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.3
    o, s = P.gdn_prefill_triton(q, k, v, g, beta, s0, chunk=chunk, piece=piece, state_bv=16, out_bv=16)
    ro, rs = G.gdn_chunked_ref(_grouped(q, r), _grouped(k, r), v, g, beta, s0, chunk)
    assert o.shape == (t, hv, dv) and s.shape == (hv, dk, dv)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    if piece < t:                     # pieces: the same bits as one pass
        o1, s1 = P.gdn_prefill_triton(q, k, v, g, beta, s0, chunk=chunk, piece=4096, state_bv=16, out_bv=16)
        assert torch.equal(o, o1) and torch.equal(s, s1)


def test_a_head_alone_equals_the_head_among_others():
    """Value heads 3..5 (key head 1) alone give the bits they get among all six heads: no tile spans heads."""
    q, k, v, g, beta, s0 = _inputs(40, 2, 3, 16, 16, seed=8)
    o, s = P.gdn_prefill_triton(q, k, v, g, beta, s0, chunk=16, state_bv=16, out_bv=16)
    o1, s1 = P.gdn_prefill_triton(q[:, 1:], k[:, 1:], v[:, 3:], g[:, 3:], beta[:, 3:], s0[3:], chunk=16,
                                  state_bv=16, out_bv=16)
    assert torch.equal(o[:, 3:], o1) and torch.equal(s[3:], s1)


def test_wrong_head_map_fails():
    """Negative control: value head j reading key head j % Hk (not j // r) differs from the reference."""
    t, hk, r, dk, dv = 33, 2, 3, 16, 16
    q, k, v, g, beta, s0 = _inputs(t, hk, r, dk, dv, seed=2)
    o, s = P.gdn_prefill_triton(q, k, v, g, beta, s0, chunk=16, state_bv=16, out_bv=16)
    wrong = lambda x: x.repeat(1, r, 1)                                   # noqa: E731
    ro, rs = G.gdn_chunked_ref(wrong(q), wrong(k), v, g, beta, s0, 16)
    assert not torch.allclose(o, ro, **TOL) and not torch.allclose(s, rs, **TOL)
    ro, rs = G.gdn_chunked_ref(_grouped(q, r), _grouped(k, r), v, g, beta, s0, 16)
    torch.testing.assert_close(o, ro, **TOL)


def test_bad_inputs_are_clear_errors():
    q, k, v, g, beta, s0 = _inputs(5, 2, 2, 16, 16, seed=1)
    with pytest.raises(ValueError, match="powers of two"):
        P.gdn_prefill_triton(q[..., :12], k[..., :12], v, g, beta, s0[:, :12], chunk=16)
    with pytest.raises(ValueError, match="multiple of Hk"):
        P.gdn_prefill_triton(q, k, v[:, :3], g[:, :3], beta[:, :3], s0[:3], chunk=16)
    with pytest.raises(ValueError, match="do not match"):
        P.gdn_prefill_triton(q, k, v, g, beta, s0[:, :, :8], chunk=16)
