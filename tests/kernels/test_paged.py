"""The paged KV layout (kernels/attention/paged.py, model/kvpool.py): every attention kernel over a
pool's rows through a sequence's block table (non-contiguous, descending block ids) gives the bits
it gives over the contiguous cache holding the same rows: decode / verify rows at positions that
cross block bounds and with masked tails, 16-bit and Q8 caches, int and device positions, one
sequence or several in one launch; the fused q/k write and the Q8 rows write put each row where
the table says and nowhere else; a wrong table is seen."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from kvcaches import layer_cache
from specfire.kernels import attention as A
from specfire.kernels.attention import fused as af
from specfire.kernels.attention.kernel import attention_rows_triton
from specfire.kernels.attention.multi import RowsPack
from specfire.kernels.attention.paged import BLOCK, gather, rows_of
from specfire.kernels.small import rope_cos_sin

TILES = dict(block_m=16, split=64, block_n=32)      # spans of one block: positions past 64 cross a span and a block
N = 150                                             # each sequence's positions (3 blocks, the last partial)
ROWS = [1, 4, 3]
POS0 = [70, 61, 0]                                  # 61..64 cross a block bound; 70: a masked key tail
NB = 12                                             # pool blocks (0 is the sink)


def _tables(n_seq, gen):
    """Disjoint, shuffled block ids for each sequence (3 blocks each, none in order)."""
    ids = (torch.randperm(NB - 1, generator=gen)[:3 * n_seq] + 1).to(torch.int32)
    return [ids[3 * i:3 * i + 3].flip(0).contiguous() for i in range(n_seq)]


def _pool_like(x, n_blocks=NB):
    """Pool storage shaped as x past its positions (values key-minor where x's are)."""
    if x.stride(0) == 1 and x.dim() == 3 and x.stride(2) != 1:
        return torch.zeros(x.shape[1], x.shape[2], n_blocks * BLOCK, dtype=x.dtype).permute(2, 0, 1)
    return torch.zeros(n_blocks * BLOCK, *x.shape[1:], dtype=x.dtype)


_caches = partial(layer_cache, n=N)                 # tests/kvcaches.py


def _paged(lcs, tables):
    """The same rows in one pool, each sequence's through its table."""
    first = lcs[0]
    pool = {f: _pool_like(getattr(first, f)) if getattr(first, f) is not None else None
            for f in ("k", "v", "k_scale", "v_scale")}
    out = []
    for lc, tab in zip(lcs, tables):
        rows = rows_of(tab, 0, lc.k.shape[0])
        for f, dst in pool.items():
            if dst is not None:
                dst.index_copy_(0, rows, getattr(lc, f))
        out.append(SimpleNamespace(**pool, blocks=tab))
    return out


def _spans(rows):
    ends = [sum(rows[:i + 1]) for i in range(len(rows))]
    return [(e - r, e) for r, e in zip(rows, ends)]


def _pack(pos0s, cos_sins=None):
    pack = RowsPack(_spans(ROWS), torch.device("cpu"))
    pack.at(pos0s, cos_sins if cos_sins is not None else [(torch.zeros(r, 2), torch.zeros(r, 2)) for r in ROWS])
    return pack


CASES = [("bf", 6, 2, 16, torch.float32, TILES),
         ("bf", 4, 1, 32, torch.float32, dict(block_m=16, split=128, block_n=64, chunk=2)),
         ("q8g", 6, 2, 32, torch.float32, TILES),
         ("q8t", 8, 2, 16, torch.float16, TILES)]


def test_gather_and_rows_follow_the_table():
    tab = torch.tensor([5, 2, 7], dtype=torch.int32)
    assert rows_of(tab, 62, 4).tolist() == [5 * 64 + 62, 5 * 64 + 63, 2 * 64, 2 * 64 + 1]
    assert rows_of(tab, torch.tensor([128]), 2).tolist() == [7 * 64, 7 * 64 + 1]
    pool = torch.arange(8 * 64.0)[:, None, None]
    assert gather(pool, tab, 130).flatten().tolist() == [*range(320, 384), *range(128, 192), 448, 449]
    assert gather(pool, None, 3).flatten().tolist() == [0, 1, 2]


@pytest.mark.parametrize("kind,hq,hkv,d,qdt,kw", CASES, ids=["bf", "bf-span128", "q8-grouped", "q8-token"])
@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_paged_rows_equal_contiguous(kind, hq, hkv, d, qdt, kw, device_pos):
    gen = torch.Generator().manual_seed(hq * 7 + d)
    lcs = [_caches(kind, hkv, d, gen) for _ in ROWS]
    pg = _paged(lcs, _tables(len(ROWS), gen))
    q = (torch.randn(sum(ROWS), hq, d, generator=gen) * 2).to(qdt)
    pos = [torch.tensor([p]) for p in POS0] if device_pos else POS0
    for (a, b), lc, p, pl in zip(_spans(ROWS), lcs, pos, pg):       # one sequence a launch
        want = attention_rows_triton(q[a:b], lc.k, lc.v, p, 0.3, lc.k_scale, lc.v_scale, **kw)
        got = attention_rows_triton(q[a:b], pl.k, pl.v, p, 0.3, pl.k_scale, pl.v_scale, blocks=pl.blocks, **kw)
        assert torch.equal(got, want)
    f, g = lcs[0], pg[0]                                                # every sequence in one launch
    want = attention_rows_triton(q, f.k, f.v, None, 0.3, f.k_scale, f.v_scale, multi=_pack(pos).launch(lcs), **kw)
    got = attention_rows_triton(q, g.k, g.v, None, 0.3, g.k_scale, g.v_scale, multi=_pack(pos).launch(pg),
                                blocks=g.blocks, **kw)
    assert torch.equal(got, want)


def test_paged_reference_and_prefill_equal_contiguous():
    """The PyTorch paths (attention_rows, attention_prefill on the CPU) over a gathered sequence."""
    gen = torch.Generator().manual_seed(3)
    for kind in ("bf", "q8t"):
        lc = _caches(kind, 2, 16, gen)
        (pl,) = _paged([lc], _tables(1, gen))
        q = torch.randn(5, 4, 16, generator=gen)
        for fn in (A.attention_rows, A.attention_prefill):
            want = fn(q, lc.k, lc.v, 62, 0.25, lc.k_scale, lc.v_scale)
            assert torch.equal(fn(q, pl.k, pl.v, 62, 0.25, pl.k_scale, pl.v_scale, blocks=pl.blocks), want)


def test_a_wrong_block_table_is_seen():
    """Negative control: two of the sequence's blocks swapped in its table change its rows (the
    equalities above can fail), and a multi launch with the wrong table too."""
    gen = torch.Generator().manual_seed(9)
    lc = _caches("bf", 2, 16, gen)
    (pl,) = _paged([lc], _tables(1, gen))
    q = torch.randn(2, 6, 16, generator=gen)
    want = attention_rows_triton(q, lc.k, lc.v, 100, 0.3, **TILES)
    assert torch.equal(attention_rows_triton(q, pl.k, pl.v, 100, 0.3, blocks=pl.blocks, **TILES), want)
    bad = pl.blocks[[1, 0, 2]].contiguous()
    assert not torch.equal(attention_rows_triton(q, pl.k, pl.v, 100, 0.3, blocks=bad, **TILES), want)
    pack = RowsPack([(0, 2)], torch.device("cpu"))
    pack.at([100], [(torch.zeros(2, 2), torch.zeros(2, 2))])
    wrong = SimpleNamespace(k=pl.k, v=pl.v, k_scale=None, v_scale=None, blocks=bad)
    assert not torch.equal(attention_rows_triton(q, pl.k, pl.v, None, 0.3, multi=pack.launch([wrong]),
                                                 blocks=bad, **TILES), want)


def test_paged_rows_refuse_tiles_that_straddle_blocks():
    gen = torch.Generator().manual_seed(1)
    (pl,) = _paged([_caches("bf", 1, 16, gen)], _tables(1, gen))
    with pytest.raises(ValueError, match="multiple of the block"):
        attention_rows_triton(torch.randn(1, 2, 16), pl.k, pl.v, 5, 0.3, blocks=pl.blocks, split=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_paged_qk_write_lands_where_the_table_says(dtype, device_pos):
    """The fused q/k norm + rotary + KV write, alone and for several sequences: the same q, each
    row at its table's pool row, every other pool row untouched (gathered == the contiguous cache)."""
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d, r = 6, 2, 16, 8
    t = sum(ROWS)
    qg = torch.randn(t, hq, 2 * d, generator=gen).to(dtype)
    kx, vx = torch.randn(t, hkv, d, generator=gen).to(dtype), torch.randn(t, hkv, d, generator=gen).to(dtype)
    qw, kw = (torch.randn(d, generator=gen) * 0.1).to(dtype), (torch.randn(d, generator=gen) * 0.1).to(dtype)
    tabs = _tables(len(ROWS), gen)
    rots = [rope_cos_sin(torch.arange(p, p + n), r, 1e4) for p, n in zip(POS0, ROWS)]
    pos = [torch.tensor([p]) for p in POS0] if device_pos else POS0
    cont = [(torch.zeros(N, hkv, d, dtype=dtype), torch.zeros(N, hkv, d, dtype=dtype)) for _ in ROWS]
    want = [af.qk_norm_rope_write_triton(qg[a:b], kx[a:b], vx[a:b], qw, kw, 1e-6, *cs, kc, vc, p)
            for (a, b), cs, (kc, vc), p in zip(_spans(ROWS), rots, cont, pos)]
    for multi in (False, True):
        pk, pv = torch.zeros(NB * BLOCK, hkv, d, dtype=dtype), torch.zeros(NB * BLOCK, hkv, d, dtype=dtype)
        if multi:
            pack = _pack(pos, rots)
            lcs = [SimpleNamespace(k=pk, v=pv, k_scale=None, v_scale=None, blocks=tb) for tb in tabs]
            cos, sin, _ = pack.rotary
            q = af.qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, pk, pv, None,
                                             multi=pack.launch(lcs), blocks=tabs[0])
            qs = [q[a:b] for a, b in _spans(ROWS)]
        else:
            qs = [af.qk_norm_rope_write_triton(qg[a:b], kx[a:b], vx[a:b], qw, kw, 1e-6, *cs, pk, pv, p, blocks=tb)
                  for (a, b), cs, p, tb in zip(_spans(ROWS), rots, pos, tabs)]
        written = torch.zeros(NB * BLOCK, dtype=torch.bool)
        for w, got, (kc, vc), tb in zip(want, qs, cont, tabs):
            assert torch.equal(got, w)
            assert torch.equal(gather(pk, tb, N), kc) and torch.equal(gather(pv, tb, N), vc)
            written[rows_of(tb, 0, N)] = True
        assert not pk[~written].any() and not pv[~written].any()


@pytest.mark.parametrize("device_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_paged_q8_rows_write_equals_kv_write(device_pos):
    """The packed Q8 rows write into a pool leaves each sequence's gathered rows (codes, key-minor
    values, scales) as kv_write leaves its contiguous cache."""
    gen = torch.Generator().manual_seed(23)
    hkv, d = 2, 16
    t = sum(ROWS)
    kx, vx = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    alone = [_caches("q8t", hkv, d, gen) for _ in ROWS]
    pg = _paged(alone, _tables(len(ROWS), gen))
    for (a, b), lc, p in zip(_spans(ROWS), alone, POS0):
        A.kv_write(lc, p, kx[a:b], vx[a:b])
    pos = [torch.tensor([p]) for p in POS0] if device_pos else POS0
    af.q8_write_multi_triton(kx, vx, pg, _pack(pos).launch(pg))
    for pl, lc in zip(pg, alone):
        for f in ("k", "v", "k_scale", "v_scale"):
            assert torch.equal(gather(getattr(pl, f), pl.blocks, N), getattr(lc, f)), f
    # kv_write through a table (the PyTorch path) lands alike
    pg2 = _paged([_caches("q8t", hkv, d, gen)], _tables(1, gen))[0]
    ref = SimpleNamespace(**{f: gather(getattr(pg2, f), pg2.blocks, N).clone() for f in ("k", "k_scale", "v_scale")})
    ref.v = A.q8_value_cache(N, hkv, d, "cpu")
    ref.v.copy_(gather(pg2.v, pg2.blocks, N))
    A.kv_write(ref, 62, kx[:4], vx[:4])
    A.kv_write(pg2, torch.tensor([62]) if device_pos else 62, kx[:4], vx[:4])
    for f in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(gather(getattr(pg2, f), pg2.blocks, N), getattr(ref, f)), f
