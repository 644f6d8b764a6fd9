"""The MTP head's fused rows step (kernels/head), interpreted on the CPU: the fc-input kernel
against its reference and bit for bit against the RMSNorm kernels it replaces (odd widths, masked
block tails, strided hidden rows), its folded group sums, the rotary table's rows against
`rope_cos_sin` at those positions, the q/k kernel reading the table == reading the gathered rows,
and the head's rows forward (fused step forced on) == the unfused one."""

import pytest
import torch

from specfire.kernels import head as head_fused
from specfire.kernels.head import kernel as head_kernel
from specfire.kernels import xsum
from specfire.kernels.norm import kernel as nk
from specfire.kernels.attention import fused as af
from specfire.kernels.attention.fused import qk_norm_rope_write_triton
from specfire.kernels.small import rope_cos_sin


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _fc_inputs(r, d, v, dtype, seed, stride_pad=0):
    g = _g(seed)
    table = (torch.randn(v, d, generator=g) * 2).to(dtype)
    hidden = (torch.randn(r, d + stride_pad, generator=g) * 3).to(dtype)[:, :d]      # a row stride past d
    we = (torch.randn(d, generator=g) * 0.3).to(dtype)
    wh = (torch.randn(d, generator=g) * 0.3).to(dtype)
    ids = torch.randint(0, v, (r,), generator=g)
    return ids, table, hidden, we, wh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,d,v,pad", [(1, 96, 7, 0), (3, 200, 11, 5), (4, 256, 5, 3), (2, 384, 9, 0)])
def test_fc_input_matches_reference_and_the_norm_kernels(r, d, v, pad, dtype, monkeypatch):
    monkeypatch.setattr(xsum, "_CONSUMERS", set())          # no 4-bit consumer: no group sums
    ids, table, hidden, we, wh = _fc_inputs(r, d, v, dtype, seed=r * d + v, stride_pad=pad)
    y = head_kernel.fc_input_triton(ids, table, hidden, we, wh, 1e-6, 2e-6)
    ref = head_fused.fc_input_ref(ids, table, hidden, we, wh, 1e-6, 2e-6)
    assert y.shape == (r, 2 * d) and y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    # the launches it replaces: the two norm kernels over the gathered and the hidden rows, bit for bit
    unfused = torch.cat([nk.rms_norm_triton(table[ids], we, 1e-6), nk.rms_norm_triton(hidden, wh, 2e-6)], -1)
    assert torch.equal(y, unfused)
    for i in range(r):                                       # row-invariant
        assert torch.equal(head_kernel.fc_input_triton(ids[i:i + 1], table, hidden[i:i + 1], we, wh, 1e-6, 2e-6),
                           y[i:i + 1])


@pytest.mark.parametrize("r,d", [(1, 128), (3, 256), (2, 384)])     # 384: a masked block tail (512)
def test_fc_input_folds_the_group_sums(r, d, monkeypatch):
    monkeypatch.setattr(xsum, "_CONSUMERS", {"cpu"})
    ids, table, hidden, we, wh = _fc_inputs(r, d, 13, torch.bfloat16, seed=d + r)
    y = head_kernel.fc_input_triton(ids, table, hidden, we, wh, 1e-6, 1e-6)
    xs = xsum.take(y, xsum.G)
    assert xs is not None and xs.shape == (r, 2 * d // xsum.G)
    torch.testing.assert_close(xs.reshape(-1), xsum.group_sums_ref(y), rtol=1e-5, atol=1e-4)
    # a width that is not a whole number of groups carries none
    ids, table, hidden, we, wh = _fc_inputs(r, 200, 13, torch.bfloat16, seed=3)
    assert xsum.take(head_kernel.fc_input_triton(ids, table, hidden, we, wh, 1e-6, 1e-6), xsum.G) is None


def test_fc_input_rejects_bad_shapes():
    ids, table, hidden, we, wh = _fc_inputs(2, 64, 5, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        head_kernel.fc_input_triton(ids[:1], table, hidden, we, wh, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        head_kernel.fc_input_triton(ids, table[:, :32], hidden, we, wh, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="embedding is"):
        head_kernel.fc_input_triton(ids, table.to(torch.bfloat16), hidden, we, wh, 1e-6, 1e-6)


def test_rope_table_rows_are_rope_cos_sin():
    head_fused._TABLES.clear()
    cos, sin = head_fused.rope_table(torch.device("cpu"), 10, 1e6, 50)
    assert cos.shape == (50, 10) and sin.shape == (50, 10)
    for p in (0, 1, 17, 49):
        c, s = rope_cos_sin(torch.tensor([p]), 10, 1e6)
        assert torch.equal(cos[p:p + 1], c) and torch.equal(sin[p:p + 1], s)
    assert head_fused.rope_table(torch.device("cpu"), 10, 1e6, 20)[0] is cos     # a longer one serves
    assert head_fused.rope_table(torch.device("cpu"), 10, 1e6, 60)[0].shape[0] == 60
    assert any(t[0] is cos for t in head_fused._RETIRED)       # the outgrown one stays allocated


@pytest.mark.parametrize("t,hq,hkv,d,r", [(1, 4, 2, 16, 8), (3, 6, 2, 12, 6), (4, 3, 1, 20, 20)])
@pytest.mark.parametrize("tensor_pos", [False, True])
def test_qk_kernel_reads_the_table_at_the_positions(t, hq, hkv, d, r, tensor_pos):
    g = _g(t * d + r)
    dtype = torch.bfloat16
    qg = torch.randn(t, hq, 2 * d, generator=g).to(dtype)
    kx = torch.randn(t, hkv, d, generator=g).to(dtype)
    vx = torch.randn(t, hkv, d, generator=g).to(dtype)
    qw = (torch.randn(d, generator=g) * 0.1).to(dtype)
    kw = (torch.randn(d, generator=g) * 0.1).to(dtype)
    n, p0 = 23, 9
    cos, sin = rope_cos_sin(torch.arange(n), r, 1e4)
    kc = torch.randn(n, hkv, d, generator=g).to(dtype)
    vc = torch.randn(n, hkv, d, generator=g).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    pos = torch.tensor([p0]) if tensor_pos else p0
    q = qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, kc, vc, pos, table=True)
    q2 = qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos[p0:p0 + t], sin[p0:p0 + t], kc2, vc2, pos)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with pytest.raises(ValueError, match="past the rotary table"):
        qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos[:p0 + t - 1], sin[:p0 + t - 1], kc, vc, p0,
                                  table=True)


def test_head_rows_step_fused_equals_unfused(monkeypatch):
    """MtpHead's rows forward over 3 rows then 1 (the chain's catch-up and a step) with the fused
    step forced on (ids + embedding, the rotary table, the fused q/k kernel) gives the unfused
    path's outputs and KV rows."""
    from specfire.config import ModelConfig
    from specfire.layers import CUDA
    from specfire.model.cuda import FusedMtpHead

    cfg = ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                      layer_types=("full_attention",), num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(0)
    head = FusedMtpHead(cfg, CUDA)         # the GPU's head, on CPU tensors in the interpreter
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    embed = torch.randn(40, 64)
    ids, hid = torch.randint(0, 40, (4,)), torch.randn(4, 64)
    head_fused._TABLES.clear()
    outs = []
    head.layers[0].self_attn.fused = True                      # the fused attention kernels, interpreted
    for on in (False, True):
        head.fused = on
        st = head.new_state(16, torch.float32)
        a = head(None, hid[:3], 2, st, rows=True, ids=ids[:3], embed_weight=embed)
        b = head(None, a[1][-1:], torch.tensor([5]), st, rows=True, ids=ids[3:], embed_weight=embed)
        outs.append((*a, *b, st.layers[0].k[2:6].clone(), st.layers[0].v[2:6].clone()))
    assert head_fused._TABLES, "the fused step built no rotary table"
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        head(embed[ids[:1]], hid[:1], 2, st, rows=True, ids=ids[:1], embed_weight=embed)


@pytest.mark.parametrize("t,pos0", [(7, 0), (5, 3)])
def test_head_prompt_catchup_fused_equals_unfused(t, pos0, monkeypatch):
    """MtpHead's prefill-mode forward (the prompt catch-up) with the catch-up's kernels forced on
    (ids + embedding through fc_input, the rotary table, the fused q/k kernel, the fused output
    gate around the prefill attention) gives the unfused prefill path's outputs and KV rows, at an
    odd row count and a later start; the head's next rows step reads them alike."""
    from specfire.config import ModelConfig
    from specfire.layers import CUDA
    from specfire.model.cuda import FusedMtpHead

    cfg = ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                      layer_types=("full_attention",), num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5)
    torch.manual_seed(1)
    head = FusedMtpHead(cfg, CUDA)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    embed = torch.randn(40, 64)
    ids, hid = torch.randint(0, 40, (t + 1,)), torch.randn(t + 1, 64)
    head_fused._TABLES.clear()
    calls = []
    real_fc, real_gate = head_fused.fc_input, af.out_gate_triton
    monkeypatch.setattr(head_fused, "fc_input", lambda *a: calls.append("fc") or real_fc(*a))
    monkeypatch.setattr(af, "out_gate_triton", lambda *a: calls.append("gate") or real_gate(*a))
    head.layers[0].self_attn.fused = True                      # the fused attention kernels, interpreted
    outs = []
    for on in (False, True):
        head.fused = on
        st = head.new_state(16, torch.float32)
        if pos0:                          # earlier KV rows, as a later catch-up finds them
            head(embed[ids[:pos0]], hid[:pos0], 0, st, rows=False)
        calls.clear()
        a = head(None, hid[pos0:t], pos0, st, rows=False, ids=ids[pos0:t], embed_weight=embed)
        seen = list(calls)                # the catch-up's kernels (the rows step's attention has its own)
        head.fused = False                # the rows step below: the unfused head step both times
        b = head(embed[ids[t:]], a[1][-1:], t, st, rows=True)
        outs.append((*a, *b, st.layers[0].k[:t + 1].clone(), st.layers[0].v[:t + 1].clone()))
        if not on:
            assert not seen, "the catch-up took the fused kernels while switched off"
    assert "fc" in seen and "gate" in seen, f"the fused catch-up did not run its kernels: {seen}"
    assert head_fused._TABLES, "the fused catch-up built no rotary table"
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_trunk_prefill_never_takes_the_catchup_kernels():
    """A rotary table in prefill mode is the head's catch-up alone: the trunk's prefill keeps its
    own path (its attention layers see cos / sin, not a table), and a table given to a layer
    whose fused kernels are off is refused."""
    from specfire.config import ModelConfig
    from specfire.layers import CUDA
    from specfire.layers.attention import FusedGatedAttention
    from specfire.model.qwen35 import SequenceState

    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      layer_types=("full_attention",), num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8)
    attn = FusedGatedAttention(cfg, CUDA)
    st = SequenceState.allocate(cfg, ("full_attention",), 8, torch.device("cpu"), torch.float32)
    table = head_fused.RopeTable(rope_cos_sin(torch.arange(8), cfg.rotary_dim, cfg.rope_theta))
    attn.fused = False
    with pytest.raises(ValueError, match="rotary table"):
        attn(torch.randn(3, 32), 0, table, st.layers[0], rows=False)


@pytest.mark.parametrize("attn_fused", [False, True])
def test_greedy_mtp_with_the_fused_head_step_equals_ar(ckpt_cache, attn_fused, monkeypatch):
    """The drafter's wiring (the trunk's embedding handed to the head, the unwidened lm_head
    scores for the argmax): greedy MTP k=3 on the fitted model with the GPU's head (its fused step
    forced on, and, attn_fused, the fused attention kernels reading the rotary table) equals AR,
    eagerly and with the chain in emulated graphs, which draft alike; the drafts are those of the
    unfused path and are accepted as often."""
    from dataclasses import replace

    import specfit
    from specfire import LLM, SamplingParams
    from specfire.layers.attention import FusedGatedAttention
    from specfire.model import loader
    from specfire.model.cuda import FusedMtpHead
    from specfire.runtime.graphs import DraftGraphs

    path = specfit.fitted_checkpoint(ckpt_cache["shared"])      # fitted (if first) with the CPU's head
    monkeypatch.setattr(loader, "build_head",      # the GPU's head on the CPU trunk (interpreted kernels)
                        lambda cfg, target: FusedMtpHead(cfg, replace(target, attention=FusedGatedAttention)))
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    ps = specfit.prompts(1, seed=3)      # one prompt: each generate interprets every chain step's kernels
    with LLM(path, device="cpu", progress=False) as llm:
        ar = [llm.generate(p, sp, spec="off").token_ids for p in ps]
        d = llm.engine.drafters["mtp"]

        def run(graphs: bool):
            d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
            _, calls = specfit.spy_drafts(llm)
            try:
                out = [llm.generate(p, sp, spec={"mode": "mtp", "k": 3}) for p in ps]
            finally:
                d.graphs = None
                del d.propose
            return [r.token_ids for r in out], sum(r.stats["accepted"] for r in out), calls

        base = run(False)
        calls = []
        real_fc = head_fused.fc_input
        monkeypatch.setattr(head_fused, "fc_input", lambda *a: calls.append(1) or real_fc(*a))
        d.head.fused = True      # the head's rows step and prompt catch-up, interpreted
        if attn_fused:           # the head's fused attention kernels too (interpreted), reading the table
            d.head.layers[0].self_attn.fused = True
            monkeypatch.setattr(head_fused, "fc_input", lambda *a: calls.append(a[0].shape[0]) or real_fc(*a))
        eager, graphed = run(False), run(True)
    assert base[0] == ar and base[1] > 0
    assert calls, "the fused head step never ran"
    if attn_fused:
        assert max(calls) > 3, "the prompt catch-up never took the fused kernels"
    for out, acc, drafts in (eager, graphed):
        assert out == ar
        assert drafts == base[2] and acc == base[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1, 64), (37, 64), (200, 64), (1000, 128), (513, 8192)])
def test_pick_is_argmax(n, block, dtype, monkeypatch):
    """The chain's pick (argmax + the draft's write + the next position), over loops of blocks and
    masked tails: ties to the first index, a NaN wins (the first one), all -inf picks 0."""
    monkeypatch.setattr(head_kernel, "PICK_BLOCK", block)
    g = _g(n + block)
    cases = [torch.randn(n, generator=g)]
    x = torch.randint(-3, 3, (n,), generator=g).float()        # many ties
    cases.append(x)
    if n > 5:
        y = torch.randn(n, generator=g)
        y[n // 2], y[n - 2] = float("nan"), float("nan")
        cases.append(y)
        cases.append(torch.full((n,), float("-inf")))
        z = torch.randn(n, generator=g)
        z[n - 1] = 50.0                                        # the maximum in the masked tail's block
        cases.append(z)
    for c in cases:
        logits = c.to(dtype)[None]
        out, ref_out = torch.full((3,), -1, dtype=torch.long), torch.full((3,), -1, dtype=torch.long)
        for pos in (7, torch.tensor([7]), None):
            tok, p = head_kernel.pick_triton(logits, out, 1, pos)
            rtok, rp = head_fused.pick_ref(logits, ref_out, 1, pos)
            assert torch.equal(out, ref_out) and out[0] == -1 and out[2] == -1
            assert tok.data_ptr() == out[1:].data_ptr() and torch.equal(tok, rtok)
            if pos is None:
                assert p is None
            else:
                assert int(p) == 8 and isinstance(p, torch.Tensor) == isinstance(pos, torch.Tensor)


def test_pick_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one contiguous row"):
        head_kernel.pick_triton(torch.randn(2, 8), torch.zeros(3, dtype=torch.long), 0, 1)
    with pytest.raises(ValueError, match="int64"):
        head_kernel.pick_triton(torch.randn(1, 8), torch.zeros(3, dtype=torch.long), 3, 1)


@pytest.mark.parametrize("r,h", [(4, 1500), (1, 64), (3, 2049)])
@pytest.mark.parametrize("tensor_pos", [False, True])
def test_select_is_index_select(r, h, tensor_pos):
    g = _g(r * h)
    pre = torch.randn(r, h + 3, generator=g).to(torch.bfloat16)[:, :h]        # a row stride past h
    post = torch.randn(r, h, generator=g).to(torch.bfloat16)
    for i in range(r):
        n = torch.tensor([i])
        pos = torch.tensor([11]) if tensor_pos else 11
        a, b, p = head_kernel.select_triton(pre, post, n, pos)
        ra, rb, rp = head_fused.select_ref(pre, post, n, pos)
        assert torch.equal(a, ra) and torch.equal(b, rb) and torch.equal(p.reshape(-1), torch.as_tensor(rp).reshape(-1))


def test_pick_dispatch_sends_a_whole_vocabulary_to_torch(monkeypatch):
    calls = []
    real = head_kernel.pick_triton
    monkeypatch.setattr(head_kernel, "pick_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(head_fused, "PICK_MAX", 100)
    out = torch.zeros(2, dtype=torch.long)
    x = torch.randn(1, 150)
    tok, p = head_fused.pick(x, out, 0, 4)
    assert calls == [] and int(tok) == int(x.argmax()) and p == 5 and tok.data_ptr() == out.data_ptr()
    tok, p = head_fused.pick(x[:, :100].contiguous(), out, 1, None)
    assert calls == [1] and int(tok) == int(x[:, :100].argmax()) and p is None


def test_local_trunk_hands_only_a_plain_embedding():
    """A mesh rank's vocabulary-parallel embedding is not a table the head may gather from."""
    import types

    from specfire.runtime.trunk import LocalTrunk

    plain = torch.nn.Embedding(5, 4)
    t = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=plain))
    assert LocalTrunk.embed_weight.fget(t) is plain.weight

    class Sharded(torch.nn.Embedding):
        pass
    t.model.embed_tokens = Sharded(5, 4)
    assert LocalTrunk.embed_weight.fget(t) is None
