"""Programmatic dependent launch for the decode path's Triton kernels (sm_90+): a kernel may start
while its predecessor runs, waits before its first dependent read or any store, then releases its
successor; only the wait's timing changes, never the bits."""
from __future__ import annotations

import os

import torch
from ._triton import triton, tl

WAIT_FIRST = 1   # a PDL kernel's constexpr: wait, then release the successor
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:   # Triton 3.4+: griddepcontrol builtins (emit nothing where PDL is off: they are never traced then)
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_release
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL is never picked
    _gdc_wait = _gdc_release = None
    HAVE_GDC = False

_CAPABLE: dict = {}


def _has_launch_option() -> bool:
    """This Triton's CUDA backend takes `launch_pdl` (a launch option since Triton 3.4)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no CUDA backend at all
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def supported(device: torch.device) -> bool:
    """PDL can be used on this device."""
    if INTERPRET or not HAVE_GDC or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _CAPABLE.get(idx)
    if hit is None:
        hit = _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0) and _has_launch_option()
    return hit


def on(x: torch.Tensor) -> int:
    """The PDL constexpr of the kernels that read x: 0 (launched without PDL) or WAIT_FIRST."""
    return WAIT_FIRST if x.is_cuda and supported(x.device) else 0


def launch(pdl: int) -> dict:
    """Launch options of a kernel whose PDL constexpr is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


def kw(x: torch.Tensor) -> dict:
    """Keyword arguments of a launch reading x: the PDL constexpr and the launch option where PDL
    is on (nothing otherwise: the kernel's default PDL=False)."""
    mode = on(x)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """PDL 0: nothing. Else every earlier kernel finished and its writes visible when this returns,
    and the next kernel released. Call it in every program before the first read of an earlier
    kernel's output and before any store (completion then stays transitive)."""
    if PDL:
        _gdc_wait()
        _gdc_release()
