"""The packed greedy draft chain's graphs (runtime/graphs.py PackedChains), emulated on the CPU with
the MTP head's fused kernels interpreted: a graph captured over head states A and re-pointed at
states B (its tables rewritten, its Segments still A's, as a replay's launches are) drafts what
B's own chain drafts and writes B's KV rows, bit for bit."""
from __future__ import annotations

import torch

from specfire.config import ModelConfig
from specfire.kernels import attention as A
from specfire.layers import CUDA
from specfire.model.cuda import FusedMtpHead
from specfire.runtime.drafters.chain import packed_chain_after
from specfire.runtime.graphs import PackedChains

CFG = ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                  layer_types=("full_attention",), num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                  linear_key_head_dim=8, linear_value_head_dim=8)
K = 3
POS = [5, 9, 2]               # each member's first verify row's position


def _head():
    torch.manual_seed(0)
    head = FusedMtpHead(CFG, CUDA)         # the GPU's head, on CPU tensors in the interpreter
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    head.fused = True
    head.layers[0].self_attn.fused = True
    return head


def _states(head, seed):
    """Three head states with random KV before their positions (a wrong cache read shows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in POS:
        st = head.new_state(24, torch.float32)
        lc = st.layers[0]
        lc.k[:p].copy_(torch.randn(lc.k[:p].shape, generator=g))
        lc.v[:p].copy_(torch.randn(lc.v[:p].shape, generator=g))
        out.append(st)
    return out


def _inputs(seed, pos):
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 40, (K + 1,), generator=g) for _ in pos]
    hidden = [torch.randn(K + 1, 64, generator=g) for _ in pos]
    n = [torch.tensor([i % (K + 1)]) for i in range(len(pos))]
    return toks, hidden, n


def test_a_packed_chain_re_pointed_at_other_head_states_drafts_theirs(monkeypatch):
    monkeypatch.setattr(A, "_use_kernel", lambda q: q.shape[-1] in A.KERNEL_HEAD_DIMS)
    head = _head()
    embed, lm = torch.randn(40, 64), torch.randn(40, 64)

    def chain(*a):
        return packed_chain_after(head, lambda h: h @ lm.T, None, embed, *a)

    a_states, b_states, b_ref = _states(head, 1), _states(head, 2), _states(head, 2)
    pos_b = [p + 2 for p in POS]        # B further on: the positions are the graph's inputs too
    chains = PackedChains(torch.device("cpu"), emulate=True)
    with torch.inference_mode():
        chains.run(chain, a_states, *_inputs(3, POS)[:2], POS, _inputs(3, POS)[2], K, "pre")
        assert chains.graphs and all(g.tables is not None for g in chains.graphs.values())
        toks, hidden, n = _inputs(4, pos_b)
        got = chains.run(chain, b_states, toks, hidden, pos_b, n, K, "pre")
        assert (chains.captures, chains.rebinds) == (1, 1)
        want = PackedChains(torch.device("cpu"), emulate=True).run(chain, b_ref, toks, hidden, pos_b, n, K, "pre")
    assert got.shape == (3, K) and torch.equal(got, want)
    for sb, sr, p in zip(b_states, b_ref, pos_b):
        end = p + K + 1 + K
        assert torch.equal(sb.layers[0].k[:end], sr.layers[0].k[:end])
        assert torch.equal(sb.layers[0].v[:end], sr.layers[0].v[:end])
