"""The packed rows forward through the GPU's layers (fused attention and Gated DeltaNet kernels,
interpreted on the CPU): each sequence's rows get the bits of its own verify; the Gated DeltaNet
kernel covers every sequence of a layer in one launch (kernels/gdn/fused.py gdn_rows_triton)."""
from __future__ import annotations

import pytest
import torch

from packedrows import ROWS, model, run
from specfire.kernels.attention import fused as af
from specfire.kernels.gdn import fused as gf
from specfire.kernels.gdn.kernel import commit_rows_triton
from specfire.layers import CUDA


def test_packed_forward_fused_kernels_give_each_sequence_its_own_bits(monkeypatch):
    """Alone, each verify launches the GDN kernel once per layer with one sequence; packed, once
    per layer with all of them."""
    ran, gdn_seqs = [], []
    for mod, name in ((gf, "gdn_rows_triton"), (af, "qk_norm_rope_write_triton"), (af, "out_gate_triton")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: ran.append(name) or real(*a, **k))
    real_rows = gf.gdn_rows_triton
    monkeypatch.setattr(gf, "gdn_rows_triton", lambda *a, **k: gdn_seqs.append(len(a[9].spans)) or real_rows(*a, **k))
    m = model(CUDA, torch.float32, fused=True)
    run(m, torch.float32)
    n_gdn = sum(hasattr(layer, "linear_attn") for layer in m.layers)
    assert sorted(gdn_seqs) == [1] * (n_gdn * len(ROWS)) + [len(ROWS)] * n_gdn
    assert {"qk_norm_rope_write_triton", "out_gate_triton"} <= set(ran)


def _books(n_seq, n_l, hv, dk, dv, kk, c, rows, seed):
    """Each sequence's stacked state (rec [L, Hv, dk, dv], conv [L, K-1, C]) and log buffers of its
    row count (k, delta, dec, full), as model/state.py RowsBook lays them out, all random: a write
    to a wrong place shows."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(sh, generator=g) * 0.3 for sh in (
        (n_l, hv, dk, dv), (n_l, kk - 1, c), (n_l, t, hv, dk), (n_l, t, hv, dv), (n_l, t, hv), (n_l, kk - 1 + t, c)))
        for t in rows[:n_seq]]


def _inputs(total, hk, hv, dk, dv, kk, seed):
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    qkv = torch.randn(total, c, generator=g).to(torch.bfloat16)
    a = (torch.randn(total, hv, generator=g) * 3).to(torch.bfloat16)
    b = torch.randn(total, hv, generator=g).to(torch.bfloat16)
    w = (torch.randn(c, kk, generator=g) * 0.5).to(torch.bfloat16)
    a_log = (torch.randn(hv, generator=g) * 0.5).to(torch.bfloat16)
    dtb = torch.randn(hv, generator=g).to(torch.bfloat16)
    z = (torch.randn(total, hv * dv + 3, generator=g) * 2).to(torch.bfloat16)[:, 1:1 + hv * dv]  # a wider row stride
    nw = (1 + 0.2 * torch.randn(dv, generator=g)).to(torch.bfloat16)
    return qkv, a, b, w, a_log, dtb, z, nw


def _spans(rows):
    ends = [sum(rows[:i + 1]) for i in range(len(rows))]
    return [(e - r, e) for r, e in zip(rows, ends)]


@pytest.mark.parametrize("rows,hk,hv,dk,dv,kk,bv,norm", [
    ([1, 4, 2], 1, 2, 6, 10, 4, 4, True),      # split heads (the norm its own launch), tails dk 6, dv 10
    ([1, 4, 2], 2, 4, 5, 7, 3, None, True),    # whole heads with the norm inside, conv of 3 taps
    ([2, 0, 1, 3], 1, 3, 4, 6, 2, 2, False),   # a sequence of no rows among others, no norm
])
def test_gdn_one_launch_equals_each_sequence_alone(rows, hk, hv, dk, dv, kk, bv, norm):
    """Sequences of mixed row counts (AR 1, MTP 4, ...) in one launch over their own stacked
    states at layer 1 of 3 == each launched alone, bit for bit: outputs, logs (and nothing else
    of the stacks written), the committed states; a table naming another sequence's state does not."""
    n_l, layer = 3, 1
    spans = _spans(rows)
    qkv, a, b, w, a_log, dtb, z, nw = _inputs(sum(rows), hk, hv, dk, dv, kk, seed=sum(rows) + dv)
    z, nw = (z, nw) if norm else (None, None)
    c = qkv.shape[1]
    packed = _books(len(rows), n_l, hv, dk, dv, kk, c, rows, seed=9)
    alone = [tuple(x.clone() for x in bk) for bk in packed]
    before = [tuple(x.clone() for x in bk) for bk in packed]
    table = gf.seq_table(spans, packed, qkv.device)
    o = gf.gdn_rows_triton(qkv, a, b, w, a_log, dtb, hk, dk, dv, table, layer, z, nw, 1e-6, bv=bv)
    assert table.aligned and o.shape == (sum(rows), hv, dv)
    for (i, j), bp, ba in zip(spans, packed, alone):
        one = gf.seq_table([(0, j - i)], [ba], qkv.device)
        zi = None if z is None else z[i:j]
        o1 = gf.gdn_rows_triton(qkv[i:j], a[i:j], b[i:j], w, a_log, dtb, hk, dk, dv, one, layer, zi, nw, 1e-6, bv=bv)
        assert torch.equal(o[i:j], o1)
        assert all(torch.equal(x, y) for x, y in zip(bp, ba))          # logs and windows, every layer
        # the layer's slices are what the one-sequence API writes from that layer's own tensors, and
        # no other layer's are touched
        bb = before[spans.index((i, j))]
        o2, log2, full2 = gf.gdn_decode_triton(qkv[i:j], a[i:j], b[i:j], bb[1][layer], w, a_log, dtb, bb[0][layer],
                                               hk, dk, dv, zi, nw, 1e-6, bv=bv)
        assert torch.equal(o2, o1) and all(torch.equal(x[layer], y) for x, y in zip(bp[2:], (*log2, full2)))
        assert all(torch.equal(x[m], y[m]) for x, y in zip(bp, bb) for m in range(n_l) if m != layer)
        assert all(torch.equal(x[layer], y[layer]) for x, y in zip(bp[:2], bb[:2]))   # the live state as it was
        for n in range(j - i):                                          # commit(n): the same state
            sp, sa = bp[0][layer].clone(), ba[0][layer].clone()
            commit_rows_triton(sp[None], *(x[layer:layer + 1] for x in bp[2:5]), n + 1)
            commit_rows_triton(sa[None], *(x[layer:layer + 1] for x in ba[2:5]), n + 1)
            assert torch.equal(sp, sa)
    # negative control: sequence 0's row names sequence 2's recurrent state (the same head shapes)
    wrong = gf.SeqTable(table.data.clone(), table.spans, table.layers, table.dims, table.aligned)
    wrong.data[0, 2] = table.data[2, 2]
    o_bad = gf.gdn_rows_triton(qkv, a, b, w, a_log, dtb, hk, dk, dv, wrong, layer, z, nw, 1e-6, bv=bv)
    i, j = spans[0]
    assert not torch.equal(o_bad[i:j], o[i:j]) and torch.equal(o_bad[j:], o[j:])


def test_gdn_rows_rejects_tables_that_do_not_fit():
    qkv, a, b, w, a_log, dtb, z, nw = _inputs(3, 1, 2, 4, 4, 4, seed=0)
    bufs = _books(2, 1, 2, 4, 4, 4, qkv.shape[1], [1, 2], seed=0)
    with pytest.raises(ValueError, match="tile the 3 rows"):
        gaps = _books(2, 1, 2, 4, 4, 4, qkv.shape[1], [1, 1], seed=0)
        gf.gdn_rows_triton(qkv, a, b, w, a_log, dtb, 1, 4, 4, gf.seq_table([(0, 1), (2, 3)], gaps, qkv.device))
    with pytest.raises(ValueError, match="contiguous float32"):
        gf.seq_table([(0, 1)], [tuple(x.double() for x in bufs[0])], qkv.device)
    with pytest.raises(ValueError, match="contiguous float32"):      # sequence 1's log is of 2 rows
        gf.seq_table([(0, 1), (1, 2)], bufs, qkv.device)
    with pytest.raises(ValueError, match="do not hold layer 1"):
        gf.gdn_rows_triton(qkv, a, b, w, a_log, dtb, 1, 4, 4, gf.seq_table([(0, 1), (1, 3)], bufs, qkv.device), 1)


@pytest.mark.parametrize("q8", [False, True], ids=["bf-cache", "q8-cache"])
def test_packed_forward_attention_kernels_launch_once_per_layer(monkeypatch, q8):
    """With the attention kernels on (as on CUDA; interpreted here), the packed forward launches
    the q/k write (a Q8 cache: the quantized rows' write), the split attention and its combine
    once per attention layer for all three sequences, and each sequence still gets its own
    verify's bits (which run the same attention kernels; a Q8 cache's rows written by kv_write)."""
    from specfire.kernels import attention as A
    from specfire.kernels.attention import kernel as ak

    monkeypatch.setattr(A, "_use_kernel", lambda q: q.shape[-1] in A.KERNEL_HEAD_DIMS)
    launches = []
    write = (af, "_q8_rows_kernel") if q8 else (af, "_qk_kernel")
    split = (ak, "_attn_q8t_kernel") if q8 else (ak, "_attn_split_kernel")
    for mod, name in (write, split, (ak, "_attn_combine_kernel")):
        real = getattr(mod, name)

        class Counted:
            def __getitem__(self, grid, real=real, name=name):
                def go(*a, **k):
                    launches.append((name, k.get("MULTI", name == "_q8_rows_kernel")))
                    return real[grid](*a, **k)
                return go
        monkeypatch.setattr(mod, name, Counted())
    m = model(CUDA, torch.float32, fused=True)
    run(m, A.Q8_KV if q8 else torch.float32)
    packed = [x for x in launches if x[1]]
    n_attn = sum(hasattr(layer, "self_attn") for layer in m.layers)
    assert sorted(packed) == sorted((mod[1], True) for mod in (write, split, (ak, "_attn_combine_kernel"))
                                    for _ in range(n_attn))
    alone = 2 if q8 else 3                                  # a Q8 cache's rows alone: kv_write (torch)
    assert len(launches) - len(packed) == alone * n_attn * 3      # each sequence alone: the same kernels


@pytest.mark.parametrize("q8", [False, True], ids=["bf-cache", "q8-cache"])
def test_a_packed_forward_re_pointed_at_other_states_computes_theirs(monkeypatch, q8):
    """runtime/graphs.py's re-pointing of a packed graph, its replay emulated by the eager forward
    over the captured Segments (the attention kernels on, as on CUDA): the tables made for states
    A, rewritten (`rebind`) to address states B at other positions, make that forward compute B's
    rows, KV writes, logs and commits bit for bit as B's own packed forward does. A table entry
    left pointing at A shows."""
    from packedrows import PROMPTS, after_commit, snapshot, states
    from specfire.kernels import attention as A
    from specfire.model.state import Segments
    from specfire.runtime.graphs import own_tables, rebind

    monkeypatch.setattr(A, "_use_kernel", lambda q: q.shape[-1] in A.KERNEL_HEAD_DIMS)
    kv = A.Q8_KV if q8 else torch.float32
    m = model(CUDA, torch.float32, fused=True)
    g = torch.Generator().manual_seed(5)
    ids_a = [torch.randint(0, 64, (r,), generator=g) for r in ROWS]
    ids_b = [torch.randint(0, 64, (r,), generator=g) for r in ROWS]
    pos_b = [p + 3 for p in PROMPTS]            # B's sequences further on: the positions are the graph's too

    def grown(sts):
        """Three more prompt rows for each state (the same ones for every call)."""
        gen = torch.Generator().manual_seed(7)
        for st, p in zip(sts, PROMPTS):
            m(torch.randint(0, 64, (3,), generator=gen), p, st, rows=False)
        return sts

    a = states(m, kv)
    b, b_ref = grown(states(m, kv)), grown(states(m, kv))
    with torch.inference_mode():
        pos = torch.tensor(PROMPTS, dtype=torch.long)
        segs = Segments.of(a, [pos[i:i + 1] for i in range(len(a))], ROWS)
        m.packed(torch.cat(ids_a), segs)        # the warm-up: makes the tables
        tables = own_tables(segs)
        assert tables is not None and tables.gdn and len(tables.attn) == 1
        logs = rebind(tables, segs.spans, a, b)
        assert logs is not None
        pos.copy_(torch.tensor(pos_b))
        h, lg = m.packed(torch.cat(ids_b), segs)    # the "replay": A's Segments, B's tables
        ref_pos = torch.tensor(pos_b, dtype=torch.long)
        ref_segs = Segments.of(b_ref, [ref_pos[i:i + 1] for i in range(len(b_ref))], ROWS)
        wh, wl = m.packed(torch.cat(ids_b), ref_segs)
    assert torch.equal(h, wh) and torch.equal(lg, wl)
    for st, st_logs in zip(b, logs):
        for lc, lgs in zip(st.layers, st_logs):
            if lc.rec is not None:
                lc.log = lgs
    for sb, sr, p, r, n in zip(b, b_ref, pos_b, ROWS, [0, 2, 1]):
        for x, y in zip(snapshot(sb, p, r), snapshot(sr, p, r)):
            assert torch.equal(x, y)
        for x, y in zip(after_commit(sb, n), after_commit(sr, n)):
            assert torch.equal(x, y)
