"""The canonical split of a row-parallel reduction, so tp = 1, 2, 4, 8 (and one device in the canonical
mode) compute the same bits: K in CHUNKS canonical chunks, float32 partials added in one fixed
pairwise tree; rank r holds a contiguous run of chunks and adds its own subtree."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNKS = 8
# CPU (MKL): a chunk's product equals the same chunk inside another shard only if its inputs start at
# the same alignment, so chunks whose bounds are not multiples of ALIGN elements are made contiguous
ALIGN = 16


def chunk_bounds(k_total: int) -> list[int]:
    return [k_total * j // CHUNKS for j in range(CHUNKS + 1)]


def degree_problem(tp: int) -> str | None:
    if CHUNKS % tp:
        return f"tp={tp} does not divide {CHUNKS} (every tensor-parallel reduction is cut into {CHUNKS} canonical chunks)"
    return None


def head_block(whole_heads: int) -> int:
    """Heads per library call in a canonical prefill (a mesh rank, or one device in the canonical
    mode): library kernels (SDPA, batched cuBLAS products) may pick their tiling from the number of
    heads in a call, so every degree calls them on blocks of this many heads; whole_heads / CHUNKS
    divides every rank's share (a degree divides CHUNKS), else one head a call."""
    return whole_heads // CHUNKS if whole_heads % CHUNKS == 0 and whole_heads >= CHUNKS else 1


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Adjacent pairs, level by level: the canonical order (len(parts) a power of two)."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


@dataclass(frozen=True)
class KSplit:
    """The canonical chunks [c0, c1) of a reduction over k_total inputs that a weight's columns hold."""

    k_total: int
    c0: int = 0
    c1: int = CHUNKS

    @classmethod
    def for_rank(cls, k_total: int, rank: int, tp: int) -> "KSplit":
        why = degree_problem(tp)
        if why is not None:
            raise ValueError(why)
        per = CHUNKS // tp
        return cls(k_total, rank * per, (rank + 1) * per)

    @property
    def bounds(self) -> list[int]:
        """Local column bounds of the held chunks (len c1 - c0 + 1)."""
        b = chunk_bounds(self.k_total)[self.c0:self.c1 + 1]
        return [v - b[0] for v in b]

    @property
    def k_local(self) -> int:
        b = chunk_bounds(self.k_total)
        return b[self.c1] - b[self.c0]

    @property
    def aligned(self) -> bool:
        return all(v % ALIGN == 0 for v in chunk_bounds(self.k_total))


def _rows_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The row-invariant CPU product (one batched row per entry, as ops.linear.linear_rows_ref)."""
    m = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)


class ChunkCache:
    """Per-weight state of the canonical product: contiguous CPU chunk copies (misaligned shapes),
    the chunk bounds on the device (GPU kernel), a dense dequantised copy of a 4-bit weight."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.chunks: list[torch.Tensor] | None = None
        self.bounds_dev: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None

    def get(self, w, split: KSplit, dtype: torch.dtype) -> tuple:
        key = (id(w), getattr(w, "data_ptr", lambda: 0)(), str(dtype))
        if key != self.key:
            self.key, self.chunks, self.bounds_dev, self.dense = key, None, None, None
        return key


def _dense(w, cache: ChunkCache) -> torch.Tensor:
    """A dense float32 weight: the tensor itself (float32) or a cached conversion (bf16 on the CPU,
    a 4-bit weight dequantised in its rotated basis)."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32:
        return w
    if cache.dense is None:
        cache.dense = w.dequantize() if not isinstance(w, torch.Tensor) else w.float()
    return cache.dense


def tree_stack(p: torch.Tensor) -> torch.Tensor:
    """tree_sum over dim 0 of a stacked [C, ...] tensor, one add per level (the same adds)."""
    while p.shape[0] > 1:
        p = p[0::2] + p[1::2]
    return p[0]


def _stacked_cpu(x: torch.Tensor, w: torch.Tensor, split: KSplit, rows: bool) -> torch.Tensor | None:
    """[C, M, N] float32 partials in one batched product per row (rows) or one for all (prefill),
    for a float32 weight whose chunks are equal and aligned; None otherwise. A batch entry is
    computed alike whatever the batch count (the property the rows path rests on), so a rank's
    4 chunks give the bits of the same 4 chunks among 8."""
    b = split.bounds
    c = len(b) - 1
    if not (split.aligned and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and x.dtype == torch.float32
            and w.is_contiguous() and all(b[i + 1] - b[i] == b[1] for i in range(c))):
        return None
    n, kc, m = w.shape[0], b[1], x.shape[0]
    wv = w.view(n, c, kc).permute(1, 2, 0)                                  # [C, kc, N]
    x = x.contiguous()
    if rows:
        if m == 1:
            return torch.bmm(x.view(c, 1, kc), wv)
        return torch.cat([torch.bmm(x[i].view(c, 1, kc), wv) for i in range(m)], dim=1)
    return torch.bmm(x.view(m, c, kc).transpose(0, 1), wv)


def partials_cpu(x: torch.Tensor, w, split: KSplit, rows: bool, cache: ChunkCache) -> list[torch.Tensor]:
    """float32 [M, N] partial sum of every held chunk (CPU reference; also any non-CUDA device)."""
    cache.get(w, split, x.dtype)
    b = split.bounds
    if not isinstance(w, torch.Tensor):          # 4-bit: rotate x group-locally, dense rotated weight
        x = w.prepare_input(x)
    xf = x.float()
    wd = _dense(w, cache)
    if split.aligned:
        xs = [xf[:, b[i]:b[i + 1]] for i in range(len(b) - 1)]
        ws = [wd[:, b[i]:b[i + 1]] for i in range(len(b) - 1)]
    else:
        xs = [xf[:, b[i]:b[i + 1]].contiguous() for i in range(len(b) - 1)]
        if cache.chunks is None:
            cache.chunks = [wd[:, b[i]:b[i + 1]].contiguous() for i in range(len(b) - 1)]
        ws = cache.chunks
    mm = _rows_mm if rows else F.linear
    return [mm(a, c) for a, c in zip(xs, ws)]
