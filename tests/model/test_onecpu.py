"""One CPU device (no mesh, tp_invariant off): the plain fast products and norms, and verify rows
batched only where every row keeps the bits it gets alone, so greedy speculation still equals AR."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinymodels import make_checkpoint

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.config import ModelConfig
from specfire.kernels.gemv import linear
from specfire.kernels.small import silu_mul
from specfire.layers import CPU, CPU_EXACT
from specfire.layers.gdn import CpuGatedDeltaNet
from specfire.layers.norm import CpuGatedRMSNorm, CpuRMSNorm
from specfire.layers.rows import BATCHED, PER_ROW, whole_steps
from specfire.model import cpu
from specfire.model.qwen35 import Qwen35Trunk


def test_one_cpu_device_is_plain_unless_tp_invariant(monkeypatch):
    """The layers are picked when the model is loaded: one CPU device's plain products and norms,
    with LLM(tp_invariant=True) the canonical exact ones (what a mesh rank computes), the MTP
    head's too."""
    x = torch.randn(3, 64)
    w = torch.randn(48, 64)
    assert torch.equal(linear(x, w, rows=True), torch.cat([x[i:i + 1] @ w.t().contiguous() for i in range(3)]))
    torch.testing.assert_close(linear(x, w, rows=True, exact=True), x @ w.t(), rtol=1e-5, atol=1e-5)
    calls = []
    real = CpuRMSNorm.norm
    monkeypatch.setattr(CpuRMSNorm, "norm", lambda *a: calls.append(1) or real(*a))
    with LLM(_ckpt(), device="cpu", progress=False) as llm:
        assert not llm.tp_invariant
        assert llm.engine.trunk.model.target is CPU and isinstance(llm.engine.trunk.model, cpu.CpuQwen35Trunk)
        assert llm.engine.drafters["mtp"].head.target is CPU
        llm.score([1, 2, 3])
        assert calls                               # the one-device norms
    calls.clear()
    with LLM(_ckpt(), device="cpu", progress=False, tp_invariant=True) as llm:
        model = llm.engine.trunk.model
        assert llm.tp_invariant and model.target is CPU_EXACT and type(model) is Qwen35Trunk
        assert llm.engine.drafters["mtp"].head.target is CPU_EXACT
        llm.score([1, 2, 3])
    assert not calls                               # the canonical math keeps the reference


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_tp_invariant_is_a_bool(bad):
    """A typed option: anything but True or False is refused before the model loads, naming it."""
    with pytest.raises(ValueError, match=rf"^tp_invariant must be True or False, got {bad!r}$"):
        LLM(_ckpt(), device="cpu", progress=False, tp_invariant=bad)


def _tiny_gdn(dk: int) -> CpuGatedDeltaNet:
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      layer_types=("linear_attention",), num_attention_heads=1, num_key_value_heads=1,
                      head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=dk, linear_value_head_dim=dk)
    return CpuGatedDeltaNet(cfg, CPU)


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_rows_alone(threads):
    """Each batched one-device row op gives every row of T = 2..11 the bits of that row alone."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        n256, gn64 = CpuRMSNorm(256, 1e-6), CpuGatedRMSNorm(64, 1e-6)
        with torch.no_grad():
            n256.weight.copy_(torch.randn(256, generator=g) * 0.1)
            gn64.weight.copy_(torch.randn(64, generator=g))
        gdn = _tiny_gdn(64)
        fns = {
            "add_rms_norm": (n256.add_norm, (256, 256)),
            "rms_norm": (n256.norm, (256,)),
            "silu_mul": (silu_mul, (512, 512)),
            "sigmoid": (torch.sigmoid, (192,)),
            "gated_norm": (gn64.norm, ((4, 64), (4, 64))),
            "l2norm_qk": (gdn.qk_norm, ((2, 64), (2, 64))),
        }
        for name, (fn, shapes) in fns.items():
            for t in range(2, 12):
                xs = [torch.randn(t, *(s if isinstance(s, tuple) else (s,)), generator=g) * 3 for s in shapes]
                assert whole_steps(*xs)
                got = BATCHED(fn, True, *xs)
                want = PER_ROW(fn, True, *xs)
                for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                    assert torch.equal(a, b), (name, t)
        # a row width off the vector step is never batched
        assert not whole_steps(torch.randn(4, 96 + 4))
    finally:
        torch.set_num_threads(old)


def test_rms_norm_rows_are_independent_of_the_row_count():
    """torch's rms_norm (the batched norms rest on it) at odd widths too."""
    g = torch.Generator().manual_seed(3)
    for n in (64, 131, 256):
        w = torch.randn(n, generator=g)
        x = torch.randn(11, n, generator=g) * (10 ** torch.randn(11, 1, generator=g))
        whole = F.rms_norm(x, (n,), w, 1e-6)
        assert all(torch.equal(whole[i:i + 1], F.rms_norm(x[i:i + 1].clone(), (n,), w, 1e-6)) for i in range(11))


_PATH: list[str] = []


def _ckpt() -> str:
    """Widths on whole vector steps, so a verify takes every batched path."""
    if not _PATH:
        import tempfile
        _PATH.append(make_checkpoint(tempfile.mkdtemp(prefix="onecpu-"), "base", seed=4, hidden_size=64,
                                     intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2,
                                     linear_key_head_dim=64, linear_value_head_dim=64))
    return _PATH[0]


def _verify_equals_decodes(llm, threads: int) -> None:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tr = llm.engine.trunk
        g = torch.Generator().manual_seed(threads)
        prompt = torch.randint(0, llm.cfg.vocab_size - 1, (9,), generator=g)
        rows = torch.randint(0, llm.cfg.vocab_size - 1, (7,), generator=g)
        tr.begin()
        tr.prefill(prompt)
        ref = []
        for i in range(7):
            r = tr.verify(rows[i:i + 1], 9 + i)
            tr.commit(0)
            ref.append((r.logits[0], r.hidden[0]))
        tr.begin()
        tr.prefill(prompt)
        r = tr.verify(rows, 9)
        for i in range(7):
            assert torch.equal(r.logits[i], ref[i][0]) and torch.equal(r.hidden[i], ref[i][1]), (threads, i)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("whole", [True, False])
def test_verify_rows_equal_one_row_decodes_and_mtp_equals_ar(monkeypatch, whole):
    """The one-CPU rows path (model/cpu.py): widths on whole vector steps (every batched op
    batched) or off them (the transcendental ops one row at a time)."""
    batched, layers = [], []
    real_rows, real_layer = cpu._rows, cpu.layer
    monkeypatch.setattr(cpu, "_rows", lambda fn, w, *xs: batched.append(w and xs[0].shape[0] > 1)
                        or real_rows(fn, w, *xs))
    monkeypatch.setattr(cpu, "layer", lambda *a: layers.append(1) or real_layer(*a))
    with LLM(_ckpt() if whole else _odd_ckpt(), device="cpu", progress=False) as llm:
        for threads in (1, 2):
            _verify_equals_decodes(llm, threads)
        assert layers                                          # the one-CPU rows path ran
        assert any(batched) == whole
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, llm.cfg.vocab_size - 1, (9,), generator=g)
        ids = prompt.tolist() + prompt.tolist()[:4]
        sp = SamplingParams(max_tokens=24)
        ar = llm.generate(ids, sp, spec="off").token_ids
        for k in (1, 3):
            assert llm.generate(ids, sp, spec=SpecPolicy("mtp", k=k)).token_ids == ar


_ODD: list[str] = []


def _odd_ckpt() -> str:
    """Widths off the vector step (head_dim 16, dk 8, dv 12, MLP 96), three value heads per key head."""
    if not _ODD:
        import tempfile
        _ODD.append(make_checkpoint(tempfile.mkdtemp(prefix="onecpu-odd-"), "gqa4", seed=5))
    return _ODD[0]


def test_rows_path_matches_the_reference_and_keeps_its_rotary_table():
    """The one-CPU rows path computes the model's math (close to the canonical reference), and a
    position's rotary values do not change when the table grows."""
    ids, rows = torch.arange(3, 12), torch.tensor([5, 6, 7])
    got = []
    for on in (False, True):
        with LLM(_odd_ckpt(), device="cpu", progress=False, tp_invariant=on) as llm:
            tr = llm.engine.trunk
            tr.begin()
            tr.prefill(ids)
            got.append(tr.verify(rows, 9).logits)
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    c1, s1 = cpu.rope_table(8, 1e4, 32, 10)
    c1, s1 = c1[:10].clone(), s1[:10].clone()
    c2, s2 = cpu.rope_table(8, 1e4, 32, 3 * cpu.ROPE_BLOCK + 5)
    assert c2.shape[0] >= 3 * cpu.ROPE_BLOCK + 5 and torch.equal(c2[:10], c1) and torch.equal(s2[:10], s1)
