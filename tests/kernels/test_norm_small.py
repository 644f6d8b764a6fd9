"""Fused small ops (Triton, under TRITON_INTERPRET=1 on the CPU) against their PyTorch references."""

import pytest
import torch

from specfire.kernels import small as greedy
from specfire.kernels import norm
from specfire.kernels import small as rope
from specfire.kernels.small import silu_mul_ref
from specfire.kernels.small import kernel as ts
from specfire.kernels.norm import kernel as nk


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 37), (7, 130)])
def test_rms_norm(shape):
    g = _g(1)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) * 0.3
    torch.testing.assert_close(nk.rms_norm_triton(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_strided_view():
    """q_norm reads q out of the interleaved [T, H, 2D] projection: a strided view."""
    g = _g(2)
    qg = torch.randn(3, 4, 2 * 24, generator=g)
    q = qg[..., :24]
    w = torch.randn(24, generator=g)
    torch.testing.assert_close(nk.rms_norm_triton(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_add_rms_norm():
    g = _g(3)
    x, h = torch.randn(5, 77, generator=g), torch.randn(5, 77, generator=g)
    w = torch.randn(77, generator=g) * 0.3
    s, y = nk.add_rms_norm_triton(x, h, w, 1e-6)
    s_ref, y_ref = norm.add_rms_norm_ref(x, h, w, 1e-6)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    h64 = torch.randn(5, 77, generator=g, dtype=torch.float64)   # a wider h is rounded to x's dtype first
    s, _ = nk.add_rms_norm_triton(x, h64, w, 1e-6)
    assert s.dtype == x.dtype and torch.equal(s, x + h64.to(x.dtype)) and torch.equal(s, norm.add_rms_norm_ref(x, h64, w, 1e-6)[0])


def test_gated_rms_norm():
    g = _g(4)
    x, z = torch.randn(3, 5, 12, generator=g), torch.randn(3, 5, 12, generator=g) * 2
    w = torch.randn(12, generator=g)
    torch.testing.assert_close(nk.gated_rms_norm_triton(x, z, w, 1e-6), norm.gated_rms_norm_ref(x, z, w, 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,h,d,r", [(3, 4, 16, 4), (2, 3, 40, 20), (5, 2, 32, 32)])
def test_rope(t, h, d, r):
    g = _g(5)
    qg = torch.randn(t, h, 2 * d, generator=g)
    x = qg[..., :d]  # strided, as in the model
    cos, sin = rope.rope_cos_sin(torch.arange(7, 7 + t), r, 10000.0)
    torch.testing.assert_close(ts.apply_rope_triton(x, cos, sin), rope.apply_rope_ref(x, cos, sin),
                               rtol=1e-5, atol=1e-6)


def test_silu_mul():
    g = _g(6)
    a, b = torch.randn(3, 2100, generator=g) * 4, torch.randn(3, 2100, generator=g)
    torch.testing.assert_close(ts.silu_mul_triton(a, b), silu_mul_ref(a, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("v", [1, 1000, 5000])
def test_argmax_with_ties(v):
    g = _g(7)
    x = torch.randn(4, v, generator=g)
    if v > 10:  # a tie across chunk boundaries and within one: the lowest index must win
        x[1, v - 3] = x[1].max() + 1
        x[1, 5] = x[1, v - 3]
        x[2, :] = 0.5
    assert torch.equal(ts.argmax_triton(x), greedy.argmax_ref(x))


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_greedy_accept(k):
    g = _g(8 + k)
    logits = torch.randn(k + 1, 3001, generator=g)
    t_ref = logits.argmax(-1)
    for n_ok in range(k + 1):  # drafts correct for n_ok positions, then wrong
        draft = t_ref[:k].clone()
        if n_ok < k:
            draft[n_ok] = (draft[n_ok] + 1) % 3001
        t, n = ts.greedy_accept_triton(logits, draft)
        t_r, n_r = greedy.greedy_accept_ref(logits, draft)
        assert torch.equal(t, t_r) and int(n) == int(n_r) == n_ok


@pytest.mark.parametrize("v", [7, 3001, 70001])
def test_greedy_accept_many_is_each_member_alone(v):
    """A packed verify's members (1 to 7 rows, drafts right for a random number of positions, a
    NaN row and a tie across chunks among them, some followed by rows no member owns): one
    batched accept gives every member the targets and n of greedy_accept on its rows alone, kernel
    and reference."""
    g = _g(v + 1)
    rows = [1, 4, 2, 7, 1, 3, 4]
    pads = [0, 0, 1, 0, 1, 0, 0]
    if v > 10000:   # the interpreter's cost is rows x chunks: the widest, gaps and a last pad row kept
        rows, pads = rows[:5], pads[:5]
    logits = torch.randn(sum(rows) + sum(pads), v, generator=g)
    logits[2, v // 3] = float("nan")
    if v > 10:
        logits[6, v - 2] = logits[6].max() + 1
        logits[6, 3] = logits[6, v - 2]
    want_t = logits.argmax(-1)
    spans, a = [], 0
    for r, p in zip(rows, pads):
        spans.append((a, a + r))
        a += r + p
    ids = torch.randint(0, v, (logits.shape[0],), generator=g)
    for a, b in spans:
        ok = int(torch.randint(0, b - a, (1,), generator=g))   # drafts right for `ok` positions
        ids[a + 1:a + 1 + ok] = want_t[a:a + ok]
        if a + 1 + ok < b:
            ids[a + 1 + ok] = (want_t[a + ok] + 1) % v
    t, n = ts.greedy_accept_many_triton(logits, ids, spans)
    t_r, n_r = greedy.greedy_accept_many_ref(logits, ids, spans)
    assert torch.equal(n, n_r)
    for j, (a, b) in enumerate(spans):
        t1, n1 = ts.greedy_accept_triton(logits[a:b], ids[a + 1:b])
        assert torch.equal(t[a:b], t1) and torch.equal(t_r[a:b], t1) and int(n[j]) == int(n1), j
        assert torch.equal(t1, want_t[a:b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [7, 3001, 70001])
def test_argmax_of_masked_and_nan_rows_is_torchs(v, dtype):
    """Rows a grammar masked (mostly -inf, whole chunks of it, or all of it) and rows with NaNs:
    the index torch.argmax gives (all -inf: 0; the first NaN wins), never one past the vocabulary
    (an id the next draft chain would gather its embedding row with)."""
    g = _g(v)
    x = torch.randn(8, v, generator=g)
    x[0] = float("-inf")                                    # a grammar that allowed nothing
    x[1] = float("-inf")
    x[1, v - 1] = 2.0                                       # one id, in the last chunk's masked tail block
    x[2, : v // 2] = float("-inf")                          # the first chunks all -inf
    x[3, v // 3] = float("nan")
    x[3, v - 1] = float("nan")
    x[4] = float("-inf")
    x[4, v - 2] = float("nan")                              # a NaN among -inf
    x[5, :] = float("nan")
    x[6, v - 1] = float("inf")
    x[6, 0] = float("nan")                                  # NaN beats +inf, wherever it lies
    x = x.to(dtype)
    want = x.argmax(-1)
    assert want[0] == 0 and want[3] == v // 3 and want[6] == 0
    assert torch.equal(ts.argmax_triton(x), want)
    draft = want[:7].clone()
    draft[5] += 1
    t, n = ts.greedy_accept_triton(x, draft)
    assert torch.equal(t, want) and int(n) == 5


def test_public_functions_use_reference_on_cpu():
    g = _g(9)
    x, w = torch.randn(2, 8, generator=g), torch.randn(8, generator=g) * 0.3
    assert torch.equal(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
