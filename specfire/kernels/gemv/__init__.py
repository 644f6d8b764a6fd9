"""y = x @ W^T, row-invariant for decode and verify (a k+1-row verify gives k+1 one-row decodes' bits)
and, on a mesh or with tp_invariant, computed alike in a column shard and in the whole matrix.
A 4-bit QuantWeight (kernels/q4) is accepted in place of a weight tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ref import linear_rows_ref, paneled

ROW_PATH_MAX = 16  # up to this many rows use the row-invariant path (decode, verify)


def linear_rows(x: torch.Tensor, w: torch.Tensor, launch_n: int | None = None, rows: bool = True) -> torch.Tensor:
    """The row-invariant path: Triton on CUDA (16-row tiles; a prefill, rows=False, 64-row tiles),
    the batched reference elsewhere."""
    if x.is_cuda:
        from .kernel import gemv, row_tile
        return gemv(x, w, launch_n=launch_n, tile=row_tile(x.shape[0], rows))
    return paneled(linear_rows_ref, x, w)


def transposed(w: torch.Tensor) -> torch.Tensor:
    """W^T contiguous [K, N], kept on the weight until the weight changes (one more copy of W)."""
    hit = getattr(w, "_specfire_t", None)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    wt = w.t().contiguous()
    if not w.is_inference():             # an inference tensor has no version counter: no cache
        w._specfire_t = (w._version, wt)
    return wt


def linear_one_cpu(x: torch.Tensor, wt: torch.Tensor, rows: bool) -> torch.Tensor:
    """One CPU device, x [M, K] @ wt [K, N]: in rows mode one `mm` call per row (a verify row runs
    the very call of a one-row decode: row-invariant, and the fastest one-row product there),
    else one GEMM."""
    m = x.shape[0]
    if m == 1 or not rows:
        return torch.mm(x, wt)
    return torch.cat([torch.mm(x[i:i + 1], wt) for i in range(m)])


def linear_fused(x: torch.Tensor, ws: tuple[torch.Tensor, ...], rows: bool, owner) -> tuple[torch.Tensor, ...]:
    """One CPU device: the projections of x by every w in ws as one product per row on their
    cached transposed concatenation [K, sum N] (kept on `owner`), split back. Fewer calls; each
    output column is still a row-invariant product of its own row of W."""
    y = linear_one_cpu(x, fused_t(ws, owner), rows)
    return torch.split(y, [w.shape[0] for w in ws], dim=-1)


def fused_t(ws: tuple[torch.Tensor, ...], owner) -> torch.Tensor:
    """The transposed concatenation [K, sum N] of ws, kept on `owner` until a weight changes."""
    key = tuple((id(w), w._version) for w in ws)
    hit = getattr(owner, "_specfire_fused", None)
    if hit is None or hit[0] != key:
        hit = (key, torch.cat(ws).t().contiguous())
        owner._specfire_fused = hit
    return hit[1]


def linear(x: torch.Tensor, w, rows: bool, launch_n: int | None = None, exact: bool = False) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T. `rows` selects the row-invariant path (decode / verify). `w` is a
    tensor or a 4-bit QuantWeight. `launch_n`: the N of the whole matrix when `w` is a column
    shard of it (CUDA launch settings). `exact` (a mesh, or one device with tp_invariant): each
    element as in any column shard, a prefill on CUDA too through the Triton kernel; else one GPU's
    prefill is cuBLAS."""
    if isinstance(w, torch.Tensor) and not exact and not x.is_cuda:
        return linear_one_cpu(x, transposed(w), rows)                           # one CPU device
    if not isinstance(w, torch.Tensor):
        if x.is_cuda:
            return w.linear(x, rows, launch_n)
        return paneled(linear_rows_ref if rows else F.linear, w.prepare_input(x), w.dense(x.dtype))
    if rows or (x.is_cuda and exact):                # a mesh, or one GPU made mesh-equal
        return linear_rows(x, w, launch_n, rows)
    return F.linear(x, w) if x.is_cuda else paneled(F.linear, x, w)          # one GPU's prefill: cuBLAS


def linear_group(x: torch.Tensor, ws: list, rows: bool, launch_ns: list[int | None], exact: bool = False,
                 owner=None) -> list[torch.Tensor]:
    """[linear(x, w, rows, n, exact) for w, n in zip(ws, launch_ns)]. One CPU device (not exact,
    plain weights, an `owner` to keep it on): one product by their concatenated W^T
    (linear_fused). Where they take the Triton path on CUDA, one grouped launch whose settings
    come from the group's whole shapes, each output the bits of its weight's own launch with those
    settings (kernels/gemv/kernel.py gemv_group; 4-bit weights: kernels/q4 q4_rows). A column shard
    alone launches half the whole's programs, too few to fill the GPU; fewer, larger calls also
    spend less on each call's fixed cost."""
    if (not x.is_cuda and not exact and owner is not None
            and all(isinstance(w, torch.Tensor) and not w.is_inference() for w in ws)):
        return list(linear_fused(x, tuple(ws), rows, owner))
    dense = [i for i, w in enumerate(ws) if isinstance(w, torch.Tensor)]
    if len(dense) < len(ws) and x.is_cuda and rows:   # 4-bit weights: one launch (kernels/q4 q4_rows)
        out: list = [None] * len(ws)
        quant = [i for i in range(len(ws)) if i not in dense]
        for i, y in zip(quant, ws[quant[0]].rows_group(x, [ws[i] for i in quant], [launch_ns[i] for i in quant])):
            out[i] = y
        if dense:                                      # the bf16 rest (GDN b, a): one launch of their own
            for i, y in zip(dense, linear_group(x, [ws[i] for i in dense], rows, [launch_ns[i] for i in dense], exact)):
                out[i] = y
        return out
    triton_path = x.is_cuda and (rows or any(n is not None for n in launch_ns) or exact)
    if not triton_path or not all(isinstance(w, torch.Tensor) for w in ws):
        return [linear(x, w, rows, n, exact) for w, n in zip(ws, launch_ns)]
    from .kernel import gemv_group, row_tile
    return gemv_group(x, ws, launch_ns, row_tile(x.shape[0], rows))


def vocab_rows(w, n: int):
    """The first n output rows of a weight, reading no other row. A tensor: its row-prefix view
    (no copy; a tied embedding alike). A 4-bit QuantWeight: one over the leading tiles of its codes
    (a view: tiles hold whole output rows, and the kernel masks rows >= n of the last one) with the
    prefix's scales and zeros, which are copied (the kernel reads them with row stride n): K/G x n x
    4 bytes, built once and kept on the weight (QuantWeight.prefix)."""
    if n >= w.shape[0]:
        return w
    if isinstance(w, torch.Tensor):
        return w[:n]
    return w.prefix(n)


def linear_prefix(x: torch.Tensor, w, n: int | None, rows: bool = True, launch_n: int | None = None,
                  exact: bool = False) -> torch.Tensor:
    """x @ w[:n]^T, [M, n]: the product with the first n output rows of w only (the MTP drafter's
    reduced vocabulary), no row past n read and none copied (`vocab_rows`). n None: all of w.
    One CPU device multiplies by a column view of the cached W^T; the CPU 4-bit reference by a row
    view of its dense copy."""
    if n is None or n >= w.shape[0]:
        return linear(x, w, rows, launch_n, exact)
    if isinstance(w, torch.Tensor) and not exact and not x.is_cuda:
        return linear_one_cpu(x, transposed(w)[:, :n], rows)
    if not isinstance(w, torch.Tensor) and not x.is_cuda:
        return paneled(linear_rows_ref if rows else F.linear, w.prepare_input(x), w.dense(x.dtype)[:n])
    return linear(x, vocab_rows(w, n), rows, launch_n, exact)
