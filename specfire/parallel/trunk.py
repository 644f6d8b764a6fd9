"""MeshTrunk: the Trunk interface over the mesh, on rank 0.

Rank 0 is the caller's process, the driver: it owns requests, the tokenizer, sampling, the route
selector and the drafters (the MTP head lives whole on rank 0), and it runs the same Engine and
speculative step as one device, over a MeshTrunk. Every Trunk call on rank 0 is sent to every rank
(parallel/control.py), so every rank executes the same forward, the same per-row capture and the
same `commit(n)`.

The mesh holds several sequences: `view()` is another MeshTrunk over the same mesh addressing
one more slot (every rank allocates its shard of that slot's recurrent state; its KV is in the
rank's pool, taken as it grows and given back at `end`), and `verify_packed` sends several slots'
verifies as one call, one packed forward on every rank (runtime/trunk.py verify_many).
"""
from __future__ import annotations

import weakref
from typing import Any, Generator

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import MeshError
from ..kernels.gemv import linear_prefix
from ..params import check_draft_vocab
from ..runtime.trunk import PREFILL_PIECE, LocalTrunk, Rows, prefill_cuts
from .control import DRAFT, END, NEW_SLOT, PACKED, RANK_STATS, RANK_TIME, ROWS_MAX, STAT_NAMES, Call, RankExecutor, SharedIds
from .draft import shard_argmax
from .lifecycle import Mesh


def row_groups(counts: list[int], most: int | None) -> list[list[int]]:
    """Indices of `counts` in order, cut into groups of at most `most` rows (None: one group)."""
    groups: list[list[int]] = []
    rows = 0
    for i, c in enumerate(counts):
        if not groups or (most is not None and rows + c > most):
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += c
    return groups


class MeshTrunk:
    """Same results as LocalTrunk: hidden rows are replicated on every rank, logits are gathered
    to rank 0. On CUDA every rank replays its rows forward (decode, each verify row count) from
    CUDA graphs in lockstep, the collectives inside them through torch symmetric memory
    (parallel/symm.py; NCCL capture hung on our GPU machine); prefill runs eagerly over NCCL."""


    def __init__(self, mesh: Mesh, trunk: LocalTrunk, tp: int, dtype: torch.dtype,
                 drafter_vocab: tuple[torch.Tensor, torch.Tensor] | None = None, draft_vocab: int | None = None):
        self.cfg: ModelConfig = trunk.cfg
        self.max_seq = trunk.max_seq
        self.device = trunk.device
        self.tp = tp
        self._mesh = mesh
        self._local: LocalTrunk | None = trunk
        self._ex = RankExecutor(mesh.comm, trunk)
        self._dtype = dtype
        self._drafter_vocab = drafter_vocab     # whole (embedding, lm_head) on rank 0, or None
        self.draft_vocab = check_draft_vocab(draft_vocab, self.cfg.vocab_size)   # every rank's model has it too
        self._commits: list = []                # run on rank 0, sent with the next call (commits, draft chains)
        self.slot = 0                           # the sequence this trunk addresses on every rank
        self.piece = PREFILL_PIECE              # prompt rows per prefill call
        self._root = True                       # closing it closes the mesh (a view's close does not)
        self._finalizer = weakref.finalize(self, mesh.shutdown)
        self._draft_sharded = False
        self.draft_sharded = trunk.graphs_enabled   # sharded picks where the ranks replay graphs (docs/PERFORMANCE.md)

    embed_weight = None       # the drafter's embedding goes through `embed` (the fused chain steps are one device's)
    state = None              # each rank holds its shard of the slot's state: no copy here for a prefix.Fork

    @property
    def draft_sharded(self) -> bool:
        """The greedy MTP draft's picks are scored on every rank (`draft_pick`, parallel/draft.py):
        the default where the ranks replay CUDA graphs; rank 0's whole copy on the CPU (a gloo
        round trip costs more than its small lm_head there)."""
        return self._draft_sharded

    @draft_sharded.setter
    def draft_sharded(self, on: bool) -> None:
        """Asked for (before a draft: rank 0's captured draft graphs keep the mode they captured),
        the picks are sharded where the ranks have the draft collectives and the draft vocabulary
        does not fit in rank 0's shard (then rank 0 scores rows 0..N-1 of its whole copy, with no
        pick collective and nothing for the other ranks to do)."""
        inside = (self._drafter_vocab is not None and self.draft_vocab is not None
                  and self.draft_vocab <= self._local.model.plan.vocab_shard)
        self._draft_sharded = bool(on) and self._mesh.comm.draft_coll is not None and not inside

    @property
    def graphs_enabled(self) -> bool:
        """Every rank replays its rows forward from CUDA graphs (collectives through symmetric
        memory); rank 0 then holds the vocabulary (build._drafter_vocab), so the MTP draft chain
        is a graph too."""
        return self._local is not None and self._local.graphs_enabled

    def view(self) -> "MeshTrunk":
        """Another trunk over this mesh (weights shared on every rank) addressing a new slot: every
        rank allocates its shard of the slot's sequence state, or none does (torch.OutOfMemoryError
        here when a rank's device is full; the mesh goes on with the slots it has)."""
        flags = self._call(NEW_SLOT)
        if not all(flags):
            bad = [r for r, f in enumerate(flags) if not f]
            raise torch.OutOfMemoryError(f"tensor-parallel rank {bad[0]} has no memory for another sequence state")
        other = object.__new__(MeshTrunk)
        other.__dict__.update(self.__dict__)    # the same mesh, executor, pending riders and vocabulary
        other.slot, other._root = len(self._ex.slots) - 1, False
        return other

    @property
    def packing(self) -> Mesh:
        """Verifies of trunks over one mesh run as one packed call (runtime/trunk.py verify_many)."""
        return self._mesh

    def _header(self, name: str, *args: Any) -> tuple[Call, Any]:
        """The call, with the pending commits riding in its header (nothing sent yet)."""
        self._mesh.check()
        call, tensors = Call.of(name, *args, commits=tuple(self._commits), slot=self.slot)
        self._commits.clear()
        return call, tensors

    def _call(self, name: str, *args: Any) -> Any:
        call, tensors = self._header(name, *args)
        try:
            self._mesh.comm.send_command(call.header())
            return self._ex.run(call, tensors)
        except MeshError:
            raise
        except Exception as e:
            raise self._mesh.fail(e) from None
        except BaseException as e:  # e.g. KeyboardInterrupt mid-collective: the ranks are out of step
            self._mesh.fail(e)
            raise

    # ---- Trunk ---------------------------------------------------------------------------------
    def begin(self) -> None:
        self._call("begin")

    @property
    def kv_pool(self):
        """Rank 0's KV pool, alike on every rank (parallel/control.py): admission reserves on it."""
        return self._local.kv_pool if self._local is not None else None

    @property
    def kv_state(self):
        """Rank 0's shard of this slot's state: the MTP head's KV shares its block table in rank
        0's pool (every rank grows its slots alike: parallel/worker.py agree_pool)."""
        return self._ex.slots[self.slot].state if self._ex is not None else None

    def end(self) -> None:
        """The request ended: its KV blocks go back to the pool, here now and on the other ranks
        before the next call (a rider). Nothing to do on a closed or failed mesh."""
        if self._ex is None or self._mesh.closed:
            return
        self._ex.end(self.slot)
        self._commits.append((END, self.slot))

    def prefill(self, ids: torch.Tensor, logits: str = "last", ends: tuple[int, ...] = ()) -> Rows:
        return self._call("prefill", ids, logits, 0, tuple(ends))   # every rank: LocalTrunk.prefill's forwards

    def prefill_steps(self, ids: torch.Tensor, logits: str = "last",
                      ends: tuple[int, ...] = ()) -> Generator[None, None, Rows]:
        """`prefill`, one call per span between prefill_cuts (at most `piece` rows), yielding
        between them (other slots' steps run there): the forwards of one prefill call
        (LocalTrunk.prefill_steps), the same bits."""
        cuts = prefill_cuts(ids.shape[0], self.piece, tuple(ends))
        if len(cuts) == 1:
            return self.prefill(ids, logits, ends)
        hs, lg, a = [], [], 0
        for b in cuts:
            if a:
                yield
            rows = self._call("prefill", ids[a:b], logits, a, tuple(ends))
            hs.append(rows.hidden)
            if logits == "all" or b == ids.shape[0]:
                lg.append(rows.logits)
            a = b
        return Rows(torch.cat(lg), torch.cat(hs))

    def verify(self, ids: torch.Tensor, pos: int) -> Rows:
        if self._mesh.comm.symm is not None:    # the ids stay on the device: no host read to send the step
            return self._call("verify", SharedIds(ids), pos)
        return self._call("verify", ids, pos)

    def verify_packed(self, trunks: list["MeshTrunk"], ids: list[torch.Tensor], pos: list[int]) -> list[Rows]:
        """`verify` of several slots of this mesh, each slot's rows as its own verify gives them:
        one call per group of at most ROWS_MAX rows (what the captured collectives' buffers hold;
        a group of one is that slot's own verify), each rank's packed forward over those slots."""
        out: list[Rows] = []
        for group in row_groups([x.shape[0] for x in ids], ROWS_MAX if self._mesh.comm.symm is not None else None):
            if len(group) == 1:
                i = group[0]
                out.append(trunks[i].verify(ids[i], pos[i]))
                continue
            cat = torch.cat([ids[i] for i in group])
            got = self._call(PACKED, tuple(trunks[i].slot for i in group), tuple(int(pos[i]) for i in group),
                             tuple(ids[i].shape[0] for i in group),
                             SharedIds(cat) if self._mesh.comm.symm is not None else cat)
            out.extend(got)
        return out

    def _send(self, name: str, *args: Any) -> None:
        """A call only the other ranks run (rank 0 runs its side itself), pending work first."""
        call, _ = self._header(name, *args)
        try:
            self._mesh.comm.send_command(call.header())
        except Exception as e:
            raise self._mesh.fail(e) from None

    def draft_rounds(self, k: int, eager: int, replays: int, now: bool = False) -> None:
        """Before rank 0 runs a sharded greedy draft chain of k picks (`draft_pick` k times): the
        other ranks run their side as often, `eager` chains then `replays` replays of their graph.
        Eager work must start now (rank 0 waits on it); a replay alone rides in the next header
        (`now`: sent at once, e.g. for a probe that replays rank 0's graph by itself)."""
        if eager or now or self.device.type != "cuda":     # an emulated (CPU) replay runs at once
            self._send(DRAFT, k, eager, replays)
        else:
            self._commits.append((DRAFT, k, 0, replays))

    def draft_pick(self, h: torch.Tensor) -> torch.Tensor:
        """Rank 0's side of one greedy draft pick: the token [1] of argmax(h @ lm_head^T), scored
        by every rank on its vocabulary rows when `draft_sharded`, else over rank 0's logits."""
        if not self.draft_sharded:
            return self.lm_logits(h).argmax(-1)
        return shard_argmax(self._local.model, self._mesh.comm.draft_coll, h)

    def commit(self, n: int) -> None:
        """Runs here now and on the other ranks before the next call (no message of its own: an AR
        step is one header)."""
        self._mesh.check()
        try:
            self._ex.commit(n, self.slot)
        except Exception as e:
            raise self._mesh.fail(e) from None
        self._commits.append(n if self.slot == 0 else (self.slot, n))

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        return self._call("score", ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._drafter_vocab is not None:
            return F.embedding(ids, self._drafter_vocab[0])
        return self.mesh_embed(ids)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's logits [R, draft_vocab or V]: over rank 0's whole copy (rows 0..N-1 only
        with a draft vocabulary), else through the mesh (the whole vocabulary, then cut: the eager
        GPU mesh reads every row)."""
        if self._drafter_vocab is not None:
            return linear_prefix(h, self._drafter_vocab[1], self.draft_vocab, rows=True, exact=True).float()
        full = self.mesh_lm_logits(h)
        return full if self.draft_vocab is None else full[:, :self.draft_vocab]

    def lm_scores(self, h: torch.Tensor) -> torch.Tensor:
        """lm_logits (rank 0 scores in float32; the argmax is the pick either way)."""
        return self.lm_logits(h)

    def mesh_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel embedding across the mesh (masked lookup + all-reduce)."""
        return self._call("embed", ids)

    def mesh_lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel lm_head across the mesh (each rank 1/tp of the rows, gathered)."""
        return self._call("lm_logits", h.to(self._dtype))

    def close(self) -> None:
        """The first trunk's close closes the mesh (every rank frees every slot); a view's only
        lets go of it."""
        if self._root and self._local is not None:
            self._local.close()
        self._local = self._ex = self._drafter_vocab = None  # type: ignore[assignment]
        if self._root:
            self._finalizer()

    # ---- inspection ----------------------------------------------------------------------------
    def rank_stats(self) -> list[dict[str, int]]:
        """Per-rank call counters (every rank must have run exactly what rank 0 ran)."""
        table = self._call(RANK_STATS)
        return [dict(zip(STAT_NAMES, row)) for row in table.tolist()]

    def rank_time(self, rows: int, n: int, profile: str | None = None) -> list[float]:
        """Every rank replays its captured `rows`-row forward `n` times back to back (in lockstep,
        no host in between); per rank, seconds per replay (parallel/probe.py; `profile`: a path
        prefix for each rank's kernel table). A bench probe; NaN where no such graph exists."""
        table = self._call(RANK_TIME, rows, n, profile)
        return [float(r[0]) for r in table.tolist()]

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._mesh.workers]

    @property
    def closed(self) -> bool:
        return self._mesh.closed
