"""Prefill paths: which GEMM a prefill uses, the fused attention prefill, the optional
flash-linear-attention Gated DeltaNet kernel (its import guard and the layout conventions of the
wrapper, checked against a stand-in that implements the library's documented contract)."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from specfire.kernels import gdn as G
from specfire.kernels.gdn import fla as gdn_fla
from specfire.kernels import gemv as L
from specfire.kernels.attention import attention_prefill_fused, attention_prefill_ref


@pytest.fixture
def calls(monkeypatch):
    """Record which product `linear` dispatches to (x only needs `is_cuda` to take the CUDA branches)."""
    seen: list[str] = []
    monkeypatch.setattr(L, "linear_rows", lambda x, w, launch_n=None, rows=True: seen.append("triton"))
    monkeypatch.setattr(L, "F", SimpleNamespace(linear=lambda x, w: seen.append("cublas")))
    monkeypatch.setattr(L, "paneled", lambda fn, x, w: seen.append("cpu"))
    monkeypatch.setattr(L, "linear_one_cpu", lambda x, wt, rows: seen.append("one cpu"))
    yield seen


def test_one_gpu_prefill_uses_cublas_and_a_mesh_keeps_the_invariant_kernel(calls):
    w, gpu = torch.zeros(4, 4), SimpleNamespace(is_cuda=True)
    L.linear(gpu, w, rows=False)                    # one GPU, canonical split off (the default)
    L.linear(gpu, w, rows=True)                     # decode / verify: always the row-invariant kernel
    L.linear(gpu, w, rows=False, launch_n=64, exact=True)   # a column shard of a mesh
    L.linear(gpu, w, rows=False, exact=True)        # one GPU made bit-equal to a mesh (canonical mode)
    L.linear(SimpleNamespace(is_cuda=False), w, rows=False)     # one CPU device: its plain product
    L.linear(SimpleNamespace(is_cuda=False), w, rows=False, exact=True)   # a CPU mesh rank: the panels
    assert calls == ["cublas", "triton", "triton", "triton", "one cpu", "cpu"]


@pytest.mark.parametrize("t,pos0,hq,hkv,d", [(5, 0, 6, 2, 16), (7, 11, 4, 4, 32), (1, 9, 6, 3, 8), (13, 3, 8, 2, 24)])
def test_fused_attention_prefill_matches_reference(t, pos0, hq, hkv, d):
    g = torch.Generator().manual_seed(t * 100 + pos0)
    kc, vc = torch.randn(40, hkv, d, generator=g), torch.randn(40, hkv, d, generator=g)
    q = torch.randn(t, hq, d, generator=g)
    out = attention_prefill_fused(q, kc, vc, pos0, d ** -0.5)
    assert out.dtype == torch.float32 and out.shape == (t, hq, d)
    torch.testing.assert_close(out, attention_prefill_ref(q, kc, vc, pos0, d ** -0.5), rtol=1e-5, atol=1e-5)


def _gdn_inputs(t=37, hk=2, hv=6, dk=8, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hv, dv, generator=g)
    return q, k, v, -torch.rand(t, hv, generator=g) * 0.5, torch.rand(t, hv, generator=g), \
        torch.randn(hv, dk, dv, generator=g) * 0.1


def test_chunked_prefill_takes_grouped_key_heads():
    q, k, v, g, beta, s0 = _gdn_inputs()
    o, s = G.gdn_chunked(q, k, v, g, beta, s0, chunk=16)
    ro, rs = G.gdn_chunked_ref(q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g, beta, s0, chunk=16)
    assert torch.equal(o, ro) and torch.equal(s, rs)


@pytest.fixture
def fresh_guard(monkeypatch):
    monkeypatch.setattr(gdn_fla, "_tried", False)
    monkeypatch.setattr(gdn_fla, "_kernel", None)
    yield


def test_without_the_library_prefill_keeps_our_kernel(monkeypatch, fresh_guard):
    monkeypatch.setitem(sys.modules, "fla", None)          # `import fla...` raises ImportError
    assert gdn_fla.kernel() is None
    assert not gdn_fla.use_for(SimpleNamespace(is_cuda=True))
    with pytest.raises(RuntimeError, match="flash-linear-attention is not installed"):
        gdn_fla.gdn_chunked_fla(*_gdn_inputs())


def _standin(log: list):
    """chunk_gated_delta_rule's documented contract, computed by our float32 reference: q, k
    [B, T, H, K], v [B, T, HV, V] (value head j reads key head j // (HV / H)), g log decay and beta
    [B, T, HV], initial_state [N, HV, K, V] -> (o [B, T, HV, V] in q's dtype, final [N, HV, K, V])."""
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        log.append({"dtypes": (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), "scale": scale, **kw})
        r = v.shape[2] // q.shape[2]
        o, s = G.gdn_rows_ref((q[0] * scale).repeat_interleave(r, 1).float(), k[0].repeat_interleave(r, 1).float(),
                              v[0].float(), g[0].float(), beta[0].float(), initial_state[0])
        return o[None].to(q.dtype), (s[None] if output_final_state else None)
    return chunk_gated_delta_rule


def test_library_wrapper_layout_and_dispatch(monkeypatch, fresh_guard):
    log: list = []
    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = _standin(log)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", mod)
    assert gdn_fla.kernel() is mod.chunk_gated_delta_rule
    gpu = SimpleNamespace(is_cuda=True)
    assert gdn_fla.use_for(gpu) and not gdn_fla.use_for(torch.zeros(1))

    q, k, v, g, beta, s0 = _gdn_inputs()
    ro, rs = G.gdn_chunked_ref(q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g, beta, s0)
    o, s = gdn_fla.gdn_chunked_fla(q, k, v, g, beta, s0, dtype=torch.float32)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-5)
    assert log[-1]["scale"] == 1.0
    gdn_fla.gdn_chunked_fla(q, k, v, g, beta, s0)              # default: bf16 q, k, v, beta; float32 g
    assert log[-1]["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)

    monkeypatch.setattr(gdn_fla, "use_for", lambda q: True)     # what a CUDA prefill sees
    n = len(log)
    G.gdn_chunked(q, k, v, g, beta, s0)
    assert len(log) == n + 1


def _install_standin(monkeypatch, fn) -> None:
    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = fn
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", mod)


def test_library_warm_up_at_load(monkeypatch, fresh_guard, capsys):
    """`warm` runs the library once on the model's head shapes (where it is used), is skipped where
    it is not, and a failure only reports (the prefill meets it later)."""
    log: list = []
    _install_standin(monkeypatch, _standin(log))
    assert gdn_fla.warm(2, 6, 8, 16, torch.device("cpu")) is None and not log     # the CPU never uses it
    monkeypatch.setattr(gdn_fla, "use_for", lambda q: True)
    assert gdn_fla.warm(2, 6, 8, 16, torch.device("cpu"), rows=8) >= 0.0
    assert len(log) == 1 and log[0]["dtypes"][0] == torch.bfloat16

    def broken(*a, **kw):
        raise RuntimeError("no kernel for this GPU")
    monkeypatch.setattr(gdn_fla, "_kernel", broken)
    assert gdn_fla.warm(2, 6, 8, 16, torch.device("cpu")) is None
    assert "warm-up failed (RuntimeError: no kernel for this GPU)" in capsys.readouterr().err


def test_one_device_load_warms_the_library_with_the_model_shapes(monkeypatch):
    from specfire import LLM
    seen: list = []
    monkeypatch.setattr(gdn_fla, "warm", lambda *a: seen.append(a))
    with LLM(device="cpu", progress=False) as llm:
        c = llm.cfg
        assert seen == [(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, torch.device("cpu"))]
