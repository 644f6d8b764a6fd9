"""The 4-bit GEMV's launch (q4_gemv, q4_group): the checks, the weights one launch holds, the
split-K partials and counters; the Triton kernels are in kernel.py, their settings in config.py."""
from __future__ import annotations

import os

import torch
from .._triton import triton

from .. import pdl
from ..gemv.kernel import ROWS
from .config import Q4Config, group_config, launch_config
from .kernel import _BIAS, _q4_kernel, _xsum_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX in the interpreter


_LOCKS: dict = {}


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Per-device split-K arrival counters (int32, zero between launches: the last CTA resets its
    own). Kernels on one stream run one after another, so one buffer serves every call."""
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


GROUP_MAX = 4      # weights of one input that one launch can hold
OUT_ALIGN = 64     # elements: where a grouped launch's outputs start in its buffer (128 bytes in bf16)


def _groupable(x: torch.Tensor, qws: list) -> bool:
    """One launch can hold these weights: same K, group, code layout and device, offsets between
    their tensors multiples of 16 bytes (the kernel tells the compiler so)."""
    a = qws[0]
    return len(qws) <= GROUP_MAX and all(
        w.shape[1] == a.shape[1] and w.group_size == a.group_size and w.tile == a.tile and w.device == x.device
        and w.qtiled.is_contiguous() and w.scales_t.is_contiguous() and w.zeros_t.is_contiguous()
        and (w.qtiled.data_ptr() - a.qtiled.data_ptr()) % 16 == 0
        and (w.scales_t.data_ptr() - a.scales_t.data_ptr()) % 16 == 0
        and (w.zeros_t.data_ptr() - a.zeros_t.data_ptr()) % 16 == 0 for w in qws)


def discard_ok(on: bool, block_n: int, ns: list[int], part_ptr: int) -> bool:
    """Whether a launch may drop its split-K partials' L2 lines after the combine (`on`: split-K on
    a GPU, not the interpreter): only
    where every 128-byte line (32 float32) of the partials lies inside one row of one column tile,
    so no line holds a value another tile still has to read: the tile width, every weight's N and
    the buffer's start on 32-float boundaries (the weights' outputs start OUT_ALIGN apart)."""
    return bool(on and block_n % 32 == 0 and all(v % 32 == 0 for v in ns) and part_ptr % 128 == 0)


def q4_gemv(x: torch.Tensor, qw, cfg: Q4Config | None = None, xs: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, already rotated if the weight is) @ dequant(qw)^T -> [M, N] in x's dtype."""
    return q4_group(x, [qw], cfg, xs)[0]


def q4_group(x: torch.Tensor, qws: list, cfg: Q4Config | None = None,
             xs: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[q4_gemv(x, w, cfg) for w in qws], the same bits, in one launch (one sum(x) pass and one
    GEMV grid over every weight's column tiles: fewer, larger calls). cfg defaults to
    group_config of the weights' own N. Weights one launch cannot hold run one launch each.
    xs: x's group sums [M, K / G] float32 as the kernel that wrote x made them (kernels/xsum.py; the
    same bits as the sum(x) launch, which is then skipped)."""
    m, k = x.shape
    if m > ROWS:
        raise ValueError(f"q4_gemv serves at most {ROWS} rows, got M={m}")
    for w in qws:
        if w.shape[1] != k:
            raise ValueError(f"q4_gemv: x has K={k} but the weight is {list(w.shape)}")
    g = qws[0].group_size
    cfg = cfg or group_config([w.shape[0] for w in qws], k, g)
    if xs is not None and (tuple(xs.shape) != (m, k // g) or xs.dtype != torch.float32 or not xs.is_contiguous()):
        raise ValueError(f"q4_group: xs must be contiguous float32 [{m}, {k // g}], got {xs.dtype} {list(xs.shape)}")
    if len(qws) > 1 and not _groupable(x, qws):
        return [q4_group(x, [w], cfg, xs)[0] for w in qws]
    x = x.contiguous()
    cfg = launch_config(cfg, sum(w.shape[0] for w in qws), k, g, m)
    on = pdl.on(x)
    n_groups = k // g
    per = triton.cdiv(n_groups, cfg.split_k)
    split = triton.cdiv(n_groups, per)
    ns = [w.shape[0] for w in qws]
    offs = [0]
    for v in ns:                          # each output starts 128-byte aligned, like its own tensor
        offs.append(offs[-1] + (triton.cdiv(v, OUT_ALIGN) * OUT_ALIGN if len(ns) > 1 else v))
    y = torch.empty(m * offs[-1], device=x.device, dtype=x.dtype)
    tiles = [triton.cdiv(v, cfg.block_n) for v in ns]
    part = y if split == 1 else torch.empty(split * m * offs[-1], device=x.device, dtype=torch.float32)
    rows = cfg.rows_hi if cfg.rows_hi > cfg.rows and m > cfg.rows else cfg.rows
    row_tiles = triton.cdiv(m, rows)
    locks = _locks(x.device, sum(tiles) * row_tiles)   # int32 even at split 1: the kernel's combine must compile
    discard = discard_ok(split > 1 and not INTERPRET and x.is_cuda, cfg.block_n, ns, part.data_ptr())
    if cfg.zc:                            # the kernel sums x itself (xs is not read)
        xs = part if split > 1 else torch.empty(1, device=x.device, dtype=torch.float32)
    elif xs is None:
        xs = torch.empty(m, n_groups, device=x.device, dtype=torch.float32)
        _xsum_kernel[(m, triton.cdiv(n_groups, 16))](x, xs, k, x.stride(0), G=g, GB=16, PDL=on, **pdl.launch(on))
    a = qws[0]
    pad = [0] * (GROUP_MAX - len(qws))
    bounds = [sum(tiles[:i]) for i in range(1, GROUP_MAX)]
    dq = [_BIAS + w.qtiled.data_ptr() - a.qtiled.data_ptr() for w in qws[1:]] + [_BIAS] * len(pad)
    dsc = [_BIAS + (w.scales_t.data_ptr() - a.scales_t.data_ptr()) // 2 for w in qws[1:]] + [_BIAS] * len(pad)
    dz = [_BIAS + (w.zeros_t.data_ptr() - a.zeros_t.data_ptr()) // 2 for w in qws[1:]] + [_BIAS] * len(pad)
    _q4_kernel[(sum(tiles), split, row_tiles)](
        x, xs, a.qtiled, a.scales_t, a.zeros_t, y, part, locks, m, ns[0], k // 2, x.stride(0), n_groups, per, split,
        *(ns[1:] + pad), *bounds, *dq, *dsc, *dz, *(offs[1:len(ns)] + pad),
        SEGS=len(qws), BLOCK_N=cfg.block_n, G=g, ROWS_=rows, TILE=a.tile,
        ASM=x.dtype == torch.bfloat16 and not INTERPRET, IEEE=x.dtype == torch.float32, WA=cfg.wa, ZC=cfg.zc,
        PDL=on, **({"DISCARD": True} if discard else {}),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(on))
    return [y[m * o:m * o + m * v].view(m, v) for v, o in zip(ns, offs)]
