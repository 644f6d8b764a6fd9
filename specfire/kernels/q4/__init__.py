"""specfire's 4-bit weights (format and references: ref.py): QuantWeight, accepted by
kernels.gemv.linear in place of a weight tensor, and its CUDA dispatch (gemv.py decode / verify
rows, matmul.py prefill)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import xsum
from ..gemv import ROW_PATH_MAX
from ..gemv.ref import linear_rows_ref
from .ref import (CLIP_RATIOS, DEFAULT_GROUP, FORMAT, FORMAT_VERSION, TILE, dequantize_ref, from_kernel_layout,
                  hadamard_rotate, pick_group, quant_config, quantize_tensor, tile_rows, to_kernel_layout,
                  unpack_codes, untile_rows)

__all__ = ["QuantWeight", "q4_rows", "CLIP_RATIOS", "DEFAULT_GROUP", "FORMAT", "FORMAT_VERSION", "TILE", "dequantize_ref",
           "from_kernel_layout", "hadamard_rotate", "pick_group", "quant_config", "quantize_tensor", "tile_rows",
           "to_kernel_layout", "unpack_codes", "untile_rows"]


class QuantWeight:
    """A 4-bit weight in kernel layout, accepted by `ops.linear` in place of a weight tensor.

    Takes qweight [N, K/2] uint8 in kernel packing (or already tiled) and scales/zeros transposed
    to [K/G, N] (bf16); keeps the codes tiled (`qtiled`, `tile` rows a block; tile 0 keeps rows).
    `qweight` gives the untiled [N, K/2] back (a copy: for loading and sharding, not the hot
    path). `dtype` is the activation dtype the model computes in."""

    def __init__(self, qweight: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                 hadamard: bool, dtype: torch.dtype, tile: int = TILE):
        n = scales_t.shape[1]
        if qweight.dim() == 4:     # already tiled
            self.qtiled, self.tile = qweight, qweight.shape[2]
            kh = qweight.shape[1] * qweight.shape[3]
        else:
            kh = qweight.shape[1]
            self.tile = tile
            self.qtiled = tile_rows(qweight, 2 * kh // scales_t.shape[0], tile) if tile else qweight
        self.scales_t = scales_t
        self.zeros_t = zeros_t
        self.hadamard = hadamard
        self.dtype = dtype
        self.shape = torch.Size((n, kh * 2))
        self.group_size = self.shape[1] // scales_t.shape[0]
        self._dense: torch.Tensor | None = None
        if self.qtiled.is_cuda:  # the kernel's split-K counters exist before any CUDA-graph capture
            from ..gemv.kernel import _locks as _gemv_locks
            from .gemv import _locks
            _locks(self.qtiled.device, 0)
            _gemv_locks(self.qtiled.device, 0)   # the bf16 weights launched beside (GDN b / a) split K

    @property
    def qweight(self) -> torch.Tensor:
        """The codes untiled, [N, K/2] in kernel packing."""
        return untile_rows(self.qtiled, slice(None), self.shape[0]) if self.tile else self.qtiled

    @classmethod
    def from_stored(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, hadamard: bool,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "QuantWeight":
        """Pack the on-disk layout into kernel layout on `device`."""
        n, half = qweight.shape
        if scales.shape != zeros.shape or scales.shape[0] != n or (2 * half) % scales.shape[1]:
            raise ValueError(f"inconsistent 4-bit tensors: qweight {list(qweight.shape)}, scales "
                             f"{list(scales.shape)}, zeros {list(zeros.shape)}")
        dev = torch.device(device)
        group = 2 * half // scales.shape[1]
        return cls(to_kernel_layout(qweight.to(dev), group), scales.to(dev, torch.bfloat16).t().contiguous(),
                   zeros.to(dev, torch.bfloat16).t().contiguous(), hadamard, dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = DEFAULT_GROUP, hadamard: bool = False,
                 dtype: torch.dtype | None = None) -> "QuantWeight":
        q, s, z = quantize_tensor(w, group_size, hadamard)
        return cls.from_stored(q, s, z, hadamard, dtype or w.dtype, w.device)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "QuantWeight":
        dev = torch.device(device) if device is not None else self.device
        return QuantWeight(self.qtiled.to(dev), self.scales_t.to(dev), self.zeros_t.to(dev), self.hadamard,
                           dtype or self.dtype, self.tile)

    @property
    def device(self) -> torch.device:
        return self.qtiled.device

    def nbytes(self) -> int:
        """Bytes a matmul reads: codes (padding rows excluded) + scales + zeros."""
        return self.shape[0] * self.shape[1] // 2 + sum(t.numel() * t.element_size() for t in (self.scales_t, self.zeros_t))

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [N, K] (or the given output rows) in the rotated basis (the reference's weight)."""
        kq = untile_rows(self.qtiled, rows, self.shape[0]) if self.tile else self.qtiled[rows]
        codes = from_kernel_layout(kq, self.group_size).float()
        n, k = codes.shape
        g = self.group_size
        s = self.scales_t[:, rows].t().float()[..., None]
        z = self.zeros_t[:, rows].t().float()[..., None]
        return (codes.view(n, -1, g) * s + z).reshape(n, k)

    def effective(self) -> torch.Tensor:
        """float32 [N, K] in the original basis: what the layer multiplies by."""
        w = self.dequantize()
        if self.hadamard:  # W = W' H^T, and H is symmetric
            w = hadamard_rotate(w, self.group_size)
        return w

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The CPU reference's one dense copy (rotated basis), kept on the weight."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = self.dequantize().to(dtype)
        return self._dense

    def prefix(self, n: int) -> "QuantWeight":
        """The weight of the first n output rows: a view of the leading tiles of the codes (the
        kernel masks rows >= n of the last one) with the prefix's scales and zeros copied (the
        kernel reads them with row stride n); built once and kept."""
        cache = self.__dict__.setdefault("_specfire_prefix", {})
        hit = cache.get(n)
        if hit is None:
            codes = self.qtiled[:-(-n // self.tile)] if self.tile else self.qtiled[:n]
            hit = cache[n] = QuantWeight(codes, self.scales_t[:, :n].contiguous(), self.zeros_t[:, :n].contiguous(),
                                         self.hadamard, self.dtype, tile=self.tile)
        return hit

    @staticmethod
    def rows_group(x: torch.Tensor, qws: list, launch_ns: list) -> list[torch.Tensor]:
        """q4_rows: the decode / verify rows of x through 4-bit weights of that one input (CUDA)."""
        return q4_rows(x, qws, launch_ns)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_rotate(x, self.group_size) if self.hadamard else x

    def linear(self, x: torch.Tensor, rows: bool, launch_n: int | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype. rows=True is row-invariant (the Triton dequant-GEMV on
        CUDA, one batched row at a time elsewhere). `launch_n`: the whole matrix's N when this is
        a column shard (the kernel takes the whole's settings). A prefill on CUDA: up to
        ROW_PATH_MAX rows the GEMV too, more through kernels/q4/matmul.py (bf16 scratch + GEMM)."""
        if x.is_cuda:  # (the CPU path imports no Triton module)
            if rows or x.shape[0] <= ROW_PATH_MAX:
                return q4_rows(x, [self], [launch_n])[0]
            from .matmul import q4_linear_dequant
            return q4_linear_dequant(self.prepare_input(x), self)
        xr = self.prepare_input(x)
        return linear_rows_ref(xr, self.dense(x.dtype)) if rows else F.linear(xr, self.dense(x.dtype))

    def linear_dequantized(self, x: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """F.linear against the dequantised weight, built `step` output rows at a time (bounded
        temporary memory: the lm_head would otherwise need 5 GB of float32)."""
        n = self.shape[0]
        step = step or max(1, (1 << 26) // self.shape[1])  # <= 256 MB of float32 at a time
        return torch.cat([F.linear(x, self.dequantize(slice(i, min(n, i + step))).to(x.dtype))
                          for i in range(0, n, step)], dim=-1)

    def __repr__(self) -> str:
        return (f"QuantWeight(shape={list(self.shape)}, group={self.group_size}, hadamard={self.hadamard}, "
                f"device={self.device})")


def q4_rows(x: torch.Tensor, qws: list, launch_ns: list) -> list[torch.Tensor]:
    """Decode / verify rows of x [M, K] through 4-bit weights of that one input on CUDA, in one
    launch per 16 rows (kernels/q4/gemv.py q4_group: x rotated and its group sums made once,
    settings from the whole matrices' shapes, so shards compute every element as the whole does)."""
    from .config import group_config
    from .gemv import q4_group

    a = qws[0]
    if len(qws) > 1 and any(w.hadamard != a.hadamard or w.group_size != a.group_size for w in qws):
        return [q4_rows(x, [w], [n])[0] for w, n in zip(qws, launch_ns)]
    xr = a.prepare_input(x)
    # the group sums of x when the kernel that wrote x made them (kernels/xsum.py); never for a rotated x
    xsum.consumer_on(x.device)
    xs = None if a.hadamard else xsum.take(x, a.group_size)
    cfg = group_config([n or w.shape[0] for w, n in zip(qws, launch_ns)], x.shape[1], a.group_size)
    parts = [q4_group(xr[i:i + ROW_PATH_MAX], qws, cfg, None if xs is None else xs[i:i + ROW_PATH_MAX])
             for i in range(0, xr.shape[0], ROW_PATH_MAX)]
    return parts[0] if len(parts) == 1 else [torch.cat(p) for p in zip(*parts)]
