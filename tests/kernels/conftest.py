"""Kernel tests: specfire's Triton kernels run in Triton's interpreter on CPU tensors.

Triton picks interpreter or compiler when a kernel is defined (`@triton.jit` at import of the
specfire.kernels modules) and reads TRITON_INTERPRET again while launching, so this conftest,
which pytest imports before any test module of this folder, defines every kernel module with
TRITON_INTERPRET=1, and each kernel test runs with the variable set; the rest of the suite and
the subprocesses it starts never see it. A kernel module that something imported earlier for the
GPU is imported again. The kernels stay interpreted for the rest of this pytest process (only
kernel tests launch them on CPU tensors); GPU runs of the kernels belong to bench/.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest

KERNEL_MODULES = ("specfire.kernels.pdl", "specfire.kernels.gemv.kernel", "specfire.kernels.splitk.fused",
                  "specfire.kernels.splitk.loop", "specfire.kernels.norm.kernel", "specfire.kernels.small.kernel", "specfire.kernels.q4.kernel", "specfire.kernels.q4.gemv",
                  "specfire.kernels.attention.device", "specfire.kernels.attention.kernel", "specfire.kernels.gdn.kernel", "specfire.kernels.gdn.fused", "specfire.kernels.gdn.prefill",
                  "specfire.kernels.attention.fused", "specfire.kernels.q4.matmul",
                  "specfire.kernels.head.kernel")


def _interpreted(mod) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernels = [v for v in vars(mod).values() if isinstance(v, (JITFunction, InterpretedFunction))]
    assert kernels, f"{mod.__name__} defines no Triton kernel"
    return all(isinstance(k, InterpretedFunction) for k in kernels)


def _define_interpreted() -> None:
    if all(m in sys.modules and _interpreted(sys.modules[m]) for m in KERNEL_MODULES):
        return
    for name in KERNEL_MODULES:             # defined for the GPU earlier: define them again
        sys.modules.pop(name, None)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_define_interpreted()


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """Every kernel test runs against the interpreted kernels, whatever ran before it."""
    _define_interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bad = [m for m in KERNEL_MODULES if not _interpreted(sys.modules[m])]
    assert not bad, f"kernels defined for the GPU: {bad}"
