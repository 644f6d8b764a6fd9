"""Fused decode kernels (kernels/gdn/fused.py, kernels/attention/fused.py), interpreted on the CPU, against the
unfused PyTorch compositions: odd sizes and masked tails, rows at once == rows one by one bit for
bit, and a shard of heads == the same heads of the whole bit for bit (tensor-parallel shards)."""

import pytest
import torch

from specfire.kernels.attention.fused import (out_gate_ref, out_gate_triton, qk_norm_rope_write_ref,
                                     qk_norm_rope_write_triton)
from specfire.kernels.gdn import commit_rows_ref
from specfire.kernels.gdn.fused import gdn_decode_ref, gdn_decode_triton
from specfire.kernels.gdn.kernel import commit_rows_triton


def _commit(s, log, rows, kernel=commit_rows_triton):
    """The state after the first `rows` logged rows (the commit kernel, or the reference)."""
    st = s.clone()[None]
    kernel(st, *(x[None].contiguous() for x in log), rows)
    return st[0]


def _close_logs(log, rlog, s):
    for x, rx in zip(log, rlog):
        torch.testing.assert_close(x, rx, rtol=1e-5, atol=1e-5)
    t = log[0].shape[0]
    torch.testing.assert_close(_commit(s, log, t), _commit(s, rlog, t, commit_rows_ref), rtol=1e-5, atol=1e-5)


def _gdn_inputs(t, hk, hv, dk, dv, kk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    qkv = torch.randn(t, c, generator=g).to(dtype)
    a = (torch.randn(t, hv, generator=g) * 3).to(dtype)
    a[0, 0] = 30.0                                   # softplus past its threshold
    b = torch.randn(t, hv, generator=g).to(dtype)
    win = torch.randn(kk - 1, c, generator=g)
    w = (torch.randn(c, kk, generator=g) * 0.5).to(dtype)
    a_log = (torch.randn(hv, generator=g) * 0.5).to(dtype)
    dtb = torch.randn(hv, generator=g).to(dtype)
    s = torch.randn(hv, dk, dv, generator=g) * 0.3
    return qkv, a, b, win, w, a_log, dtb, s


def _gate_inputs(t, hv, dv, dtype, seed):
    """z with a row stride wider than Hv * dv (a view into a grouped projection's buffer) and the
    gated norm's weight."""
    g = torch.Generator().manual_seed(seed + 1000)
    z = (torch.randn(t, hv * dv + 3, generator=g) * 2).to(dtype)[:, 1:1 + hv * dv]
    nw = (1 + 0.2 * torch.randn(dv, generator=g)).to(dtype)
    return z, nw


GDN_SHAPES = [(1, 1, 2, 8, 12, 4, 8), (3, 2, 4, 6, 10, 4, 8), (2, 1, 1, 5, 7, 3, 16)]   # tails: dk 6, 5; dv 10, 7


@pytest.mark.parametrize("t,hk,hv,dk,dv,kk,bv", GDN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_matches_reference(t, hk, hv, dk, dv, kk, bv, dtype):
    """bv < dv: a head's columns split over programs (no norm); bv 16: whole heads."""
    args = _gdn_inputs(t, hk, hv, dk, dv, kk, dtype, seed=t * 31 + dk + dv)
    s0 = args[-1].clone()
    o, log, full = gdn_decode_triton(*args, hk, dk, dv, bv=bv)
    ro, rlog, rfull = gdn_decode_ref(*args, hk, dk, dv)
    assert torch.equal(args[-1], s0)                          # the live state is not modified
    assert o.dtype == dtype and o.shape == (t, hv, dv)
    assert [tuple(x.shape) for x in log] == [(t, hv, dk), (t, hv, dv), (t, hv)]
    assert torch.equal(full, rfull)                            # the window is copied, not computed
    _close_logs(log, rlog, s0)
    if dtype == torch.float32:
        torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    else:   # one rounding of a float32 value that differs by reduction order: within 2 units
        torch.testing.assert_close(o.float(), ro.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("t,hk,hv,dk,dv,kk", [(1, 1, 2, 8, 12, 4), (3, 2, 4, 6, 10, 4), (2, 1, 3, 5, 7, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_gated_norm_matches_reference(t, hk, hv, dk, dv, kk, dtype):
    """The default launch: one program per whole value head, the gated RMSNorm folded in (masked
    tails: dv 12 / 10 / 7 in a block of 16 / 16 / 8 lanes)."""
    args = _gdn_inputs(t, hk, hv, dk, dv, kk, dtype, seed=t * 17 + dk + dv)
    z, nw = _gate_inputs(t, hv, dv, dtype, seed=t + dv)
    o, log, full = gdn_decode_triton(*args, hk, dk, dv, z, nw, 1e-6)
    ro, rlog, rfull = gdn_decode_ref(*args, hk, dk, dv, z, nw, 1e-6)
    assert o.dtype == dtype and o.shape == (t, hv, dv)
    assert torch.equal(full, rfull)
    _close_logs(log, rlog, args[-1])
    if dtype == torch.float32:
        torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    else:   # the norm rounds three times; a unit's difference in o can move a value by a few units
        torch.testing.assert_close(o.float(), ro.float(), rtol=2 ** -5, atol=2e-2)
    o2, log2, _ = gdn_decode_triton(*args, hk, dk, dv, z, nw, 1e-6, bv=4)   # split heads: the norm after
    _close_logs(log2, rlog, args[-1])
    torch.testing.assert_close(o2.float(), ro.float(), rtol=2 ** -5, atol=2e-2)


@pytest.mark.parametrize("norm,bv,kk", [(False, 4, 4), (True, None, 4), (True, 4, 4), (False, 2, 3), (True, None, 2)])
def test_gdn_decode_rows_equal_chained_single_rows(norm, bv, kk):
    """Whole heads with the norm inside, and split heads (the default form) with or without the
    gated norm's own launch after them: rows at once == single rows, each from the state commit
    left after the previous one (so commit(i) == i+1 single rows committed), bit for bit; 5 rows, so
    the loads two rows ahead run in steady state; conv widths 2..4."""
    t, hk, hv, dk, dv = 5, 1, 2, 6, 5
    qkv, a, b, win, w, a_log, dtb, s = _gdn_inputs(t, hk, hv, dk, dv, kk, torch.bfloat16, seed=7)
    z, nw = _gate_inputs(t, hv, dv, torch.bfloat16, seed=7) if norm else (None, None)
    kw = {"bv": bv}
    o, log, full = gdn_decode_triton(qkv, a, b, win, w, a_log, dtb, s, hk, dk, dv, z, nw, **kw)
    cur_s, cur_w = s, win
    for i in range(t):
        zi = z[i:i + 1] if norm else None
        o1, l1, f1 = gdn_decode_triton(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cur_w, w, a_log, dtb, cur_s,
                                       hk, dk, dv, zi, nw, **kw)
        assert torch.equal(o1[0], o[i]) and all(torch.equal(x[0], y[i]) for x, y in zip(l1, log)), i
        cur_s, cur_w = _commit(cur_s, l1, 1), full[i + 1:i + kk]      # commit(0) of the single row
        assert torch.equal(cur_s, _commit(s, log, i + 1)), i           # commit(i) of the rows
        assert torch.equal(f1[1:], cur_w)


def test_gdn_decode_zero_rows():
    """No row: the prologue loads are masked off and nothing but the window is written."""
    args = _gdn_inputs(1, 1, 2, 4, 6, 4, torch.bfloat16, seed=5)
    qkv, a, b = args[0][:0], args[1][:0], args[2][:0]
    o, log, full = gdn_decode_triton(qkv, a, b, *args[3:], 1, 4, 6, bv=2)
    assert o.shape == (0, 2, 6) and torch.equal(full, args[3])


def test_gdn_decode_compiles_one_binary_for_every_row_count():
    """On the GPU a row count of 1 specialised as a constant changed FMA contraction in the one-row
    binary and broke row invariance (first H200 run, docs/PERFORMANCE.md); the interpreter cannot
    show that, so the guard is checked here: the row count is table data (no argument), and the
    layer index, an argument, is not specialised (layer 1 is no constant)."""
    from specfire.kernels.gdn import fused as gdn_fused
    k = gdn_fused._gdn_merged_kernel
    opts = getattr(k, "kwargs", None) or {"do_not_specialize": getattr(k, "do_not_specialize", None)}
    assert "n_rows" not in k.arg_names and "layer" in (opts.get("do_not_specialize") or [])


@pytest.mark.parametrize("norm,bv", [(False, 2), (True, None), (True, 2)])
def test_gdn_decode_head_shard_equals_whole(norm, bv):
    t, hk, hv, dk, dv, kk = 3, 2, 4, 4, 4, 4
    qkv, a, b, win, w, a_log, dtb, s = _gdn_inputs(t, hk, hv, dk, dv, kk, torch.bfloat16, seed=3)
    z, nw = _gate_inputs(t, hv, dv, torch.bfloat16, seed=3) if norm else (None, None)
    kw = {"bv": bv}
    o, log, full = gdn_decode_triton(qkv, a, b, win, w, a_log, dtb, s, hk, dk, dv, z, nw, **kw)
    rep, kd = hv // hk, hk * dk
    for k0, k1 in ((0, 1), (1, 2)):                       # shards of key heads and their value heads
        h0, h1 = k0 * rep, k1 * rep
        ch = torch.cat([torch.arange(k0 * dk, k1 * dk), kd + torch.arange(k0 * dk, k1 * dk),
                        2 * kd + torch.arange(h0 * dv, h1 * dv)])
        z2 = z[:, h0 * dv:h1 * dv] if norm else None
        o2, l2, f2 = gdn_decode_triton(qkv[:, ch].contiguous(), a[:, h0:h1].contiguous(), b[:, h0:h1].contiguous(),
                                       win[:, ch].contiguous(), w[ch].contiguous(), a_log[h0:h1], dtb[h0:h1],
                                       s[h0:h1].contiguous(), k1 - k0, dk, dv, z2, nw, **kw)
        assert torch.equal(o2, o[:, h0:h1]) and torch.equal(f2, full[:, ch])
        assert all(torch.equal(x, y[:, h0:h1]) for x, y in zip(l2, log))


def test_gdn_decode_rejects_bad_shapes():
    args = _gdn_inputs(2, 1, 2, 8, 12, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="channels"):
        gdn_decode_triton(*args, 1, 8, 10)
    z, nw = _gate_inputs(2, 2, 12, torch.float32, seed=1)
    with pytest.raises(ValueError, match="z of shape"):
        gdn_decode_triton(*args, 1, 8, 12, z[:, :20], nw)
    wide = _gdn_inputs(2, 1, 2, 8, 12, 5, torch.float32, seed=1)     # a conv of 5 taps: the unfused path's
    with pytest.raises(ValueError, match="conv K=5 outside 2..4"):
        gdn_decode_triton(*wide, 1, 8, 12)
    with pytest.raises(ValueError, match="out must be"):
        gdn_decode_triton(*args, 1, 8, 12, out=(torch.empty(2, 2, 8), torch.empty(2, 2, 12), torch.empty(2, 2),
                                                torch.empty(3, 40)))


def _attn_inputs(t, hq, hkv, d, r, dtype, seed, max_seq=16):
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(t, hq, 2 * d, generator=g).to(dtype)
    kx = torch.randn(t, hkv, d, generator=g).to(dtype)
    vx = torch.randn(t, hkv, d, generator=g).to(dtype)
    qw = (torch.randn(d, generator=g) * 0.1).to(dtype)
    kw = (torch.randn(d, generator=g) * 0.1).to(dtype)
    pos = torch.arange(t, dtype=torch.float32)[:, None] + 5
    f = pos * torch.rand(r // 2, generator=g)[None, :]
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    kc = torch.randn(max_seq, hkv, d, generator=g).to(dtype)
    vc = torch.randn(max_seq, hkv, d, generator=g).to(dtype)
    return qg, kx, vx, qw, kw, cos, sin, kc, vc


ATTN_SHAPES = [(1, 4, 2, 16, 8), (3, 6, 2, 12, 6), (4, 3, 1, 20, 20), (2, 2, 2, 10, 4)]


@pytest.mark.parametrize("t,hq,hkv,d,r", ATTN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write_matches_reference(t, hq, hkv, d, r, dtype):
    tensor_pos = t % 2 == 0
    qg, kx, vx, qw, kw, cos, sin, kc, vc = _attn_inputs(t, hq, hkv, d, r, dtype, seed=t + d + r)
    pos0 = torch.tensor([5]) if tensor_pos else 5
    kc2, vc2 = kc.clone(), vc.clone()
    q = qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc, vc, pos0)
    rq = qk_norm_rope_write_ref(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc2, vc2, 5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(q.float(), rq.float(), **tol)
    torch.testing.assert_close(kc.float(), kc2.float(), **tol)
    assert torch.equal(vc, vc2)
    outside = torch.ones(kc.shape[0], dtype=torch.bool)
    outside[5:5 + t] = False
    assert torch.equal(kc[outside], kc2[outside])                 # no other cache row touched


def test_qk_norm_rope_write_rows_and_heads_invariant():
    t, hq, hkv, d, r = 4, 6, 2, 12, 6
    qg, kx, vx, qw, kw, cos, sin, kc, vc = _attn_inputs(t, hq, hkv, d, r, torch.bfloat16, seed=11)
    kc0, vc0 = kc.clone(), vc.clone()
    q = qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc, vc, 3)
    for i in range(t):                                            # one row at its own position
        k1, v1 = kc0.clone(), vc0.clone()
        q1 = qk_norm_rope_write_triton(qg[i:i + 1], kx[i:i + 1], vx[i:i + 1], qw, kw, 1e-6, cos[i:i + 1],
                                       sin[i:i + 1], k1, v1, torch.tensor([3 + i]))
        assert torch.equal(q1[0], q[i]) and torch.equal(k1[3 + i], kc[3 + i]) and torch.equal(v1[3 + i], vc[3 + i])
    k2, v2 = kc0[:, 1:].clone(), vc0[:, 1:].clone()               # a shard: kv head 1, its 3 query heads
    q2 = qk_norm_rope_write_triton(qg[:, 3:].contiguous(), kx[:, 1:].contiguous(), vx[:, 1:].contiguous(), qw, kw,
                                   1e-6, cos, sin, k2, v2, 3)
    assert torch.equal(q2, q[:, 3:]) and torch.equal(k2, kc[:, 1:]) and torch.equal(v2, vc[:, 1:])


@pytest.mark.parametrize("t,hq,d", [(1, 3, 16), (3, 5, 12), (2, 2, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_gate_matches_reference(t, hq, d, dtype):
    g = torch.Generator().manual_seed(t * hq + d)
    o = torch.randn(t, hq, d, generator=g)
    qg = torch.randn(t, hq, 2 * d, generator=g).to(dtype)
    y = out_gate_triton(o, qg)
    ry = out_gate_ref(o, qg)
    assert y.dtype == dtype and y.shape == (t, hq * d)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ry, rtol=1e-6, atol=1e-6)
    else:  # the same rounding points (the interpreter rounds bf16 its own way: a few units)
        torch.testing.assert_close(y.float(), ry.float(), rtol=2 ** -5, atol=0)
    assert torch.equal(out_gate_triton(o[1:], qg[1:]), y[1:])     # row-invariant


@pytest.mark.parametrize("conv", [4, 5])
def test_model_rows_forward_fused_matches_unfused(conv, monkeypatch):
    """The call sites in layers/ (the GPU's layers, CPU tensors in the interpreter): a 3-row
    verify through the fused kernels (forced on; the position a device tensor, as in a graph) gives
    the unfused logits, KV rows and rows' log, and commit(1) the same state; a conv wider than the
    fused GDN kernel holds (5 taps) takes the unfused GDN."""
    from specfire.config import ModelConfig
    from specfire.kernels.attention import fused as af
    from specfire.kernels.gdn import fused as gf
    from specfire.layers import CUDA
    from specfire.model.qwen35 import Qwen35Trunk

    ran = []
    for mod, name in ((gf, "gdn_rows_triton"), (af, "qk_norm_rope_write_triton")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: ran.append(name) or real(*a, **k))

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=conv)
    torch.manual_seed(0)
    m = Qwen35Trunk(cfg, CUDA)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    ids, draft = torch.randint(0, 64, (6,)), torch.randint(0, 64, (3,))
    outs = []
    for on in (False, True):
        for layer in m.layers:                         # the module's choice, forced for the interpreter
            (layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn).fused = on
        st = m.new_state(16, torch.float32)
        m(ids, 0, st, rows=False)
        h, logits = m(draft, torch.tensor([6]), st, rows=True)
        lin, att = st.layers
        outs.append((logits, *(x.clone() for x in lin.log), att.k[6:9].clone(), att.v[6:9].clone()))
        st.commit(1)                                   # the log replays into the state's own buffers
        outs[-1] += (lin.rec.clone(), lin.conv.clone())
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert ran == (["qk_norm_rope_write_triton"] if conv > 4 else ["gdn_rows_triton", "qk_norm_rope_write_triton"])
