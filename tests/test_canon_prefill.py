"""Canonical prefill blocks: library calls (SDPA, batched products) on a fixed number of heads, so a
tensor-parallel rank's heads are computed exactly as those heads of the whole model (the GPU
dispatches to these blocks inside a canonical forward; here they run on the CPU)."""
import torch

from specfire.ops import attention as attn_ops
from specfire.ops import gdn as gdn_ops
from specfire.ops.splitk import head_block


def test_head_block_divides_every_degree_share():
    assert [head_block(h) for h in (48, 24, 16, 32, 4, 12, 2)] == [6, 3, 2, 4, 1, 1, 1]
    for whole in (48, 24, 16, 32, 8):
        for tp in (1, 2, 4, 8):
            assert (whole // tp) % head_block(whole) == 0


def test_attention_blocks_match_reference_and_shard_equals_whole():
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, t, pos0 = 12, 2, 16, 7, 5
    q = torch.randn(t, hq, d, generator=g)
    kc = torch.randn(pos0 + t + 3, hkv, d, generator=g)      # cache rows past the prompt: never read
    vc = torch.randn(pos0 + t + 3, hkv, d, generator=g)
    ref = attn_ops.attention_prefill_ref(q, kc, vc, pos0, d ** -0.5)
    for qb in (1, 2, 3, 6, 12, 5):                            # 5 fits neither way: one head a call
        whole = attn_ops.attention_prefill_blocks(q, kc, vc, pos0, d ** -0.5, qb)
        torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
        shard = attn_ops.attention_prefill_blocks(q[:, hq // 2:].contiguous(), kc[:, hkv // 2:].contiguous(),
                                                  vc[:, hkv // 2:].contiguous(), pos0, d ** -0.5, qb)
        assert torch.equal(shard, whole[:, hq // 2:])


def test_gdn_blocks_match_reference_and_shard_equals_whole():
    g = torch.Generator().manual_seed(1)
    t, hk, r, dk, dv = 37, 4, 3, 8, 8                          # 37 rows: a masked tail in the last chunk
    q = torch.randn(t, hk, dk, generator=g) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hk * r, dv, generator=g)
    gate = -torch.rand(t, hk * r, generator=g) * 0.2
    beta = torch.rand(t, hk * r, generator=g)
    state = torch.randn(hk * r, dk, dv, generator=g) * 0.1
    ref_o, ref_s = gdn_ops.gdn_chunked_ref(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, gate, beta,
                                           state, chunk=16)

    def blocks(lo: int, hi: int, kb: int):
        parts = [gdn_ops.gdn_chunked_block(q[:, lo:hi], k[:, lo:hi], v[:, lo * r:hi * r], gate[:, lo * r:hi * r],
                                           beta[:, lo * r:hi * r], state[lo * r:hi * r], 16, h0, h0 + kb, r)
                 for h0 in range(0, hi - lo, kb)]
        return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 0)

    for kb in (1, 2):
        o, s = blocks(0, hk, kb)
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)
        o2, s2 = blocks(hk // 2, hk, kb)                      # a tp2 rank's key heads
        assert torch.equal(o2, o[:, (hk // 2) * r:]) and torch.equal(s2, s[(hk // 2) * r:])
