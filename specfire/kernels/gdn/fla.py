"""Optional Gated DeltaNet prefill through flash-linear-attention's `chunk_gated_delta_rule` (the
library transformers, vLLM and SGLang use), on CUDA wherever it imports; decode and verify keep the
row-invariant recurrence, and `warm` runs it once at load so a first prompt does not compile it."""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch

_kernel: Callable | None = None
_tried = False


def kernel() -> Callable | None:
    """flash-linear-attention's `chunk_gated_delta_rule`, or None when it does not import."""
    global _kernel, _tried
    if not _tried:
        _tried = True
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            _kernel = chunk_gated_delta_rule
        except Exception:       # absent, or present but broken (a missing dependency, an old triton)
            _kernel = None
    return _kernel


def use_for(q: torch.Tensor) -> bool:
    """Whether a prefill on q's device goes through flash-linear-attention."""
    return q.is_cuda and kernel() is not None


def gdn_chunked_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of kernels/gdn gdn_chunked_ref: q, k [T, H, dk] (H may divide Hv: value head j reads key
    head j // (Hv / H), the library's grouping too), v [T, Hv, dv], g, beta [T, Hv], state
    [Hv, dk, dv] -> (o [T, Hv, dv] float32, final state float32). q, k, v and beta run in `dtype`,
    g in float32 (the combination transformers' Qwen3.5 passes it); q is already scaled (scale 1)."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("flash-linear-attention is not installed (pip install flash-linear-attention)")
    o, s = fn(q.to(dtype)[None], k.to(dtype)[None], v.to(dtype)[None], g.float()[None], beta.to(dtype)[None],
              scale=1.0, initial_state=state.float()[None].contiguous(), output_final_state=True)
    return o[0].float(), s[0].float()


def warm(hk: int, hv: int, dk: int, dv: int, device: torch.device, rows: int = 128) -> float | None:
    """Run the library's kernels once now, at load, on a small input of these head shapes, so the
    first prompt does not pay their compilation and autotuning (the state kernel's autotune key is
    the head counts and sizes, not the length). Returns the seconds spent, or None when the library
    is not used here. A failure is reported on stderr and left to the first prefill."""
    dev = torch.device(device)
    if not use_for(torch.empty(0, device=dev)):
        return None
    t0 = time.perf_counter()
    try:
        z = torch.zeros
        gdn_chunked_fla(z(rows, hk, dk, device=dev), z(rows, hk, dk, device=dev), z(rows, hv, dv, device=dev),
                        z(rows, hv, device=dev), z(rows, hv, device=dev), z(hv, dk, dv, device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - the warm-up is an optimisation; the prefill reports for real
        print(f"specfire: flash-linear-attention warm-up failed ({type(e).__name__}: {e}); "
              f"the first prefill will compile its kernels", file=sys.stderr)
        return None
    return time.perf_counter() - t0
