"""Canonical prefill: attention's library call on a fixed number of heads, so a tensor-parallel
rank's heads are computed exactly as those heads of the whole model (the GPU dispatches to these
blocks inside a canonical forward; here they run on the CPU), and no autotuned GDN library there."""
import torch

from specfire.kernels import attention as attn_ops
from specfire.kernels import gdn as gdn_ops
from specfire.kernels.splitk import head_block


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


def test_canonical_gdn_prefill_never_takes_the_autotuned_library(monkeypatch):
    """flash-linear-attention autotunes per process, keyed by head count: a canonical forward must
    not use it even where it is installed (stand-in library that fails the test if called)."""
    from specfire.kernels.gdn import fla as gdn_fla
    called = []
    monkeypatch.setattr(gdn_fla, "use_for", lambda q: True)
    monkeypatch.setattr(gdn_fla, "gdn_chunked_fla", lambda *a, **k: called.append(1) or (None, None))
    g = torch.Generator().manual_seed(1)
    t, h, d = 9, 2, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    gate, beta = -torch.rand(t, h, generator=g), torch.rand(t, h, generator=g)
    state = torch.zeros(h, d, d)
    o, s = gdn_ops.gdn_chunked(q, k, v, gate, beta, state, canonical=True)
    assert not called and o.shape == (t, h, d)
    ref_o, ref_s = gdn_ops.gdn_chunked_ref(q, k, v, gate, beta, state)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    gdn_ops.gdn_chunked(q, k, v, gate, beta, state)          # the default takes the library
    assert called
