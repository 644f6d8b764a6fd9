"""The Trunk interface (the target model wherever it runs) and the single-device trunk.

Rollback choice: a logged replay. A rows-mode forward (decode = 1 row, verify = k+1 rows) leaves
the live Gated DeltaNet state untouched and logs, per row, the state update's terms (k_t, delta_t,
exp(g_t): a few KB per layer) and the conv window; `commit(n)` applies rows 0..n of that log to
the live state in place, with the forward's own float operations (kernels/gdn commit_rows: one
launch over every layer on a GPU, one graph replay under CUDA graphs). Its traffic is one state
read and write per GDN layer whatever n; the forward writes no state (an earlier design stored the
state after every row, 151 MB a row on the 27B, and made commit a copy). Re-running whole rows
(snapshot + replay) would cost every projection again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Protocol

import torch

from ..config import ModelConfig
from ..kernels.small import greedy_accept_many
from ..model.kvpool import KvPool
from ..model.qwen35 import Qwen35Trunk, Segments, SequenceState, drain  # noqa: F401  (drain: runtime/prefix.py)
from ..params import check_draft_vocab

PREFILL_PIECE = 1024  # prompt rows per prefill forward (bounds attention-score memory)
# layers a prefill forward runs between pauses (other requests' steps run there), for a piece of
# PREFILL_PAUSE_ROWS rows or more; a smaller piece runs proportionally more (256 rows: 8 layers).
# On the 27B shape a 1024-row piece at 16k-32k positions costs ~2.5-3 ms a layer, so 4 layers stall
# the streams of a 16 ms round about as long again (p99 2.22x their median gap; 8 layers 4.0x, a
# whole piece 16.7x); a 256-row piece is bound by the host, so less than a quarter as fast a row
# (16 layers 3.53x, 8 layers 2.60x). Each pause costs the joining prompt one round of the others.
PREFILL_PAUSE = 4
PREFILL_PAUSE_ROWS = 512


def prefill_cuts(n: int, piece: int, ends: tuple[int, ...] = (), start: int = 0) -> list[int]:
    """Where the prefill of positions [start, n) ends its forwards: at every multiple of `piece`
    (from 0) and every turn end in `ends` (an earlier turn's prompt length), and at n. A function of
    the prompt alone, so a prefill resumed at any cut runs the forwards a cold one runs there."""
    cuts = set(range((start // piece + 1) * piece, n, piece))
    cuts.update(e for e in ends if start < e < n)
    return sorted(cuts) + [n]


class PackedAccept:
    """The greedy accept of every member of a packed verify (logits [T, V], its ids [T], each
    member's rows `spans`), run once for all on the first member's request, so a round with no
    plain greedy member launches none. `ids` may be a packed graph's buffer: every member of a
    round completes before the next round's verify replays (runtime/scheduler.py round)."""

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, spans: list[tuple[int, int]]):
        self.logits, self.ids, self.spans = logits, ids, spans
        self.got: tuple[torch.Tensor, torch.Tensor] | None = None

    def of(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.got is None:
            self.got = greedy_accept_many(self.logits, self.ids, self.spans)
        a, b = self.spans[j]
        return self.got[0][a:b], self.got[1][j]


@dataclass
class Rows:
    """Result of a forward over rows: float32 logits [R, V] and post-norm hidden states [R, H];
    from a packed verify (`pack`, this member's index `member`), `greedy`: the greedy accept of
    these raw rows against their drafts (targets [R], n), computed for every member at once."""

    logits: torch.Tensor
    hidden: torch.Tensor
    pack: PackedAccept | None = None
    member: int = 0

    @property
    def greedy(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.pack is None else self.pack.of(self.member)


def packed_rows(hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, spans: list[tuple[int, int]]) -> list[Rows]:
    """Each member's Rows of a packed verify (`spans` its rows, in the members' order), sharing
    one batched greedy accept (two launches a round on CUDA, not two a request): a request whose
    rows need no processing (greedy, no penalties or grammar) reads its own, the bits
    greedy_accept gives its rows alone."""
    ordered = sorted(spans)
    if (any(a >= b for a, b in ordered) or ordered[0][0] < 0 or ordered[-1][1] > logits.shape[0]
            or any(b > c for (_, b), (c, _) in zip(ordered, ordered[1:]))):
        raise ValueError(f"packed spans must be disjoint rows of the {logits.shape[0]}: {spans}")
    pack = PackedAccept(logits, ids, list(spans))
    return [Rows(logits[a:b], hidden[a:b], pack, j) for j, (a, b) in enumerate(spans)]


@dataclass
class Verify:
    """A verify forward a step waits for (runtime/spec.py prepare): `trunk.verify(ids, pos)`, which
    a scheduler may run together with other requests' in one packed forward (`verify_many`)."""

    trunk: "Trunk"
    ids: torch.Tensor
    pos: int
    route: str = "ar"                # the step's route (its k is ids' length less one)

    def run(self) -> Rows:
        return self.trunk.verify(self.ids, self.pos)


def verify_many(calls: list[Verify]) -> list[Rows]:
    """Every call's rows. Calls on trunks that pack together (one `packing` key: LocalTrunk.view
    slots over one model, MeshTrunk views over one mesh) share one `verify_packed`, which reads each
    weight once for all their rows and gives each row the bits of its own verify (model/qwen35.py
    Qwen35Trunk.packed); any other call runs alone."""
    out: list[Rows | None] = [None] * len(calls)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(calls):
        key = c.trunk.packing
        if key is not None:
            groups.setdefault(id(key), []).append(i)
        else:
            out[i] = c.run()
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = calls[idx[0]].run()
            continue
        trunks = [calls[i].trunk for i in idx]
        got = trunks[0].verify_packed(trunks, [calls[i].ids for i in idx], [calls[i].pos for i in idx])
        for i, rows in zip(idx, got):
            out[i] = rows
    return out  # type: ignore[return-value]


class Trunk(Protocol):
    """What the speculative step, the engine and the drafters use of the target model, whatever
    the topology (nothing else is read from a trunk)."""

    cfg: ModelConfig
    max_seq: int
    device: torch.device          # where ids go in and logits / hidden rows come out
    graphs_enabled: bool          # verify replays CUDA graphs, so the MTP draft chain may too
    draft_vocab: int | None       # lm_logits scores token ids 0..draft_vocab-1 only (None: all)
    embed_weight: torch.Tensor | None   # the table `embed` looks up, for the MTP head's fused steps (None: none)
    draft_sharded: bool           # greedy draft picks are the trunk's own (`draft_pick`, every rank of a mesh)
    packing: object | None        # trunks with one key verify together (`verify_packed`); None: alone
    state: SequenceState | None   # the sequence's state in this process (a prefix.Fork copies it); None: on a mesh's ranks
    kv_pool: KvPool | None        # the KV pool the views share (model/kvpool.py); None: each state holds max_seq
    kv_state: SequenceState | None  # the state whose block table the MTP head's KV shares (a mesh: rank 0's shard)

    def begin(self) -> None: ...                                   # new sequence: reset state
    def end(self) -> None: ...                                     # the sequence ended: its KV blocks back to the pool
    # logits "last" | "all"; hidden of all; forwards end at `ends` too (prefill_cuts); _steps yields between them
    def prefill(self, ids: torch.Tensor, logits: str = "last", ends: tuple[int, ...] = ()) -> Rows: ...
    def prefill_steps(self, ids: torch.Tensor, logits: str = "last",
                      ends: tuple[int, ...] = ()) -> Generator[None, None, Rows]: ...
    def verify(self, ids: torch.Tensor, pos: int) -> Rows: ...     # R rows at pos.., per-row capture
    def verify_packed(self, trunks: list, ids: list[torch.Tensor], pos: list[int]) -> list[Rows]: ...  # trunks' verifies, one forward
    def commit(self, n: int) -> None: ...                          # state := after row n of verify
    def score(self, ids: torch.Tensor) -> torch.Tensor: ...        # float32 logits [T, V]
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...        # for the MTP drafter
    def lm_logits(self, h: torch.Tensor) -> torch.Tensor: ...      # for the MTP drafter: float32 [R, draft_vocab or V]
    def lm_scores(self, h: torch.Tensor) -> torch.Tensor: ...      # lm_logits for a greedy pick (any dtype: same argmax)
    def draft_pick(self, h: torch.Tensor) -> torch.Tensor: ...     # the greedy draft token [1] of h [1, H]
    def draft_rounds(self, k: int, eager: int, replays: int, now: bool = False) -> None: ...  # the other ranks' side
    def close(self) -> None: ...


class LocalTrunk:
    """The trunk on one device. `draft_vocab` n: the MTP drafter's lm_logits scores token ids
    0..n-1 only, through a row-prefix view of the lm_head (params.check_draft_vocab; the verify
    always scores the whole vocabulary). `kv_pool` (model/kvpool.py): the KV pool the views of the
    model share, its first layers the trunk's attention layers (the MTP head's after them); None:
    the state holds its own KV of max_seq positions."""

    def __init__(self, model: Qwen35Trunk, max_seq: int, kv_dtype: torch.dtype, cuda_graphs: bool | None = None,
                 draft_vocab: int | None = None, kv_pool: KvPool | None = None):
        self.model = model
        self.cfg = model.cfg
        self.max_seq = max_seq
        self.draft_vocab = check_draft_vocab(draft_vocab, model.cfg.vocab_size)
        self.device = model.embed_tokens.weight.device
        self.piece = PREFILL_PIECE                # prompt rows per prefill forward
        self.pause = PREFILL_PAUSE                # layers per run of a prefill forward (0: no pauses)
        self.pause_rows = PREFILL_PAUSE_ROWS      # ... of a piece this many rows or more (fewer: more layers)
        self.kv_dtype = kv_dtype
        self.kv_pool = kv_pool
        self.state: SequenceState = model.new_state(max_seq, kv_dtype, kv_pool)
        if cuda_graphs is None:  # graphs need the attention kernel (it reads the position on the device)
            from ..kernels.attention import KERNEL_HEAD_DIMS
            cuda_graphs = self.device.type == "cuda" and self.cfg.head_dim in KERNEL_HEAD_DIMS
        self.graphs = None
        self.packs = None                         # graphs of packed verifies over this model's views
        if cuda_graphs:
            from .graphs import PackedGraphs, RowsGraphs
            self.graphs = RowsGraphs(model, self.state)
            self.packs = PackedGraphs(model)

    def view(self) -> "LocalTrunk":
        """Another trunk over the same model (weights shared) with its own sequence state and CUDA
        graphs: a slot for one more concurrent request (runtime/slots.py)."""
        other = LocalTrunk(self.model, self.max_seq, self.kv_dtype, self.graphs is not None, self.draft_vocab,
                           self.kv_pool)
        other.piece, other.pause, other.pause_rows = self.piece, self.pause, self.pause_rows
        other.packs = self.packs                  # one model: one set of packed graphs
        other.state.ahead = self.state.ahead      # every slot grows as far past its rows (the head's reach)
        return other

    @property
    def kv_state(self) -> SequenceState:
        """The state whose block table an MTP head's KV shares (runtime/drafters/mtp.py)."""
        return self.state

    def begin(self) -> None:
        self.state.reset()

    def end(self) -> None:
        """The sequence ended: its KV blocks go back to the pool."""
        self.state.release()

    @property
    def packing(self) -> Qwen35Trunk:
        """Views of one model verify together (verify_many)."""
        return self.model

    @property
    def graphs_enabled(self) -> bool:
        return self.graphs is not None

    def prefill(self, ids: torch.Tensor, logits: str = "last", start: int = 0, ends: tuple[int, ...] = ()) -> Rows:
        """Rows at positions start.. (0 after begin(); a prefix cache resumes later, on a cut of
        prefill_cuts, so the forwards are those of a prefill from 0)."""
        return drain(self.prefill_steps(ids, logits, start, ends))

    def pause_for(self, rows: int) -> int:
        """Layers a prefill forward of `rows` rows runs between pauses (0: none): about the same
        time whatever the piece."""
        if not self.pause:
            return 0
        return max(self.pause, self.pause * self.pause_rows // max(1, rows))

    @torch.inference_mode()
    def prefill_steps(self, ids: torch.Tensor, logits: str = "last", start: int = 0,
                      ends: tuple[int, ...] = ()) -> Generator[None, None, Rows]:
        """`prefill`, one forward per span between prefill_cuts (at most `piece` rows), yielding
        between them, so a scheduler runs other requests' steps while a long prompt is read (the
        same forwards, the same bits)."""
        hs, lg = [], []
        a = start
        for b in prefill_cuts(start + ids.shape[0], self.piece, ends, start):
            if a > start:
                yield
            last = b == start + ids.shape[0]
            self.state.grow(b)
            h, l = yield from self.model.forward_steps(ids[a - start:b - start], a, self.state, rows=False,
                                                       logits="all" if logits == "all" else ("last" if last else "none"),
                                                       pause=self.pause_for(b - a))
            hs.append(h)
            if l is not None:
                lg.append(l)
            a = b
        return Rows(torch.cat(lg), torch.cat(hs))

    @torch.inference_mode()
    def verify(self, ids: torch.Tensor, pos: int) -> Rows:
        self.state.grow(pos + ids.shape[0])
        if self.graphs is not None:
            h, l = self.graphs.run(ids, pos)
        else:
            h, l = self.model(ids, pos, self.state, rows=True, logits="all")
        return Rows(l, h)

    @torch.inference_mode()
    def verify_packed(self, trunks: list["LocalTrunk"], ids: list[torch.Tensor], pos: list[int]) -> list[Rows]:
        """`verify` of several slots over this model (self among or beside them) in one forward:
        each slot's rows as its own verify gives them, bit for bit (replayed from a CUDA graph per
        slots and row counts where the slots capture graphs: runtime/graphs.py PackedGraphs)."""
        for t, x, p in zip(trunks, ids, pos):
            t.state.grow(p + x.shape[0])
        if self.packs is not None:              # (the views of one model all capture graphs, or none)
            return packed_rows(*self.packs.run(trunks, ids, pos))
        segs = Segments.of([t.state for t in trunks], pos, [x.shape[0] for x in ids])
        x = torch.cat(ids)
        h, l = self.model.packed(x, segs)
        return packed_rows(h, l, x, list(segs.spans))

    def commit(self, n: int) -> None:
        if self.graphs is not None and self.graphs.attached(self.state):
            self.graphs.commit(n)
        else:
            self.state.commit(n)

    @torch.inference_mode()
    def score(self, ids: torch.Tensor) -> torch.Tensor:
        self.begin()
        return self.prefill(ids, logits="all").logits

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    @property
    def embed_weight(self) -> torch.Tensor | None:
        """The table `embed` looks up (the MTP head gathers from it inside its fused step), when
        `embed` is that plain lookup (not a mesh rank's vocabulary shard); else None."""
        e = self.model.embed_tokens
        return e.weight if type(e) is torch.nn.Embedding else None

    @torch.inference_mode()
    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is None:      # a mesh rank's sharded model takes no `vocab`
            return self.model.logits(h, rows=True)
        return self.model.logits(h, rows=True, vocab=self.draft_vocab)

    @torch.inference_mode()
    def lm_scores(self, h: torch.Tensor) -> torch.Tensor:
        """lm_logits in the lm_head product's own dtype, not widened to float32: for a greedy
        pick, whose argmax (first index of the maximum) is the same; one launch less."""
        return self.model.logits(h, rows=True, vocab=self.draft_vocab, widen=False)

    draft_sharded = False         # one device: the drafter picks from lm_logits / lm_scores itself

    def draft_pick(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_scores(h).argmax(-1)

    def draft_rounds(self, k: int, eager: int, replays: int, now: bool = False) -> None:
        """Nothing runs beside this device's chain."""

    def close(self) -> None:
        self.graphs = None
        self.packs = None
        self.state = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
