"""The packed-rows case shared by tests/test_packed_rows.py and tests/kernels/test_packed_fused.py:
three sequences' verifies (1, 4 and 2 rows) alone and in one packed forward, compared bit for bit."""
from __future__ import annotations

import torch

from specfire.config import ModelConfig
from specfire.layers import Target
from specfire.model.loader import build_trunk
from specfire.model.state import Segments

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                  layer_types=("linear_attention", "full_attention", "linear_attention"), num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
PROMPTS = [7, 3, 12]          # each sequence's prefill length
ROWS = [1, 4, 2]              # its verify rows (AR, k=3, k=1)
COMMIT = [0, 2, 1]


def model(target: Target, dtype: torch.dtype, fused: bool = False):
    torch.manual_seed(0)
    m = build_trunk(CFG, target)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    m = m.to(dtype)
    for layer in m.layers:                  # the GPU layers' choice, forced for the interpreter
        mix = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        if hasattr(type(mix), "fused"):
            mix.fused = fused
    return m


def states(m, dtype):
    g = torch.Generator().manual_seed(1)
    out = []
    for n in PROMPTS:
        st = m.new_state(32, dtype)
        m(torch.randint(0, 64, (n,), generator=g), 0, st, rows=False)
        out.append(st)
    return out


def snapshot(st, pos, rows):
    got = []
    for lc in st.layers:
        if lc.rec is not None:
            got += [x.clone() for x in lc.log] + [lc.rec.clone(), lc.conv.clone()]
        else:
            got += [x[pos:pos + rows].clone() for x in (lc.k, lc.v, lc.k_scale, lc.v_scale) if x is not None]
    return got


def after_commit(st, n):
    st.commit(n)
    return [t.clone() for lc in st.layers if lc.rec is not None for t in (lc.rec, lc.conv)]


def run(m, dtype):
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 64, (r,), generator=g) for r in ROWS]
    alone, packed = states(m, dtype), states(m, dtype)
    with torch.inference_mode():
        want = [m(x, p, st, rows=True) for x, p, st in zip(ids, PROMPTS, alone)]
        segs = Segments.of(packed, PROMPTS, ROWS)
        h, lg = m.packed(torch.cat(ids), segs)
        for (a, b), (wh, wl), sa, sp, p, r, n in zip(segs.spans, want, alone, packed, PROMPTS, ROWS, COMMIT):
            assert torch.equal(h[a:b], wh) and torch.equal(lg[a:b], wl)
            for x, y in zip(snapshot(sp, p, r), snapshot(sa, p, r)):
                assert torch.equal(x, y)
            for x, y in zip(after_commit(sp, n), after_commit(sa, n)):
                assert torch.equal(x, y)


