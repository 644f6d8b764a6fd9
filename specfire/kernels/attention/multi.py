"""Several sequences' decode / verify rows in one launch per attention kernel (a packed verify:
model/state.py Segments). The kernels' programs read their sequence's first row, row count and
position, and its layer cache's addresses, from small int64 device tables; each program then does
exactly what it does when its sequence runs alone, so every sequence's rows get those bits.

The tables of a packing (`RowsPack`) and of a set of caches (`cache_table`) are made once, outside
any CUDA-graph capture (the packed graphs' eager warm-ups make them), and kept by the pack that a
captured graph keeps; only the positions (`RowsPack.at`) are computed again at every forward.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
MAX_TABLES = 1024       # small int64 tables by content; a pack keeps its own alive while it is used


def _table(device: torch.device, rows: tuple) -> torch.Tensor:
    """The int64 device tensor of `rows`, made once per content (never inside a graph capture)."""
    key = (str(device), rows)
    got = _TABLES.get(key)
    if got is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention tables: a packing's tables are made before its graph capture "
                               "(by the eager warm-up), not inside it")
        while len(_TABLES) >= MAX_TABLES:
            _TABLES.popitem(last=False)
        got = _TABLES[key] = torch.tensor(rows, dtype=torch.int64, device=device)
    else:
        _TABLES.move_to_end(key)
    return got


def _layout(x: torch.Tensor | None) -> tuple:
    """What a kernel bakes in from a cache tensor besides its address."""
    if x is None:
        return (None,)
    return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset(), x.untyped_storage().nbytes(), str(x.device))


def _parts(lc) -> tuple:
    """A layer cache's tensors a launch addresses: k, v, k_scale, v_scale and its block table
    (kernels/attention/paged.py; None: contiguous)."""
    return lc.k, lc.v, lc.k_scale, lc.v_scale, getattr(lc, "blocks", None)


def cache_table(lcs: list) -> tuple[torch.Tensor, bool]:
    """(int64 [n, 5] table of each layer cache's k, v, k_scale, v_scale and block table addresses
    (0 where absent), whether the first four are all 16-byte aligned). Every cache must be laid out
    as the first (paged or not alike)."""
    first = [_layout(x) for x in _parts(lcs[0])]
    for i, lc in enumerate(lcs[1:], 1):
        if [_layout(x) for x in _parts(lc)] != first:
            raise ValueError(f"attention over several sequences: sequence {i}'s layer cache is laid out "
                             "unlike sequence 0's (shape, strides, dtype and storage must match)")
    rows = tuple(tuple(0 if x is None else x.data_ptr() for x in _parts(lc)) for lc in lcs)
    return _table(lcs[0].k.device, rows), all(p % 16 == 0 for r in rows for p in r[:4])


@dataclass
class Launch:
    """What one multi-sequence launch reads (kernel.py attention_rows_triton `multi`)."""

    seqs: torch.Tensor          # int64 [n, 2]: each sequence's first row and row count
    row_seq: torch.Tensor       # int64 [R]: each row's sequence
    pos: torch.Tensor           # int64 [n]: each sequence's first position (this forward's)
    table: torch.Tensor         # int64 [n, 5]: each sequence's cache and block table addresses (cache_table)
    align: bool                 # every address in `table` 16-byte aligned
    n: int                      # sequences
    rows_max: int               # the most rows of one sequence (the grid's tiles cover it)
    n_keys: int | None          # the most keys a row reads + 1, or None: positions on the device,
                                # the launch covers the whole cache (as a lone graph replay does)


class RowsPack:
    """Sequences at rows spans[i] of the packed rows: the static tables, then per forward (`at`)
    each sequence's position and the rotary rows of every row."""

    def __init__(self, spans: list[tuple[int, int]], device: torch.device):
        if not spans or spans[0][0] != 0 or any(b <= a for a, b in spans) or any(
                b != c for (_, b), (c, _) in zip(spans, spans[1:])):
            raise ValueError(f"attention over several sequences: spans {spans} must tile the rows in order, "
                             "each non-empty")
        self.spans, self.device = [tuple(sp) for sp in spans], torch.device(device)
        self.seqs = _table(self.device, tuple((a, b - a) for a, b in self.spans))
        self.row_seq = _table(self.device, tuple(i for i, (a, b) in enumerate(self.spans) for _ in range(a, b)))
        self.rows_max = max(b - a for a, b in self.spans)
        self.pos: torch.Tensor | None = None
        self.pos0s: list = []
        self.n_keys: int | None = None
        self.rotary = None          # (cos, sin, by position) of this forward
        self._for = None
        self._caches: dict[tuple, tuple[torch.Tensor, bool]] = {}

    def at(self, pos0s: list, cos_sins: list) -> None:
        """This forward's positions (ints, or one-element device tensors: graph replay) and each
        sequence's rotary; again for a new `cos_sins` list (each forward sets its own)."""
        if self._for is cos_sins:
            return
        if len(pos0s) != len(self.spans) or len(cos_sins) != len(self.spans):
            raise ValueError(f"attention over several sequences: {len(self.spans)} spans, {len(pos0s)} positions, "
                             f"{len(cos_sins)} rotaries")
        on_device = [isinstance(p, torch.Tensor) for p in pos0s]
        if all(on_device):
            self.pos = torch.cat([p.reshape(1).to(torch.int64) for p in pos0s])
            self.n_keys = None
        elif not any(on_device):
            self.pos = torch.tensor([int(p) for p in pos0s], dtype=torch.int64, device=self.device)
            self.n_keys = max(int(p) + b - a for p, (a, b) in zip(pos0s, self.spans))
        else:
            raise ValueError("attention over several sequences: positions must be all ints or all device tensors")
        self.rotary = _rotary(cos_sins)
        self.pos0s, self._for = list(pos0s), cos_sins

    def launch(self, lcs: list) -> Launch:
        """The launch over these sequences' layer caches `lcs` (one per sequence, in span order)."""
        if self.pos is None:
            raise RuntimeError("RowsPack.launch before at(): no positions for this forward")
        if len(lcs) != len(self.spans):
            raise ValueError(f"attention over several sequences: {len(lcs)} caches for {len(self.spans)} sequences")
        key = tuple(0 if x is None else x.data_ptr() for lc in lcs for x in _parts(lc))
        got = self._caches.get(key)
        if got is None:
            got = self._caches[key] = cache_table(lcs)
        return Launch(self.seqs, self.row_seq, self.pos, got[0], got[1], len(self.spans), self.rows_max, self.n_keys)


def _rotary(cos_sins: list):
    """(cos, sin, table): one rotary table that rows index by position (every sequence's the same
    kernels/head RopeTable), or every row's cos / sin rows, concatenated in row order."""
    from ..head import RopeTable
    if all(isinstance(cs, RopeTable) for cs in cos_sins):
        if any(cs is not cos_sins[0] for cs in cos_sins):
            raise ValueError("attention over several sequences: the sequences' rotary tables differ")
        return cos_sins[0][0], cos_sins[0][1], True
    if any(isinstance(cs, RopeTable) for cs in cos_sins):
        raise ValueError("attention over several sequences: rotary tables and per-row rotaries mixed")
    if len(cos_sins) == 1:
        return cos_sins[0][0], cos_sins[0][1], False
    return torch.cat([c for c, _ in cos_sins]), torch.cat([s for _, s in cos_sins]), False
