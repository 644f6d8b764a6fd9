"""Programmatic dependent launch (PDL) for the decode path's Triton kernels on Hopper and later.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs become resident and compute their addresses, and only then wait
(`griddepcontrol.wait`) for every earlier kernel to finish and its memory to be visible. Each PDL
kernel then releases its own successor (`griddepcontrol.launch_dependents`) right after its wait,
so the next launch overlaps this kernel's work and tail, never more than one kernel ahead.
Measured on the H200 (docs/BENCHMARKS.md, "Eighth wave"): the 4-bit 27B step 7.10 -> 6.97 ms, the
bf16 one 14.25 -> 13.88 ms. Two options measured slower and left off: the 4-bit GEMV asking L2 for
its first code groups before its wait (triton_quant.PDL_PREFETCH, SPECFIRE_PDL_PREFETCH=N), and
releasing the successor before the wait (RELEASE_FIRST, SPECFIRE_PDL_EARLY=1).

The rule every kernel here keeps: when launched with PDL it waits before it reads anything an
earlier kernel writes and before it writes anything (a buffer of the CUDA-graph pool may still be
read by an earlier kernel). Every PDL kernel waits, in every program, so completion stays
transitive: a kernel's wait returns only after its predecessor's wait returned. Only the wait's
timing changes, never what a kernel computes: the bits are those of a launch without PDL.

`on(x)` picks PDL only where it exists: a CUDA tensor on a device of compute capability 9.0 or
more, Triton with `launch_pdl` and the grid-dependency builtins, not the CPU interpreter
(TRITON_INTERPRET=1), and not turned off by SPECFIRE_PDL=0 (or `ENABLED = False` at run time;
captured CUDA graphs keep the launches they were captured with). Off, each kernel compiles and
launches exactly as before (its PDL argument is a constexpr 0: nothing emitted).
"""
from __future__ import annotations

import os

import torch
from ._triton import triton, tl

ENABLED = os.environ.get("SPECFIRE_PDL", "1") != "0"
# where a PDL kernel releases its successor: WAIT_FIRST (1) right after its own wait, so launches
# run at most one kernel ahead; RELEASE_FIRST (2) before its wait, so a chain of small kernels
# launches through to the next GEMV, whose programs can prefetch while the GEMV before still runs
WAIT_FIRST, RELEASE_FIRST = 1, 2
ORDER = RELEASE_FIRST if os.environ.get("SPECFIRE_PDL_EARLY", "0") == "1" else WAIT_FIRST
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
    """PDL can be used on this device (whatever ENABLED says)."""
    if INTERPRET or not HAVE_GDC or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _CAPABLE.get(idx)
    if hit is None:
        hit = _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0) and _has_launch_option()
    return hit


def on(x: torch.Tensor) -> int:
    """The PDL constexpr of the kernels that read x: 0 (launched without PDL), or ORDER."""
    return ORDER if ENABLED and x.is_cuda and supported(x.device) else 0


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
    and the next kernel released (after the wait: WAIT_FIRST, or before it: RELEASE_FIRST). Call it
    in every program before the first read of an earlier kernel's output and before any store."""
    if PDL == 1:
        _gdc_wait()
        _gdc_release()
    elif PDL == 2:
        _gdc_release()
        _gdc_wait()


# inline PTX: one thread of the program asks L2 to fetch `nbytes` (a multiple of 16, 16-byte
# aligned) at a global address; a hint, no register written, nothing waited for
_ASM_PREFETCH = """{
.reg .pred p;
.reg .u32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
setp.ne.and.u32 p, $3, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
_ASM_PREFETCH_TL = tl.constexpr(_ASM_PREFETCH)


@triton.jit
def prefetch_l2(ptr, nbytes, ok):
    """L2 prefetch of nbytes (int32, a multiple of 16) from ptr (16-byte aligned) where ok (int32) != 0."""
    tl.inline_asm_elementwise(_ASM_PREFETCH_TL, "=r,l,r,r", [ptr.to(tl.int64), nbytes, ok], dtype=tl.int32,
                              is_pure=False, pack=1)
