"""Gated DeltaNet: the causal conv window and the gated delta rule, per row t
S = exp(g_t) S; u = S^T k_t; S += k_t (beta_t (v_t - u))^T; o_t = S^T q_t (q, k [T, Hv, dk], v [T, Hv,
dv], g, beta [T, Hv], S [Hv, dk, dv], float32). Rows (decode, verify) log what commit_rows replays;
prefill runs the chunked (WY) form. References: ref.py; CUDA: kernel.py, fused.py, prefill.py, fla.py."""
from __future__ import annotations

import torch

from .ref import (ChunkTerms, chunk_terms, commit_rows_ref, conv_window_ref, gates_ref, gdn_chunked_ref, gdn_rows_ref,
                  l2norm_ref, update)

FUSED_MAX_CONV = 4   # conv widths the fused rows kernel (fused.py) holds in registers

__all__ = ["FUSED_MAX_CONV", "ChunkTerms", "chunk_terms", "commit_rows", "commit_rows_ref", "conv_window",
           "conv_window_ref", "gates_ref", "gdn_chunked", "gdn_chunked_ref", "gdn_rows", "gdn_rows_ref", "l2norm_ref",
           "update"]


def commit_rows(states: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, dec: torch.Tensor, rows: int) -> None:
    """`commit_rows_ref`'s contract; one Triton launch over every layer on CUDA."""
    lo = k.shape[1]
    if not 0 <= rows <= lo:
        raise ValueError(f"commit: row count {rows} outside 0..{lo} (the rows the last forward logged)")
    if states.is_cuda:
        from .kernel import commit_rows_triton
        return commit_rows_triton(states, k, delta, dec, rows)
    return commit_rows_ref(states, k, delta, dec, rows)


def gdn_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, log: bool = False):
    """Decode / verify rows (contract of gdn_rows_ref); the Triton kernel on CUDA."""
    if q.is_cuda:
        from .kernel import gdn_rows_triton
        return gdn_rows_triton(q, k, v, g, beta, state, log)
    return gdn_rows_ref(q, k, v, g, beta, state, log)


def conv_window(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv window update (contract of conv_window_ref); the Triton kernel on CUDA."""
    if x.is_cuda:
        from .kernel import conv_window_triton
        return conv_window_triton(x, window, w)
    return conv_window_ref(x, window, w)


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = 64, canonical: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill (contract of gdn_chunked_ref, except that q, k may hold H key heads for Hv = r H
    value heads: value head j reads key head j // r). On CUDA flash-linear-attention's kernel when
    installed (kernels/gdn/fla.py), else our Triton passes (prefill.py: terms, state, output) for
    power-of-two dims >= 16, else the reference. `canonical` (a tensor-parallel invariant
    forward): never flash-linear-attention, whose configs are autotuned per process and keyed by
    the head count; our passes compute a head from its own rows alone, the same among any number
    of heads."""
    from . import fla as gdn_fla
    if not canonical and gdn_fla.use_for(q):
        return gdn_fla.gdn_chunked_fla(q, k, v, g, beta, state)
    if (q.is_cuda and _pow2_at_least_16(k.shape[-1]) and _pow2_at_least_16(v.shape[-1]) and _pow2_at_least_16(chunk)
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        from .prefill import gdn_prefill_triton
        return gdn_prefill_triton(q, k, v, g, beta, state, chunk)
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return gdn_chunked_ref(q, k, v, g, beta, state, chunk)
