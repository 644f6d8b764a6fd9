"""specfire's 4-bit weight format and its PyTorch references: asymmetric, group-quantised along K,
optional Hadamard rotation (the layouts: the comment below)."""
from __future__ import annotations

# On disk (safetensors, one stable layout), a weight [N, K] in groups of G consecutive inputs:
#   <name>.qweight uint8 [N, K/2] (low nibble = even k), .scales / .zeros bf16 [N, K/G];
#   w[n, k] = code[n, k] * scales[n, k // G] + zeros[n, k // G]. With `hadamard` the stored weight is
#   W' = W H (H block-diagonal orthonormal Walsh-Hadamard of block G) and x is rotated alike.
# In memory (kernel layout): scales / zeros transposed to [K/G, N]; in group g byte j holds codes j
# (low nibble) and j + G/2 (high nibble); the codes in tiles of `tile` output rows [N/tile, K/G,
# tile, G/2] (N padded with zero rows), so one group of a tile is one contiguous block.

import math

import torch

FORMAT = "specfire-q4"
# output rows per contiguous block of the stored codes (0 keeps rows): 64 measured fastest on the H200
TILE = 64
FORMAT_VERSION = 1
DEFAULT_GROUP = 128
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
