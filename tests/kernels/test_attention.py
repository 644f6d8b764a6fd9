"""Multi-row attention kernel (Triton, interpreted on the CPU in float32) vs the reference, row
invariance, the Q8 KV cache (round trip, kernel, end to end with greedy MTP == AR)."""

import pytest
import torch

from specfire.kernels import attention as A
from specfire.kernels.attention.kernel import attention_rows_triton

SMALL = dict(block_m=16, split=32, block_n=16)  # several spans and masked tails at small sizes
MANY = dict(block_m=16, split=16, block_n=16, chunk=2)  # several combine chunks


def _cache(n, hkv, d, q8, gen, group=32):
    """q8: the grouped format (scales per `group` elements, values head_dim-contiguous); the cache's
    own format (one scale per position and head, values key-minor) is tested by the q8t tests."""
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    if not q8:
        return k, v, None, None
    kq, ks = A.quantize_q8(k, group)
    vq, vs = A.quantize_q8(v, group)
    return kq, vq, ks, vs


def _token_cache(n, hkv, d, gen, layout):
    """Per-token Q8 cache; layout: 'pad' = the cache's key-minor values (storage padded to whole key
    blocks), 'tight' = key-minor with no padding (masked value loads), 'rows' = head_dim-contiguous."""
    kq, ks = A.quantize_q8(torch.randn(n, hkv, d, generator=gen) * 3)
    vq, vs = A.quantize_q8(torch.randn(n, hkv, d, generator=gen))
    if layout == "pad":
        vc = A.q8_value_cache(n, hkv, d, "cpu")
        vc.copy_(vq)
    elif layout == "tight":
        vc = vq.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    else:
        vc = vq
    return kq, vc, ks, vs


def _ref(q, kc, vc, pos0, scale, ks, vs):
    if ks is None:
        return A.attention_rows_ref(q, kc, vc, pos0, scale)
    return A.attention_rows_q8_ref(q, kc, vc, pos0, scale, ks, vs)


@pytest.mark.parametrize("kw", [SMALL, MANY], ids=["small", "many"])
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("hq,hkv,d,rows,pos0", [(6, 2, 32, 1, 0), (6, 2, 32, 5, 61), (3, 3, 16, 3, 31),
                                                (8, 1, 64, 7, 45)])
def test_kernel_matches_reference(q8, hq, hkv, d, rows, pos0, kw):
    gen = torch.Generator().manual_seed(hq * 1000 + rows * 10 + pos0)
    kc, vc, ks, vs = _cache(pos0 + rows + 9, hkv, d, q8, gen)   # rows past the last position hold junk
    q = torch.randn(rows, hq, d, generator=gen) * 2
    scale = d ** -0.5
    out = attention_rows_triton(q, kc, vc, pos0, scale, ks, vs, **kw)
    ref = _ref(q, kc, vc, pos0, scale, ks, vs)
    assert out.dtype == torch.float32 and out.shape == (rows, hq, d)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("q8,kw", [(False, SMALL), (False, MANY), (True, SMALL)],
                         ids=["bf-small", "bf-many", "q8group-small"])   # per-token Q8: test_q8t_row_invariant
def test_kernel_row_invariant(q8, kw):
    """Row r of a verify call equals a one-row decode at its position, bit for bit: spans, masking
    and the combine never depend on R. Here a row fills exactly one tile (rep == block_m), because
    the interpreter's matmul (numpy) may round a row differently by its slot in the tile; the
    packed layout (several rows per tile) runs on the GPU only."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, pos0, rows = 16, 1, 32, 37, 4
    kc, vc, ks, vs = _cache(pos0 + rows, hkv, d, q8, gen)
    q = torch.randn(rows, hq, d, generator=gen)
    out = attention_rows_triton(q, kc, vc, pos0, 0.2, ks, vs, **kw)
    for r in range(rows):
        one = attention_rows_triton(q[r:r + 1], kc, vc, pos0 + r, 0.2, ks, vs, **kw)
        assert torch.equal(one[0], out[r]), r
    # the same rows computed in two smaller calls
    part = attention_rows_triton(q[2:], kc, vc, pos0 + 2, 0.2, ks, vs, **kw)
    assert torch.equal(part, out[2:])


def test_q8_round_trip():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 64, generator=gen) * torch.logspace(-3, 2, 64)
    x[1, 1, :32] = 0.0                                            # an all-zero group
    q, s = A.quantize_q8(x, 32)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (5, 3, 2)
    assert q.abs().max() <= 127
    y = A.dequantize_q8(q, s)
    err = (y - x).abs().reshape(5, 3, 2, 32)
    bound = s.float()[..., None] * 0.5 * (1 + 1e-3) + 1e-7        # half a step, fp16 scale rounding
    assert (err <= bound).all()
    assert torch.equal(y[1, 1, :32], torch.zeros(32))
    q2, s2 = A.quantize_q8(y, 32)                                  # quantized values are fixed points
    assert torch.equal(A.dequantize_q8(q2, s2), y)
    qt, st = A.quantize_q8(x)                                      # the cache's format: one scale per row
    assert st.shape == (5, 3, 1) and torch.equal(A.quantize_q8(A.dequantize_q8(qt, st))[0], qt)


def test_q8_group_validation():
    assert A.q8_group(256) == 256 and A.q8_group(256, 32) == 32 and A.q8_group(16, 32) == 16
    with pytest.raises(ValueError, match="head_dim"):
        A.q8_group(48, 32)


def test_kv_write_q8_and_public_routing():
    from specfire.model.qwen35 import LayerCache
    gen = torch.Generator().manual_seed(11)
    n, hkv, d = 20, 2, 32
    lc = LayerCache(k=torch.zeros(n, hkv, d, dtype=A.Q8_KV), v=torch.zeros(n, hkv, d, dtype=A.Q8_KV),
                    k_scale=torch.zeros(n, hkv, 1, dtype=torch.float16),
                    v_scale=torch.zeros(n, hkv, 1, dtype=torch.float16))
    k = torch.randn(6, hkv, d, generator=gen)
    v = torch.randn(6, hkv, d, generator=gen)
    A.kv_write(lc, 4, k, v)
    kq, ks = A.quantize_q8(k)
    assert torch.equal(lc.k[4:10], kq) and torch.equal(lc.k_scale[4:10], ks)
    assert (lc.k[:4] == 0).all() and (lc.k[10:] == 0).all()
    q = torch.randn(2, 4, d, generator=gen)
    out = A.attention_rows(q, lc.k, lc.v, 8, 0.3, lc.k_scale, lc.v_scale)
    ref = A.attention_rows_ref(q, A.dequantize_q8(lc.k, lc.k_scale), A.dequantize_q8(lc.v, lc.v_scale), 8, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    pre = A.attention_prefill(q, lc.k, lc.v, 8, 0.3, lc.k_scale, lc.v_scale)
    torch.testing.assert_close(pre, ref, rtol=1e-5, atol=1e-5)


def test_llm_q8_greedy_mtp_equals_ar(tmp_path, ckpt_cache):
    from tinymodels import make_checkpoint
    from specfire import LLM, SamplingParams, SpecPolicy
    path = make_checkpoint(str(tmp_path / "mha"), "mha", seed=5)
    prompt = [3, 17, 42, 9, 100, 5, 77, 21]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(path, device="cpu", kv_dtype="q8", progress=False) as llm:
        state = llm.engine.trunk.state
        attn = [lc for lc in state.layers if lc.k is not None]
        assert attn and all(lc.k.dtype == torch.int8 and lc.k_scale is not None for lc in attn)
        ar = llm.generate(prompt, sp, spec=SpecPolicy(mode="off"))
        mtp = llm.generate(prompt, sp, spec=SpecPolicy(mode="mtp", k=3))
        lq = llm.score(prompt + ar.token_ids)
    assert len(ar.token_ids) == 24 or ar.finish_reason == "stop"
    assert mtp.token_ids == ar.token_ids
    assert mtp.stats["route"] == "mtp" and mtp.stats["cycles"] > 0
    with LLM(path, device="cpu", kv_dtype="fp32", progress=False) as llm:
        lf = llm.score(prompt + ar.token_ids)
    rel = ((lq - lf).norm() / lf.norm()).item()
    assert 0 < rel < 0.05, rel          # the cache really is quantized, and only slightly perturbs logits


def test_q8_asm_conversion_model():
    """The inline-PTX int8 -> fp16 conversion (modelled bit for bit): element i of the word becomes
    fp16 1024 + 128 + v_i exactly, for every int8 v the cache holds (-127..127)."""
    from specfire.kernels.attention.device import asm_q8_emulate

    vals = list(range(-127, 128))
    for i in range(0, len(vals), 4):
        quad = (vals[i:i + 4] + [0, 0, 0])[:4]
        word = sum((v & 255) << (8 * j) for j, v in enumerate(quad))
        bits = asm_q8_emulate(word)
        got = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16).float() - 1152.0
        assert got.tolist() == [float(v) for v in quad]


@pytest.mark.parametrize("kw", [SMALL], ids=["small"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_q8_fp16_path(kw, dtype):
    """16-bit queries on a Q8 cache take the fp16 path (codes by the magic-number trick, fp16 MMAs):
    near the float32 reference, and row-invariant bit for bit (one row per tile, as above). bf16
    queries are converted to fp16 as they are loaded, so the interpreter computes no bf16 math."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, pos0, rows = 16, 1, 64, 45, 4
    kc, vc, ks, vs = _cache(pos0 + rows + 5, hkv, d, True, gen)
    q = (torch.randn(rows, hq, d, generator=gen) * 2).to(dtype)
    out = attention_rows_triton(q, kc, vc, pos0, d ** -0.5, ks, vs, **kw)
    ref = A.attention_rows_q8_ref(q.float(), kc, vc, pos0, d ** -0.5, ks, vs)
    assert float((out - ref).norm() / ref.norm()) < 2e-3
    for r in range(rows):
        one = attention_rows_triton(q[r:r + 1], kc, vc, pos0 + r, d ** -0.5, ks, vs, **kw)
        assert torch.equal(one[0], out[r]), r


Q8T = [((6, 2, 32, 5, 61), "pad", SMALL), ((3, 3, 16, 3, 31), "tight", SMALL), ((8, 1, 64, 7, 45), "rows", MANY),
       ((6, 2, 32, 1, 0), "tight", MANY)]


@pytest.mark.parametrize("shape,layout,kw", Q8T, ids=["pad", "tight", "rows", "one-key"])
def test_q8t_kernel_matches_reference(shape, layout, kw):
    """The per-token Q8 kernel (scores x key scale, p x value scale, fp16 MMAs on the exact codes)
    near the float32 reference of the dequantized cache, for each value layout; odd head counts,
    masked key tails (span and block ends inside the rows), junk rows past the last position."""
    hq, hkv, d, rows, pos0 = shape
    gen = torch.Generator().manual_seed(hq * 100 + pos0)
    kc, vc, ks, vs = _token_cache(pos0 + rows + 9, hkv, d, gen, layout)
    assert ks.shape[-1] == 1 and (layout == "rows") == (vc.stride(-1) == 1)
    q = (torch.randn(rows, hq, d, generator=gen) * 2).to(torch.bfloat16)
    out = attention_rows_triton(q, kc, vc, pos0, d ** -0.5, ks, vs, **kw)
    ref = A.attention_rows_q8_ref(q.float(), kc, vc, pos0, d ** -0.5, ks, vs)
    assert out.shape == (rows, hq, d) and float((out - ref).norm() / ref.norm()) < 2e-3


def test_q8t_row_invariant():
    """Per-token Q8 rows: row r of an R-row call == a one-row call at its position, bit for bit
    (key-minor values, masked value loads; one row per tile, as in test_kernel_row_invariant)."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, pos0, rows = 16, 1, 16, 21, 3
    kc, vc, ks, vs = _token_cache(pos0 + rows, hkv, d, gen, "tight")
    q = torch.randn(rows, hq, d, generator=gen).half()
    out = attention_rows_triton(q, kc, vc, pos0, 0.2, ks, vs, **SMALL)
    for r in range(rows):
        one = attention_rows_triton(q[r:r + 1], kc, vc, pos0 + r, 0.2, ks, vs, **SMALL)
        assert torch.equal(one[0], out[r]), r


def test_q8_cache_layout_write_and_snapshot():
    """The Q8 cache: per-token scales, values key-minor under a [max_seq, n_kv, D] view; kv_write
    (int and device-tensor positions) and a prefix snapshot / restore see ordinary rows."""
    from specfire.model.state import LayerCache
    from specfire.runtime.prefix import Snapshot, restore, take

    n, hkv, d = 70, 2, 32
    v = A.q8_value_cache(n, hkv, d, "cpu")
    assert v.shape == (n, hkv, d) and v.stride(0) == 1 and v.untyped_storage().nbytes() == hkv * d * 128
    lc = LayerCache(k=torch.zeros(n, hkv, d, dtype=A.Q8_KV), v=v, k_scale=torch.zeros(n, hkv, 1, dtype=torch.float16),
                    v_scale=torch.zeros(n, hkv, 1, dtype=torch.float16))
    gen = torch.Generator().manual_seed(5)
    k, vv = torch.randn(9, hkv, d, generator=gen), torch.randn(9, hkv, d, generator=gen)
    A.kv_write(lc, 3, k[:5], vv[:5])
    A.kv_write(lc, torch.tensor([8]), k[5:], vv[5:])
    vq, vsc = A.quantize_q8(vv)
    assert torch.equal(lc.v[3:12], vq) and torch.equal(lc.v_scale[3:12], vsc)
    assert torch.equal(A.dequantize_q8(lc.k[3:12], lc.k_scale[3:12]), A.dequantize_q8(*A.quantize_q8(k)))

    class _S:
        layers = [lc]

        @staticmethod
        def grow(n):            # a contiguous cache holds every position already
            pass
    snap = take(_S, list(range(12)), torch.zeros(12, 4))
    lc.v[:12].fill_(7)
    restore(_S, snap)
    assert torch.equal(lc.v[3:12], vq) and isinstance(snap, Snapshot)
