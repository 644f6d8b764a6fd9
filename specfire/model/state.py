"""What one sequence carries between forwards of the trunk: per-layer KV rows (attention) or conv
window + recurrent state with the log of the last rows-mode forward that commit replays (Gated
DeltaNet)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import FULL, ModelConfig
from ..kernels import gdn as gdn_ops
from .kvpool import SINK, BlockTable, KvPool, blocks_for


class RowsBook:
    """Every GDN layer's live state and rows log of one sequence, stacked over the layers so that a
    commit is one launch: rec [L, Hv, dk, dv] and conv [L, K-1, C] (each layer's `rec`, `conv` are
    views), and per row count T (allocated on first use, then fixed: graphs keep the addresses)
    k [L, T, Hv, dk], delta [L, T, Hv, dv], dec [L, T, Hv] and the full conv window [L, K-1+T, C]."""

    def __init__(self, rec: torch.Tensor, conv: torch.Tensor):
        self.rec, self.conv = rec, conv
        self.logs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.gdn_tables: dict = {}      # the fused GDN kernel's tables of this book (layers/gdn.py fused_core)

    def log(self, t: int) -> tuple[torch.Tensor, ...]:
        got = self.logs.get(t)
        if got is None:
            n_l, hv, dk, dv = self.rec.shape
            km1, c = self.conv.shape[1:]
            with torch.inference_mode(False):   # normal tensors: written in and out of inference mode
                got = self.logs[t] = tuple(torch.empty(sh, device=self.rec.device, dtype=torch.float32) for sh in (
                    (n_l, t, hv, dk), (n_l, t, hv, dv), (n_l, t, hv), (n_l, km1 + t, c)))
        return got


@dataclass
class LayerCache:
    """State of one layer for one sequence. Attention: k, v [rows, n_kv, D] (with a Q8 cache,
    int8 plus k_scale, v_scale [rows, n_kv, 1] float16, v stored key-minor under that view; see
    kernels/attention), a KV pool's rows with `blocks` the sequence's block table (model/kvpool.py;
    None: row p holds position p). GDN: conv window [K-1, conv_dim] and recurrent state [Hv, dk, dv], both
    float32, and `log`, what the last rows-mode forward left for commit: (k [R, Hv, dk], delta [R,
    Hv, dv], dec [R, Hv], conv `full` [K-1+R, C]), in `book` (slot `slot`) when the state has one."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    rec: torch.Tensor | None = None
    log: tuple[torch.Tensor, ...] | None = None
    book: RowsBook | None = None
    slot: int = 0

    def log_buffers(self, t: int) -> tuple[torch.Tensor, ...] | None:
        """Where a rows forward of t rows writes its log (k, delta, dec, full), or None (fresh tensors)."""
        return None if self.book is None else tuple(x[self.slot] for x in self.book.log(t))

    def set_log(self, k: torch.Tensor, delta: torch.Tensor, dec: torch.Tensor, full: torch.Tensor) -> None:
        """Keep a rows forward's log (copied into the book's buffers when they are not those already)."""
        bufs = self.log_buffers(k.shape[0])
        if bufs is None:
            self.log = (k, delta, dec, full)
            return
        for dst, src in zip(bufs, (k, delta, dec, full)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.log = bufs


@dataclass
class SequenceState:
    """Everything one sequence carries between forwards. Attention rows are addressed by position
    through the block table, so rollback of attention is free (it keeps the blocks); a rows forward
    leaves GDN states as they were and commit applies the rows accepted.

    `table`: the blocks of the KV pool this sequence holds. A state given a shared pool takes
    blocks as it grows (`grow`, before every forward that writes past them) and gives them back at
    `release`; one allocated without a pool owns a pool of its own holding all of max_seq."""

    layers: list[LayerCache] = field(default_factory=list)
    max_seq: int = 0
    book: RowsBook | None = None
    table: BlockTable | None = None
    shared: bool = False        # the pool is shared: blocks are taken on growth and given back
    ahead: int = 0              # positions grown past a forward's rows (an MTP head sharing the table)

    def grow(self, n: int) -> None:
        """Take the blocks positions 0..n-1 (and `ahead` more) need, before a forward writes them."""
        if self.shared and self.table is not None:
            self.table.grow(min(self.max_seq, n + self.ahead))

    def release(self) -> None:
        """The sequence ended: its blocks go back to a shared pool."""
        if self.shared and self.table is not None:
            self.table.release()

    @classmethod
    def allocate(cls, cfg: ModelConfig, n_layers_types: tuple[str, ...], max_seq: int,
                 device: torch.device, kv_dtype: torch.dtype,
                 n_kv: int | None = None, n_v_heads: int | None = None, conv_dim: int | None = None,
                 pool: KvPool | None = None, layer0: int = 0, table: BlockTable | None = None) -> "SequenceState":
        """`pool` (shared by sequences of one model): its attention layers layer0.. are this
        state's, and `table` (another state's: an MTP head beside its trunk) or a new one its blocks."""
        n_kv = n_kv if n_kv is not None else cfg.num_key_value_heads
        hv = n_v_heads if n_v_heads is not None else cfg.linear_num_value_heads
        cd = conv_dim if conv_dim is not None else cfg.conv_dim
        layers = []
        n_gdn = sum(t != FULL for t in n_layers_types)
        kk = cfg.linear_conv_kernel_dim
        book = None if not n_gdn else RowsBook(
            torch.zeros(n_gdn, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim, device=device, dtype=torch.float32),
            torch.zeros(n_gdn, kk - 1, cd, device=device, dtype=torch.float32))
        shared = pool is not None
        if not shared:
            n_attn = sum(t == FULL for t in n_layers_types)
            pool = KvPool([n_kv] * n_attn, cfg.head_dim, blocks_for(max_seq) + SINK, device, kv_dtype)
        if table is None:
            table = pool.table(max_seq)
            if not shared:
                table.grow(max_seq)
        j = layer0
        for t in n_layers_types:
            if t == FULL:
                layers.append(LayerCache(k=pool.k[j], v=pool.v[j], k_scale=pool.k_scale[j], v_scale=pool.v_scale[j],
                                         blocks=table.ids))
                j += 1
            else:
                i = sum(lc.rec is not None for lc in layers)
                layers.append(LayerCache(conv=book.conv[i], rec=book.rec[i], book=book, slot=i))
        return cls(layers=layers, max_seq=max_seq, book=book, table=table, shared=shared)

    @torch.inference_mode()
    def reset(self) -> None:
        """Start a new sequence: zero the recurrent state. KV rows need no clearing (reads are
        bounded by position)."""
        for lc in self.layers:
            if lc.rec is not None:
                lc.rec.zero_()
                lc.conv.zero_()
                lc.log = None

    @torch.inference_mode()
    def commit(self, n: int) -> None:
        """Make the recurrent state that after row n of the last rows-mode forward: rows 0..n of its
        log applied to the live state in place (kernels/gdn commit_rows: the same float operations
        as the forward, so the same bits), and the conv window after row n copied. With a book
        (`allocate`) every layer goes in one launch and one copy."""
        layers = [lc for lc in self.layers if lc.rec is not None]
        if not layers:
            return
        if any(lc.log is None for lc in layers):
            raise RuntimeError("commit() without a preceding rows-mode forward")
        t = layers[0].log[0].shape[0]
        if not 0 <= n < t or any(lc.log[0].shape[0] != t for lc in layers):
            raise ValueError(f"commit({n}): the last rows-mode forward logged {t} row(s) (n must be in 0..{t - 1})")
        kk = layers[0].conv.shape[0] + 1
        book = self.book
        if book is not None and t in book.logs and _stacked(book, layers, t):
            k, delta, dec, full = book.logs[t]
            gdn_ops.commit_rows(book.rec, k, delta, dec, n + 1)
            book.conv.copy_(full[:, n + 1:n + kk])
        else:
            for lc in layers:
                k, delta, dec, full = lc.log
                gdn_ops.commit_rows(lc.rec[None], k[None].contiguous(), delta[None].contiguous(),
                                    dec[None].contiguous(), n + 1)
                lc.conv.copy_(full[n + 1:n + kk])
        for lc in layers:
            lc.log = None


def _stacked(book: RowsBook, layers: list[LayerCache], t: int) -> bool:
    """Whether the layers' logs are the book's (then, as `allocate` laid them out, slot i of every
    stacked buffer is layer i's, its live state included): one launch for every layer."""
    logs = book.logs[t]
    return len(layers) == book.rec.shape[0] and all(
        lc.book is book and all(x._base is y for x, y in zip(lc.log, logs)) for lc in layers)


@dataclass
class Segments:
    """Several sequences' rows in one rows-mode forward (runtime/trunk.py verify_packed): sequence i
    is rows spans[i] of the packed input, at positions pos0s[i].., over states[i]."""

    states: list[SequenceState]
    pos0s: list                # each an int, or a one-element device tensor (CUDA-graph replay)
    spans: list[tuple[int, int]]
    cos_sins: list = field(default_factory=list)     # each sequence's rotary (set by the forward)
    gdn_tables: dict = field(default_factory=dict)   # the fused GDN kernel's sequence table (layers/gdn.py)
    attn_pack: object = None    # the fused attention's tables of these sequences (kernels/attention RowsPack)

    @classmethod
    def of(cls, states: list[SequenceState], pos0s: list, counts: list[int]) -> "Segments":
        ends = [sum(counts[:i + 1]) for i in range(len(counts))]
        return cls(list(states), list(pos0s), [(e - c, e) for c, e in zip(counts, ends)])

    def layer(self, i: int) -> list[LayerCache]:
        return [s.layers[i] for s in self.states]

    @staticmethod
    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

