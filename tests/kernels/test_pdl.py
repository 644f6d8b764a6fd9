"""Programmatic dependent launch (kernels/pdl.py): picked only on a CUDA device of compute capability
9.0+ with a Triton that has it, never in the interpreter or on the CPU; the launchers pass the
PDL constexpr and the launch option together, and nothing where it is off. (The PDL kernels
themselves run on the GPU only.)"""
from __future__ import annotations

import pytest
import torch

from specfire.kernels import pdl


class FakeCuda:
    """Stands in for a CUDA tensor: on() reads only is_cuda and device."""
    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """A machine that would take PDL: not interpreting, the builtins there, capability (9, 0)."""
    monkeypatch.setattr(pdl, "INTERPRET", False)
    monkeypatch.setattr(pdl, "HAVE_GDC", True)
    monkeypatch.setattr(pdl, "_CAPABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (9, 0))
    return monkeypatch


def test_never_on_cpu_or_in_the_interpreter():
    x = torch.zeros(2, 8)
    assert pdl.on(x) == 0 and pdl.kw(x) == {} and pdl.launch(pdl.on(x)) == {}
    assert pdl.INTERPRET                      # the kernel tests' conftest defines the module interpreted
    assert not pdl.supported(torch.device("cuda", 0))     # interpreter: never, whatever the device


def test_picked_on_hopper_only(hopper):
    assert pdl.on(FakeCuda()) == pdl.WAIT_FIRST
    assert pdl.kw(FakeCuda()) == {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}
    assert pdl.launch(pdl.WAIT_FIRST) == {"launch_pdl": True}
    assert pdl.on(torch.zeros(1)) == 0                     # a CPU tensor on the same machine
    hopper.setattr(pdl, "_CAPABLE", {})
    hopper.setattr(torch.cuda, "get_device_capability", lambda idx=None: (8, 0))   # an A100
    assert pdl.on(FakeCuda()) == 0 and pdl.kw(FakeCuda()) == {}


def test_no_builtins_no_pdl(hopper):
    hopper.setattr(pdl, "HAVE_GDC", False)
    assert pdl.on(FakeCuda()) == 0


def test_this_triton_has_the_launch_option():
    assert pdl._has_launch_option() == pdl.HAVE_GDC


class Recorder:
    """A kernel whose launches are recorded (and run only where run=True)."""

    def __init__(self, kernel, run: bool):
        self.kernel, self.run, self.calls = kernel, run, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            if self.run:
                return self.kernel[grid](*args, **kwargs)
        return launch


def _q4_weight(n: int, k: int, g: torch.Generator):
    from specfire.kernels.q4 import QuantWeight
    s = torch.rand(k // 128, n, generator=g) * 0.01
    return QuantWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), s.bfloat16(),
                       (-7.5 * s).bfloat16(), False, torch.float32)


def test_launchers_pass_nothing_where_pdl_is_off(monkeypatch):
    """CPU tensors in the interpreter: the 4-bit GEMV, its sum(x), the bf16 GEMV and a small kernel
    launch exactly as before (no PDL argument, no launch option), and still compute."""
    from specfire.kernels.gemv import kernel as triton_gemv
    from specfire.kernels.q4 import gemv as triton_quant
    from specfire.kernels.small import kernel as triton_small
    g = torch.Generator().manual_seed(0)
    recs = {}
    for mod, name in ((triton_quant, "_q4_kernel"), (triton_quant, "_xsum_kernel"), (triton_gemv, "_gemv_kernel"),
                      (triton_small, "_silu_mul_kernel")):
        recs[name] = Recorder(getattr(mod, name), run=True)
        monkeypatch.setattr(mod, name, recs[name])
    x = torch.randn(3, 256, generator=g)
    w = _q4_weight(40, 256, g)
    y = triton_quant.q4_gemv(x, w, triton_quant.Q4Config(16, split_k=2, wa=True, rows=8))
    ref = x @ w.dequantize().float().t()
    torch.testing.assert_close(y, ref, rtol=2e-4, atol=2e-4)
    triton_gemv.gemv(x, torch.randn(24, 256, generator=g))
    triton_small.silu_mul_triton(torch.randn(2, 40, generator=g), torch.randn(2, 40, generator=g))
    for name, rec in recs.items():
        assert rec.calls, name
        for kw in rec.calls:
            assert "launch_pdl" not in kw and not kw.get("PDL", 0), (name, kw)


def test_launchers_pick_pdl_where_on(monkeypatch):
    """With PDL picked (as on an H200), every launch of the 4-bit GEMV path carries the constexpr
    and the launch option together (recorded, not run: the interpreter has no grid-dependency
    instructions)."""
    from specfire.kernels.q4 import gemv as triton_quant
    g = torch.Generator().manual_seed(1)
    monkeypatch.setattr(pdl, "on", lambda x: pdl.WAIT_FIRST)
    recs = {n: Recorder(getattr(triton_quant, n), run=False) for n in ("_q4_kernel", "_xsum_kernel")}
    for n, r in recs.items():
        monkeypatch.setattr(triton_quant, n, r)
    x = torch.randn(2, 256, generator=g)
    w = _q4_weight(40, 256, g)
    for split in (2, 1):
        triton_quant.q4_group(x, [w], triton_quant.Q4Config(16, split_k=split, wa=True, rows=8))
    for n, r in recs.items():
        assert r.calls, n
        for kw in r.calls:
            assert kw["PDL"] == pdl.WAIT_FIRST and kw["launch_pdl"] is True, (n, kw)
