"""Row-invariant skinny matmul (GEMV) on CUDA: the weight is the MMA's A operand (read once for all
rows), the row tile is fixed, the settings depend on (N, K) only and M is never specialised, so a
row's reduction order never depends on the other rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from .._triton import triton, tl

from .. import pdl
from ..pdl import wait as pdl_wait

ROWS = 16          # the row tile of decode / verify
PREFILL_ROWS = 64  # the row tile of a prefill (more than ROWS rows, not rows mode)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


SMEM_BUDGET = 200 * 1024   # bytes of shared memory a program may stage (the H200 has 227 KB)


def fit_stages(cfg: GemvConfig, tile: int, elt: int) -> int:
    """The pipeline depth that keeps (weight tile + x tile) x stages within SMEM_BUDGET; depth
    changes only how loads overlap, never the arithmetic."""
    stages = cfg.num_stages
    while stages > 1 and stages * (cfg.block_n + tile) * cfg.block_k * elt > SMEM_BUDGET:
        stages -= 1
    return stages


# (N, K) -> measured settings that the rules below do not give: the 27B GDN gate projections
# in_proj_b / in_proj_a (48 rows each) fill only 2 CTAs with the rule's settings; split-K 10 fills more
_MEASURED: dict = {(48, 5120): GemvConfig(block_n=16, block_k=128, split_k=10, num_warps=4, num_stages=3)}


def gemv_config(n: int, k: int) -> GemvConfig:
    """The launch configuration for a weight [n, k]; depends on the shape only (never on M).
    Picked by a sweep on the H200 (27B shapes, K = 5120..17408)."""
    if (n, k) in _MEASURED:
        return _MEASURED[(n, k)]
    if n >= 65536:   # lm_head
        return GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    if n >= 16384:   # MLP gate / up
        return GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=8, num_stages=3)
    if n >= 8192:    # attention q, GDN qkv
        return GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4)
    return GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_: tl.constexpr,
                 PARTIAL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                   # launched with PDL: the kernel before it done (kernels/pdl.py)
    pid_m = tl.program_id(0)        # row tiles innermost: the tiles that read one weight tile run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROWS_ + tl.arange(0, ROWS_)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)           # [BLOCK_N, ROWS] = (W x^T) tile
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)          # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)          # [ROWS, BLOCK_K]
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if not PARTIAL:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
    else:  # partials [split, M, N] float32, summed in a fixed order by _splitk_sum
        base = y_ptr + pid_s * M * N
        tl.store(base + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


@triton.jit(do_not_specialize=["MN"])
def _splitk_sum(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig | None = None, launch_n: int | None = None,
         tile: int = ROWS) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype; rows run in tiles of `tile` over grid axis 0
    (16: row-invariant, see the module doc; row_tile picks 64 for a prefill). `launch_n`: pick the launch settings of a matrix with that many
    rows (a column shard passes the whole matrix's N, so its elements are computed as the whole's)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemv: x has K={k} but w is {list(w.shape)}")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = cfg or gemv_config(launch_n or n, k)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # never launch an empty split
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    grid = (triton.cdiv(m, tile), triton.cdiv(n, cfg.block_n), split)
    stages = fit_stages(cfg, tile, x.element_size())
    on = pdl.on(x)
    if split == 1:
        _gemv_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile, PARTIAL=False, IEEE=ieee,
                           PDL=on, num_warps=cfg.num_warps, num_stages=stages, **pdl.launch(on))
        return y
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _gemv_kernel[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), n, k_per_split,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile, PARTIAL=True, IEEE=ieee,
                       PDL=on, num_warps=cfg.num_warps, num_stages=stages, **pdl.launch(on))
    blk = 1024
    _splitk_sum[(triton.cdiv(m * n, blk),)](part, y, m * n, SPLIT=split, BLOCK=blk, PDL=on, **pdl.launch(on))
    return y


_LOCKS: dict = {}


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """Per-device split-K arrival counters of the grouped launch (int32, zero between launches:
    the last program of a tile resets its own). Made before any CUDA-graph capture (kernels/q4
    QuantWeight makes them with the 4-bit kernel's)."""
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 12), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


GROUP_MAX = 4      # column projections of one input that one launch can hold
OUT_ALIGN = 64     # elements: where a grouped launch's outputs start in its buffer


@triton.jit(do_not_specialize=["M"])
def _gemv_group_kernel(x_ptr, w_ptr, y_ptr, M, K, stride_xm, N0, N1, N2, N3, T1, T2, T3, DW1, DW2, DW3, O1, O2, O3,
                       k_per_split, TOTAL, fin_ptr, lock_ptr, SEGS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, ROWS_: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr = False,
                       SEM: tl.constexpr = False, PDL: tl.constexpr = False):
    """_gemv_kernel over up to 4 weights of one input in one launch: column tiles [0, T1) are
    weight 0's, [T1, T2) weight 1's, ... (weight s at w_ptr + DWs elements, each [Ns, K]
    contiguous); output s is [M, Ns] at y + M * Os. Every tile runs the same loop as a
    launch of its weight alone with these settings would: the same bits, more programs.
    PARTIAL (split-K over grid axis 2): split s stores its float32 partial at y + s * TOTAL + (the
    output's place), TOTAL = the outputs' whole length, and one _splitk_sum adds them in split
    order, as gemv does for one weight; with SEM the last program of each tile to arrive (a counter
    per tile) adds them in the same order and writes fin_ptr, so no second launch is needed. The
    arrival order never enters the arithmetic. PDL: launched with PDL, waits first (kernels/pdl.py)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = N0
    t0 = 0
    dw = DW1 * 0
    dy = M * 0
    if SEGS > 1:
        sel = pid_t >= T1
        n, t0, dw, dy = tl.where(sel, N1, n), tl.where(sel, T1, t0), tl.where(sel, DW1, dw), tl.where(sel, M * O1, dy)
    if SEGS > 2:
        sel = pid_t >= T2
        n, t0, dw = tl.where(sel, N2, n), tl.where(sel, T2, t0), tl.where(sel, DW2, dw)
        dy = tl.where(sel, M * O2, dy)
    if SEGS > 3:
        sel = pid_t >= T3
        n, t0, dw = tl.where(sel, N3, n), tl.where(sel, T3, t0), tl.where(sel, DW3, dw)
        dy = tl.where(sel, M * O3, dy)
    offs_n = (pid_t - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROWS_ + tl.arange(0, ROWS_)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n
    m_mask = offs_m < M
    wp = w_ptr + dw
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(wp + offs_n[:, None] * K + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if PARTIAL:
        out_mask = n_mask[:, None] & m_mask[None, :]
        p_ptrs = y_ptr + dy + offs_m[None, :] * n + offs_n[:, None]
        tl.store(p_ptrs + pid_s * TOTAL, acc, mask=out_mask)
        if SEM:
            tl.debug_barrier()
            lock_ptr += pid_m * tl.num_programs(1) + pid_t            # a counter per (row tile, column tile)
            cnt = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
            if cnt == tl.num_programs(2) - 1:
                tot = tl.load(p_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                for sp in range(1, tl.num_programs(2)):
                    tot += tl.load(p_ptrs + sp * TOTAL, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(fin_ptr + dy + offs_m[None, :] * n + offs_n[:, None], tot.to(fin_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(lock_ptr, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptr + dy + offs_m[None, :] * n + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & m_mask[None, :])


def group_config(launch_ns: list[int], k: int) -> GemvConfig:
    """The launch settings of a group: those of its widest whole matrix. A function of the whole
    matrices' shapes, so every tensor-parallel degree computes each element alike."""
    return gemv_config(max(launch_ns), k)


def gemv_group(x: torch.Tensor, ws: list[torch.Tensor], launch_ns: list[int | None],
               tile: int = ROWS, cfg: GemvConfig | None = None) -> list[torch.Tensor]:
    """[x @ w.T for w in ws] in one launch with group_config's settings (launch_ns: each weight's
    whole N; None: its own). Each output is bit for bit gemv(x, w, group_config(...)). A column
    shard alone launches half the whole's programs; the shards of one input together fill the GPU
    as the whole matrices do. A split-K config runs one launch and one fixed-order sum for the whole group. `cfg` replaces
    group_config's settings (a benchmark's sweep)."""
    m, k = x.shape
    whole = [ln or w.shape[0] for w, ln in zip(ws, launch_ns)]
    cfg = cfg or group_config(whole, k)
    esz = ws[0].element_size()
    plain = all(w.dim() == 2 and w.shape[1] == k and w.is_contiguous() and w.dtype == ws[0].dtype
                and w.device == x.device and (w.data_ptr() - ws[0].data_ptr()) % esz == 0 for w in ws)
    if len(ws) == 1:
        return [gemv(x, w, launch_n=ln, tile=tile) for w, ln in zip(ws, launch_ns)]
    if not (plain and len(ws) <= GROUP_MAX):
        return [gemv(x, w, cfg, tile=tile) for w in ws]
    x = x.contiguous()
    ns = [w.shape[0] for w in ws] + [0] * (GROUP_MAX - len(ws))
    tiles = [triton.cdiv(v, cfg.block_n) for v in ns]
    dws = [(w.data_ptr() - ws[0].data_ptr()) // esz for w in ws[1:]] + [0] * (GROUP_MAX - len(ws))
    offs = [0]
    for v in ns:                          # each output starts 128-byte aligned, like its own tensor
        offs.append(offs[-1] + triton.cdiv(v, OUT_ALIGN) * OUT_ALIGN)
    y = torch.empty(m * offs[-1], device=x.device, dtype=x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k   # as gemv splits
    split = triton.cdiv(k, k_per_split)
    total = m * offs[-1]
    out = y if split == 1 else torch.empty(split * total, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, tile), sum(tiles), split)
    # split-K combined in the kernel (counters, zero between launches) where the counters exist or
    # can be made now (never during a CUDA-graph capture), else by one _splitk_sum launch
    have = _LOCKS.get(x.device)
    sem = split > 1 and ((have is not None and have.numel() >= grid[0] * grid[1])
                                       or not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    locks = _locks(x.device, grid[0] * grid[1]) if sem else y
    on = pdl.on(x)
    _gemv_group_kernel[grid](x, ws[0], out, m, k, x.stride(0), *ns, tiles[0], tiles[0] + tiles[1],
                             tiles[0] + tiles[1] + tiles[2], *dws, *offs[1:4], k_per_split, total, y, locks,
                             SEGS=len(ws), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_=tile,
                             IEEE=x.dtype == torch.float32, PARTIAL=split > 1, SEM=sem, PDL=on,
                             num_warps=cfg.num_warps, num_stages=fit_stages(cfg, tile, x.element_size()),
                             **pdl.launch(on))
    if split > 1 and not sem:      # the padding between outputs is summed too (never read)
        _splitk_sum[(triton.cdiv(total, 1024),)](out, y, total, SPLIT=split, BLOCK=1024, PDL=on, **pdl.launch(on))
    return [y[m * o:m * o + m * v].view(m, v) for v, o in zip(ns[:len(ws)], offs)]


def row_tile(m: int, rows: bool) -> int:
    """Rows per program: 16 in rows mode (decode / verify: the same code for every row count), 64
    for a prefill of more than 16 rows (4x fewer passes over the weight; prefill rows need only
    be computed alike on every tensor-parallel degree, which a tile chosen by M gives)."""
    return ROWS if rows or m <= ROWS else PREFILL_ROWS
