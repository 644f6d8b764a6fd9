"""Several sequences' rows in one launch per attention kernel (kernels/attention/multi.py, the
packed verify): each sequence's outputs and KV rows are bit for bit those of its own call, with
mixed row counts, positions (masked key tails, a span boundary inside the rows, position 0),
16-bit and Q8 caches, int and device positions; a table pointing at the wrong cache is seen."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from kvcaches import layer_cache
from specfire.kernels import attention as A
from specfire.kernels.attention import fused as af
from specfire.kernels.attention.kernel import attention_rows_triton
from specfire.kernels.attention.multi import RowsPack, cache_table
from specfire.kernels.head import RopeTable
from specfire.kernels.small import rope_cos_sin

SMALL = dict(block_m=16, split=32, block_n=16)
ROWS = [1, 4, 2]                # AR, MTP k=3, n-gram k=1
POS0 = [29, 0, 45]              # rows 29..32 cross the span boundary at 32; 45, 46: a masked key tail
N = 80                          # every cache's positions (rows past a sequence's reach hold junk)


def _spans(rows):
    ends = [sum(rows[:i + 1]) for i in range(len(rows))]
    return [(e - r, e) for r, e in zip(rows, ends)]


_caches = partial(layer_cache, n=N)                 # tests/kvcaches.py


def _pack(rows, pos0s, cos_sins=None):
    pack = RowsPack(_spans(rows), torch.device("cpu"))
    pack.at(pos0s, cos_sins if cos_sins is not None else [(torch.zeros(r, 2), torch.zeros(r, 2)) for r in rows])
    return pack


def _alone_attention(q, lcs, rows, pos0s, scale, kw):
    return [attention_rows_triton(q[a:b], lc.k, lc.v, p, scale, lc.k_scale, lc.v_scale, **kw)
            for (a, b), lc, p in zip(_spans(rows), lcs, pos0s)]


def _multi_attention(q, lcs, pack, scale, kw):
    f = lcs[0]
    return attention_rows_triton(q, f.k, f.v, None, scale, f.k_scale, f.v_scale, multi=pack.launch(lcs), **kw)


CASES = [("bf", 8, 1, 32, torch.float32, SMALL),                      # two tiles for the 4-row sequence
         ("bf", 6, 2, 16, torch.float32, dict(block_m=16, split=16, block_n=16, chunk=2)),   # combine chunks
         ("q8g", 6, 2, 32, torch.float32, SMALL),                     # grouped Q8, float32 dequantizing
         ("q8t", 8, 2, 16, torch.float16, SMALL)]                     # the Q8 cache's kernel


@pytest.mark.parametrize("kind,hq,hkv,d,qdt,kw", CASES, ids=["bf-tiles", "bf-chunks", "q8-grouped", "q8-token"])
@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_attention_of_several_sequences_in_one_launch_is_each_alone(kind, hq, hkv, d, qdt, kw, device_pos):
    gen = torch.Generator().manual_seed(hq * 10 + d)
    lcs = [_caches(kind, hkv, d, gen) for _ in ROWS]
    q = (torch.randn(sum(ROWS), hq, d, generator=gen) * 2).to(qdt)
    pos = [torch.tensor([p]) for p in POS0] if device_pos else POS0
    alone = _alone_attention(q, lcs, ROWS, POS0, 0.3, kw)
    out = _multi_attention(q, lcs, _pack(ROWS, pos), 0.3, kw)
    assert out.shape == (sum(ROWS), hq, d)
    for (a, b), want in zip(_spans(ROWS), alone):
        assert torch.equal(out[a:b], want)
    if device_pos:      # and the lone graph form (position on the device, the whole cache spanned)
        for (a, b), lc, p in zip(_spans(ROWS), lcs, pos):
            assert torch.equal(out[a:b], attention_rows_triton(q[a:b], lc.k, lc.v, p, 0.3, lc.k_scale,
                                                               lc.v_scale, **kw))


def test_attention_table_at_the_wrong_cache_is_seen():
    """Negative control: the same launch with sequences 0 and 2's cache addresses swapped no longer
    gives sequence 0 its own rows (the comparison above can fail)."""
    gen = torch.Generator().manual_seed(5)
    lcs = [_caches("bf", 1, 32, gen) for _ in ROWS]
    q = torch.randn(sum(ROWS), 8, 32, generator=gen)
    alone = _alone_attention(q, lcs, ROWS, POS0, 0.3, SMALL)
    pack = _pack(ROWS, POS0)
    launch = pack.launch(lcs)
    launch.table, _ = cache_table([lcs[2], lcs[1], lcs[0]])
    f = lcs[0]
    out = attention_rows_triton(q, f.k, f.v, None, 0.3, multi=launch, **SMALL)
    assert not torch.equal(out[0:1], alone[0])
    assert torch.equal(out[1:5], alone[1])          # the untouched sequence keeps its bits


def _qk_inputs(t, hq, hkv, d, dtype, gen):
    return (torch.randn(t, hq, 2 * d, generator=gen).to(dtype), torch.randn(t, hkv, d, generator=gen).to(dtype),
            torch.randn(t, hkv, d, generator=gen).to(dtype), (torch.randn(d, generator=gen) * 0.1).to(dtype),
            (torch.randn(d, generator=gen) * 0.1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", [False, True], ids=["rows", "rope-table"])
@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_qk_write_of_several_sequences_in_one_launch_is_each_alone(dtype, table, device_pos):
    """The fused q/k norm + rotary + KV write over every sequence's rows: each one's q rows and
    whole caches (its own rows written, every other row untouched) are those of its own call."""
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d, r = 6, 2, 16, 8
    qg, kx, vx, qw, kw = _qk_inputs(sum(ROWS), hq, hkv, d, dtype, gen)
    caches = [(torch.randn(N, hkv, d, generator=gen).to(dtype), torch.randn(N, hkv, d, generator=gen).to(dtype))
              for _ in ROWS]
    if table:
        rt = RopeTable(rope_cos_sin(torch.arange(N), r, 1e4))
        rots = [rt] * len(ROWS)
    else:
        rots = [rope_cos_sin(torch.arange(p, p + n), r, 1e4) for p, n in zip(POS0, ROWS)]
    alone_c = [(k.clone(), v.clone()) for k, v in caches]
    multi_c = [SimpleNamespace(k=k.clone(), v=v.clone(), k_scale=None, v_scale=None) for k, v in caches]
    want = [af.qk_norm_rope_write_triton(qg[a:b], kx[a:b], vx[a:b], qw, kw, 1e-6, *cs, kc, vc, p, table=table)
            for (a, b), cs, (kc, vc), p in zip(_spans(ROWS), rots, alone_c, POS0)]
    pos = [torch.tensor([p]) for p in POS0] if device_pos else POS0
    pack = _pack(ROWS, pos, rots)
    cos, sin, tab = pack.rotary
    assert tab == table
    q = af.qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, multi_c[0].k, multi_c[0].v, None,
                                     table=tab, multi=pack.launch(multi_c))
    for (a, b), w, (ka, va), mc in zip(_spans(ROWS), want, alone_c, multi_c):
        assert torch.equal(q[a:b], w)
        assert torch.equal(mc.k, ka) and torch.equal(mc.v, va)


def test_rows_pack_refuses_what_it_cannot_launch():
    with pytest.raises(ValueError, match="spans"):
        RowsPack([(0, 2), (3, 4)], torch.device("cpu"))
    pack = RowsPack(_spans(ROWS), torch.device("cpu"))
    with pytest.raises(ValueError, match="all ints or all device tensors"):
        pack.at([1, torch.tensor([2]), 3], [None] * 3)
    gen = torch.Generator().manual_seed(1)
    lcs = [_caches("bf", 1, 16, gen), _caches("bf", 1, 16, gen), _caches("bf", 1, 16, gen, n=N + 1)]
    with pytest.raises(ValueError, match="sequence 2's layer cache"):
        cache_table(lcs)


@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_q8_rows_write_of_several_sequences_in_one_launch_is_each_kv_write(device_pos):
    """A Q8 cache's packed rows write (quantized over all rows, one copy launch) leaves each
    sequence's whole cache (codes, key-minor values, scales) as its own kv_write does."""
    gen = torch.Generator().manual_seed(23)
    hkv, d = 2, 16
    kx, vx = torch.randn(sum(ROWS), hkv, d, generator=gen), torch.randn(sum(ROWS), hkv, d, generator=gen)
    alone = [_caches("q8t", hkv, d, gen) for _ in ROWS]
    multi = [SimpleNamespace(**{f: getattr(lc, f).clone() for f in ("k", "k_scale", "v_scale")}) for lc in alone]
    for m, lc in zip(multi, alone):         # the value cache's own layout (key-minor, padded storage)
        m.v = A.q8_value_cache(N, hkv, d, "cpu")
        m.v.copy_(lc.v)
    for (a, b), lc, p in zip(_spans(ROWS), alone, POS0):
        A.kv_write(lc, p, kx[a:b], vx[a:b])
    pack = _pack(ROWS, [torch.tensor([p]) for p in POS0] if device_pos else POS0)
    af.q8_write_multi_triton(kx, vx, multi, pack.launch(multi))
    for m, lc in zip(multi, alone):
        for f in ("k", "v", "k_scale", "v_scale"):
            assert torch.equal(getattr(m, f), getattr(lc, f)), f
