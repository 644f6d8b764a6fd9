"""specfire's 4-bit weight format: asymmetric, group-quantised along K, optional Hadamard rotation.

On disk (safetensors, one stable layout, never a kernel's private packing), for a weight [N, K]
with groups of G consecutive input features:
  <name>.qweight  uint8 [N, K/2]   two codes per byte: low nibble = even k, high nibble = odd k
  <name>.scales   bf16  [N, K/G]   step of each group
  <name>.zeros    bf16  [N, K/G]   the value of code 0 in each group (its minimum, after clipping)
  w[n, k] = qweight_code[n, k] * scales[n, k // G] + zeros[n, k // G]
With `hadamard` the stored weight is W' = W H (H block-diagonal orthonormal Walsh-Hadamard of
block G along K) and the matmul rotates x the same way, x' = x H, since x W^T = x' W'^T; the
rotation spreads outliers across a group before rounding. G is implied per tensor by the shapes.
At load the tensors are packed into kernel layout (ops/triton_quant.py): scales and zeros are
transposed to [K/G, N] so a kernel reads them contiguously, and within each group byte j holds
codes j (low nibble) and j + G/2 (high nibble), so each nibble plane meets a contiguous half of x.
The codes can be stored in tiles of `tile` output rows, [N/tile, K/G, tile, G/2] (N padded with
zero rows): one group of one tile is then one contiguous block, so the GEMV streams whole blocks
instead of G/2 bytes per row (TILE = 64, the default: 1.2x faster on the lm_head on the H200,
up to 1.05x on the layer shapes; tile 0 keeps rows).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import Q4_DEFAULT_GROUP as DEFAULT_GROUP

FORMAT = "specfire-q4"
# output rows per contiguous block of the stored codes (0 keeps rows): 64-row tiles won the
# step-weighted sweep of bench/quant_gpu.py on the H200 (lm_head 72.7% vs 60.9% of 4.17 TB/s)
TILE = 64
FORMAT_VERSION = 1
CLIP_RATIOS = (1.0, 0.96, 0.92, 0.88, 0.84, 0.80)


def quant_config(group_size: int, hadamard: bool) -> dict:
    """The `quantization_config` object written into config.json and the safetensors metadata."""
    return {"quant_method": FORMAT, "version": FORMAT_VERSION, "bits": 4, "group_size": group_size,
            "hadamard": bool(hadamard), "symmetric": False}


# ---- Hadamard rotation ----------------------------------------------------------------------

def hadamard_rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] -> x H along the last dim, H block-diagonal orthonormal Hadamard of size `block`.

    A fast Walsh-Hadamard transform written as elementwise butterflies, so each row's result is
    independent of how many rows are transformed (no GEMM blocking), i.e. row-invariant."""
    if block & (block - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {block}")
    shape = x.shape
    k = shape[-1]
    if k % block:
        raise ValueError(f"Hadamard block {block} does not divide K={k}")
    dt = x.dtype
    y = x.float().reshape(-1, k // block, block)
    h = 1
    while h < block:
        y = y.view(y.shape[0], k // block, block // (2 * h), 2, h)
        a, b = y[:, :, :, 0, :], y[:, :, :, 1, :]
        y = torch.stack((a + b, a - b), dim=3)
        h *= 2
    y = y.reshape(shape) * (1.0 / math.sqrt(block))
    return y.to(dt)


# ---- quantise / dequantise (references) -----------------------------------------------------

def pick_group(k: int, group_size: int) -> int | None:
    """The group size used for a tensor with K inputs: the wanted one, else the largest power of
    two >= 32 below it that divides K; None when no group fits (the tensor stays bf16)."""
    g = group_size
    while g >= 32:
        if k % g == 0:
            return g
        g //= 2
    return None


def quantize_tensor(w: torch.Tensor, group_size: int = DEFAULT_GROUP, hadamard: bool = False,
                    clip_search: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight uint8 [N, K/2], scales bf16 [N, K/G], zeros bf16 [N, K/G]).

    Per group: min/max range, shrunk by the clip ratio (of CLIP_RATIOS) with the least squared
    error; codes are rounded against the bf16-rounded scale and zero actually stored."""
    n, k = w.shape
    g = group_size
    if k % g or g % 2:
        raise ValueError(f"group size {g} does not divide K={k}")
    wf = w.float()
    if hadamard:
        wf = hadamard_rotate(wf, g)
    wg = wf.reshape(n, k // g, g)                                      # [N, groups, G]
    lo = wg.amin(-1)
    hi = wg.amax(-1)
    best_err = None
    best = None
    for r in (CLIP_RATIOS if clip_search else (1.0,)):
        mid = (hi + lo) * 0.5
        half = (hi - lo) * 0.5 * r
        mn, mx = mid - half, mid + half
        s = ((mx - mn) / 15.0).clamp_min(1e-8).to(torch.bfloat16)
        z = mn.to(torch.bfloat16)
        sf, zf = s.float()[..., None], z.float()[..., None]
        q = torch.round((wg - zf) / sf).clamp_(0, 15)
        err = ((q * sf + zf - wg) ** 2).sum(-1)
        if best is None:
            best_err, best = err, (q, s, z)
        else:
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            best = (torch.where(take[..., None], q, best[0]), torch.where(take, s, best[1]),
                    torch.where(take, z, best[2]))
    q, s, z = best
    q = q.to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), s.contiguous(), z.contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]."""
    lo = qweight & 15
    hi = qweight >> 4
    return torch.stack((lo, hi), dim=-1).reshape(qweight.shape[0], -1)


def to_kernel_layout(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """On-disk packing (even/odd k per byte) -> kernel packing (k and k + G/2 per byte, per group)."""
    codes = unpack_codes(qweight)
    n, k = codes.shape
    c = codes.view(n, k // group, 2, group // 2)                       # [N, groups, half, G/2]
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def from_kernel_layout(kq: torch.Tensor, group: int) -> torch.Tensor:
    """Kernel packing -> codes uint8 [N, K]."""
    n = kq.shape[0]
    lo = (kq & 15).view(n, -1, group // 2)
    hi = (kq >> 4).view(n, -1, group // 2)
    return torch.cat((lo, hi), dim=-1).reshape(n, -1)


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Stored layout -> float32 [N, K] (in the rotated basis when the tensor was rotated)."""
    codes = unpack_codes(qweight).float()
    n, k = codes.shape
    g = k // scales.shape[1]
    w = codes.view(n, -1, g) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(n, k)


def tile_rows(kq: torch.Tensor, group: int, tile: int) -> torch.Tensor:
    """Kernel packing [N, K/2] -> tiles [ceil(N/tile), K/G, tile, G/2] (zero rows pad N)."""
    n, kh = kq.shape
    half = group // 2
    npad = -(-n // tile) * tile
    if npad != n:
        kq = torch.cat([kq, kq.new_zeros(npad - n, kh)])
    return kq.view(npad // tile, tile, kh // half, half).permute(0, 2, 1, 3).contiguous()


def untile_rows(qt: torch.Tensor, rows: slice, n: int) -> torch.Tensor:
    """Tiles -> kernel packing [rows, K/2] for a row range of the N real rows (only those tiles)."""
    a, b, _ = rows.indices(n)
    if b <= a:
        return qt.new_zeros(0, qt.shape[1] * qt.shape[3])
    tile = qt.shape[2]
    t0, t1 = a // tile, -(-b // tile)
    part = qt[t0:t1].permute(0, 2, 1, 3).reshape((t1 - t0) * tile, qt.shape[1] * qt.shape[3])
    return part[a - t0 * tile:b - t0 * tile]


# ---- the weight object ops.linear accepts ---------------------------------------------------

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
            from .triton_gemv import _locks as _gemv_locks
            from .triton_quant import _locks
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

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_rotate(x, self.group_size) if self.hadamard else x

    def linear(self, x: torch.Tensor, rows: bool, launch_n: int | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype. rows=True is row-invariant (the Triton dequant-GEMV on
        CUDA, one batched row at a time elsewhere). `launch_n`: the whole matrix's N when this is
        a column shard (the kernel takes the whole's settings). A prefill (rows=False) on CUDA:
        up to ROW_PATH_MAX rows the GEMV too, more through ops/triton_q4mm.py (its MODE: the
        weight dequantized to bf16 in a scratch buffer + GEMM, the fused kernel, or "torch":
        `linear_dequantized`, the reference path, which also keeps the few-row prefill on it)."""
        from .linear import ROW_PATH_MAX, linear_rows_ref

        if x.is_cuda:  # (the CPU path imports no Triton module)
            from . import triton_q4mm

            mode = triton_q4mm.MODE
            if rows or (x.shape[0] <= ROW_PATH_MAX and mode != "torch"):
                return q4_rows(x, [self], [launch_n])[0]
            xr = self.prepare_input(x)  # prefill: compute-bound, the weight goes through the tensor cores in bf16
            if mode == "dequant":
                return triton_q4mm.q4_linear_dequant(xr, self)
            if mode == "fused":
                return triton_q4mm.q4_matmul(xr, self)
            return self.linear_dequantized(xr)
        xr = self.prepare_input(x)
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = self.dequantize().to(x.dtype)  # the CPU reference keeps one dense copy
        return linear_rows_ref(xr, self._dense) if rows else F.linear(xr, self._dense)

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
    launch per 16 rows (ops/triton_quant.py q4_group: x rotated and its group sums made once,
    settings from the whole matrices' shapes, so shards compute every element as the whole does).
    SPECFIRE_GEMV_GROUP=0 (ops/triton_gemv.py GROUP): one launch per weight, its own settings."""
    from . import triton_gemv, xsum
    from .linear import ROW_PATH_MAX
    from .triton_quant import group_config, q4_group

    a = qws[0]
    if len(qws) > 1 and (not triton_gemv.GROUP or any(w.hadamard != a.hadamard or w.group_size != a.group_size
                                                        for w in qws)):
        return [q4_rows(x, [w], [n])[0] for w, n in zip(qws, launch_ns)]
    xr = a.prepare_input(x)
    # the group sums of x when the kernel that wrote x made them (ops/xsum.py); never for a rotated x
    xsum.consumer_on(x.device)
    xs = None if a.hadamard else xsum.take(x, a.group_size)
    cfg = group_config([n or w.shape[0] for w, n in zip(qws, launch_ns)], x.shape[1], a.group_size)
    parts = [q4_group(xr[i:i + ROW_PATH_MAX], qws, cfg, None if xs is None else xs[i:i + ROW_PATH_MAX])
             for i in range(0, xr.shape[0], ROW_PATH_MAX)]
    return parts[0] if len(parts) == 1 else [torch.cat(p) for p in zip(*parts)]
