"""One CPU device (no mesh, canonical mode off): the plain fast products and norms, and verify rows
batched only where every row keeps the bits it gets alone, so greedy speculation still equals AR."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinymodels import make_checkpoint

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.ops import lanes, onecpu, rowwise as rw, splitk
from specfire.ops.act import silu_mul
from specfire.ops.linear import linear, one_cpu


def test_one_cpu_device_is_plain_unless_canonical_or_a_mesh(monkeypatch):
    x = torch.randn(3, 64)
    w = torch.randn(48, 64)
    assert not splitk.enabled() and one_cpu(x)
    with lanes.invariant():                       # a mesh rank's forward
        assert not one_cpu(x)
        inv = linear(x, w, rows=True)
    assert torch.equal(linear(x, w, rows=True), torch.cat([x[i:i + 1] @ w.t().contiguous() for i in range(3)]))
    torch.testing.assert_close(inv, x @ w.t(), rtol=1e-5, atol=1e-5)
    calls = []
    real = onecpu.rms_norm
    monkeypatch.setattr(onecpu, "rms_norm", lambda *a: calls.append(1) or real(*a))
    with LLM(_ckpt(), device="cpu", progress=False) as llm:
        llm.score([1, 2, 3])
        assert calls                               # the one-device norms
        calls.clear()
        splitk.set_enabled(True)
        try:
            llm.score([1, 2, 3])
        finally:
            splitk.set_enabled(None)
        assert not calls                           # the canonical mode keeps the reference


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_rows_alone(threads):
    """Each batched one-device row op gives every row of T = 2..11 the bits of that row alone."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        w256, w64 = torch.randn(256, generator=g) * 0.1, torch.randn(64, generator=g)
        fns = {
            "add_rms_norm": (lambda a, b: onecpu.add_rms_norm(a, b, w256, 1e-6), (256, 256)),
            "rms_norm": (lambda a: onecpu.rms_norm(a, w256, 1e-6), (256,)),
            "silu_mul": (silu_mul, (512, 512)),
            "sigmoid": (torch.sigmoid, (192,)),
            "gated_norm": (lambda a, z: onecpu.gated_rms_norm(a, z, w64, 1e-6), ((4, 64), (4, 64))),
            "l2norm_qk": (onecpu.l2norm_qk, ((2, 64), (2, 64))),
        }
        for name, (fn, shapes) in fns.items():
            for t in range(2, 12):
                xs = [torch.randn(t, *(s if isinstance(s, tuple) else (s,)), generator=g) * 3 for s in shapes]
                assert rw.whole_steps(*xs)
                got = rw.rowwise(fn, True, *xs, batch=True)
                want = rw.rowwise(fn, True, *xs)
                for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                    assert torch.equal(a, b), (name, t)
        # a row width off the vector step is never batched
        assert not rw.whole_steps(torch.randn(4, 96 + 4))
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


def test_verify_rows_equal_one_row_decodes_and_mtp_equals_ar(monkeypatch):
    batched = []
    real = rw.whole_steps
    monkeypatch.setattr(rw, "whole_steps", lambda *xs: batched.append(real(*xs)) or batched[-1])
    with LLM(_ckpt(), device="cpu", progress=False) as llm:
        tr = llm.engine.trunk
        g = torch.Generator().manual_seed(0)
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
            assert torch.equal(r.logits[i], ref[i][0]) and torch.equal(r.hidden[i], ref[i][1]), i
        assert any(batched)
        ids = prompt.tolist() + prompt.tolist()[:4]
        sp = SamplingParams(max_tokens=24)
        ar = llm.generate(ids, sp, spec="off").token_ids
        for k in (1, 3):
            assert llm.generate(ids, sp, spec=SpecPolicy("mtp", k=k)).token_ids == ar
