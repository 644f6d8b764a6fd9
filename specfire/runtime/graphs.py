"""CUDA graphs for the rows forward (decode = 1 row, verify = k+1 rows), one graph per row count.

Why: a batch-1 step of these models is several hundred small kernels; launched eagerly from
Python they cost about 30 ms per step on the H200 whatever the model size (bench/decode.py,
docs/PERFORMANCE.md), far above the bandwidth bound. Replaying one captured graph removes that.

What makes the forward capturable: the position is a device tensor (read by the rotary, the KV
write and the attention kernel), every kernel's launch shape depends only on the row count and
the cache size, and the rows' log that `commit()` replays (each GDN layer's k, delta, decay and
conv window, in the sequence state's fixed buffers per row count) is re-attached to the sequence
state after each replay. The live recurrent state is only changed
by `commit()`, outside the graph, so capture and warm-up never disturb a sequence.
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ..model.qwen35 import Qwen35Trunk, SequenceState
from ..params import SamplingParams
from .sampling import Penalties, sampling_key

log = logging.getLogger("specfire")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor                       # [R] static input
    hidden: torch.Tensor                    # [R, H] static outputs
    logits: torch.Tensor                    # [R, V]
    logs: list[tuple[torch.Tensor, ...] | None]


class RowsGraphs:
    """Captures lazily, on the first call with a given row count, at the position of that call
    (the warm-up writes the same KV rows the call itself writes, so nothing is disturbed)."""

    def __init__(self, model: Qwen35Trunk, state: SequenceState):
        self.model, self.state = model, state
        dev = model.embed_tokens.weight.device
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}
        self.commits: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._rows = 0                      # row count of the last replay (whose log commit reads)

    def run(self, ids: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = ids.shape[0]
        self.pos.fill_(pos)
        g = self.graphs.get(r)
        if g is None:
            g = self.graphs[r] = self._capture(ids)
        g.ids.copy_(ids)
        g.graph.replay()
        self._attach(g)
        self._rows = r
        return g.hidden.clone(), g.logits.clone()

    def _attach(self, g: _Graph) -> None:
        for lc, log in zip(self.state.layers, g.logs):
            if lc.rec is not None:
                lc.log = log

    def logged(self, rows: int) -> None:
        """A packed graph's replay (PackedGraphs) left a log of `rows` rows in the state's fixed
        buffers: commit reads those, as after a replay of this slot's own graph of that many rows."""
        self._rows = rows

    def attached(self, state: SequenceState) -> bool:
        """Whether the state holds the log of a replay not yet committed."""
        return self._rows > 0 and any(lc.log is not None for lc in state.layers)

    def commit(self, n: int) -> None:
        """`SequenceState.commit(n)` after a replay, as one graph per (rows, n): the log is in the
        state's fixed buffers and the live state is allocated once, so the commit of every Gated
        DeltaNet layer replays as one launch (and one conv window copy)."""
        key = (self._rows, n)
        g = self.commits.get(key)
        if g is None:
            with torch.cuda.device(self.pos.device):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.state.commit(n)           # recorded, not run; it detaches the log
        g.replay()
        self.commits[key] = g
        for lc in self.state.layers:
            lc.log = None

    def _capture(self, ids: torch.Tensor) -> _Graph:
        with torch.cuda.device(ids.device):  # streams and the capture belong to the model's device
            return self._capture_on_device(ids)

    def _capture_on_device(self, ids: torch.Tensor) -> _Graph:
        ids_buf = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile and autotune every kernel outside the capture
            for _ in range(2):
                self.model(ids_buf, self.pos, self.state, rows=True, logits="all")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, logits = self.model(ids_buf, self.pos, self.state, rows=True, logits="all")
        logs = [lc.log for lc in self.state.layers]
        log.info("captured a CUDA graph for %d row(s)", ids.shape[0])
        return _Graph(graph, ids_buf, hidden, logits, logs)


@dataclass
class _PackedGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor                       # [sum R] static input
    hidden: torch.Tensor
    logits: torch.Tensor
    pos: torch.Tensor                       # [n] each member's first position (the graph's own)
    spans: list[tuple[int, int]]
    segs: object                            # the captured Segments: the device tables its launches read (GDN's, attention's)
    states: list                            # the states whose addresses the tables hold (kept: no address is reused meanwhile)
    logs: list[list[tuple[torch.Tensor, ...] | None]]   # per member, per layer: where a replay leaves its log
    tables: "_Tables | None" = None         # how to point the graph at other slots (None: it serves these only)


@dataclass
class _Tables:
    """Every address table a packed graph's launches read, in one device buffer, and what each
    holds: the GDN kernel's sequence table and each attention layer's cache table."""

    buf: torch.Tensor                       # int64, the tables' contents back to back (a rewrite writes it whole)
    gdn: bool                               # the GDN sequence table comes first
    attn: list[int]                         # the attention layers whose cache tables follow, in order
    aligned: tuple[bool, ...]               # the alignment each table was launched with (a kernel variant)


class PackedGraphs:
    """CUDA graphs of the packed verify forward (Qwen35Trunk.packed over several slots' states),
    one per row counts of its members: a step's hundreds of launches replayed as one, as a lone
    slot's RowsGraphs does. Which slots a graph serves is data, not code: every address a launch
    reads (each member's GDN state and log, its KV cache and block table) sits in device tables
    the graph owns, and each member's position in its own position buffer, so a round of other
    slots with the same row counts rewrites those tables (one copy) instead of capturing again; as
    requests join and leave, the graphs stay those of a few row patterns. The rows' logs land in
    each state's fixed buffers, so commit replays as after that slot's own graph. Shared by the
    views of one model (LocalTrunk.view); the least recently used graph goes past MAX_GRAPHS."""

    MAX_GRAPHS = 32

    def __init__(self, model: Qwen35Trunk):
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple, _PackedGraph] = OrderedDict()
        self.rebindable = True              # until a forward reads its states other than through tables
        self.captures = 0                   # graphs captured, and replays that re-pointed one at other slots
        self.rebinds = 0

    def run(self, trunks: list, ids: list[torch.Tensor], pos: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """(hidden [T, H], logits [T, V], the verify ids [T] as the replay read them, each slot's
        span of those rows); `trunks` are LocalTrunk views with graphs. The members run ordered by
        row count (a row's bits do not depend on its place in the pack), so the same counts in any
        order replay one graph. The ids buffer is the graph's: read it before the next replay."""
        order = sorted(range(len(ids)), key=lambda i: ids[i].shape[0])
        if order != list(range(len(ids))):
            h, l, x, got = self.run([trunks[i] for i in order], [ids[i] for i in order], [pos[i] for i in order])
            spans: list = [None] * len(ids)
            for i, sp in zip(order, got):
                spans[i] = sp
            return h, l, x, spans
        states = [t.state for t in trunks]
        key = tuple(x.shape[0] for x in ids)
        if not self.rebindable:             # graphs of these slots only
            key = (key, tuple(id(st) for st in states))
        g = self.graphs.get(key)
        if g is not None and not _same(g.states, states):
            logs = None if g.tables is None else rebind(g.tables, g.spans, g.states, states)
            if logs is None:
                del self.graphs[key]
                g = None
            else:
                g.states, g.logs = list(states), logs
                self.rebinds += 1
        if g is None:
            while len(self.graphs) >= self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
            with torch.cuda.device(ids[0].device):
                g = self._capture(states, ids, pos)
            if g.tables is None and self.rebindable:
                self.rebindable = False
                key = (key, tuple(id(st) for st in states))
            self.graphs[key] = g
        else:
            self.graphs.move_to_end(key)
        for i, p in enumerate(pos):
            g.pos[i:i + 1].fill_(p)
        for (a, b), x in zip(g.spans, ids):
            g.ids[a:b].copy_(x)
        g.graph.replay()
        for t, logs, x in zip(trunks, g.logs, ids):
            for lc, lg in zip(t.state.layers, logs):
                if lc.rec is not None:
                    lc.log = lg
            t.graphs.logged(x.shape[0])
        hidden, logits = g.hidden.clone(), g.logits.clone()     # one copy of every slot's rows (the next replay overwrites)
        return hidden, logits, g.ids, list(g.spans)

    def _capture(self, states: list, ids: list[torch.Tensor], pos: list[int]) -> _PackedGraph:
        from ..model.state import Segments
        ids_buf = torch.cat(ids)
        pos_buf = torch.tensor(pos, dtype=torch.long, device=ids_buf.device)
        segs = Segments.of(states, [pos_buf[i:i + 1] for i in range(len(states))], [x.shape[0] for x in ids])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile and autotune outside the capture (same KV rows as the call)
            for _ in range(2):
                self.model.packed(ids_buf, segs)
        torch.cuda.current_stream().wait_stream(side)
        tables = own_tables(segs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, logits = self.model.packed(ids_buf, segs)
        logs = [[lc.log for lc in st.layers] for st in states]
        self.captures += 1
        log.info("captured a CUDA graph for %d slots' %d rows", len(states), ids_buf.shape[0])
        return _PackedGraph(graph, ids_buf, hidden, logits, pos_buf, segs.spans, segs, list(states), logs, tables)


@dataclass
class _FnGraph:
    replay: Callable[[], None]
    inputs: tuple[torch.Tensor, ...]        # static copies the replay reads
    outputs: tuple[torch.Tensor, ...]       # what the replay writes


class FnGraphs:
    """One CUDA graph per key for a function of tensors returning a tuple of tensors: static copies
    of the inputs feed it, its outputs are fixed buffers (returned as clones: a replay overwrites
    them). `keep`: tensors the capture's warm-up must leave as they were (a device random stream's
    state: otherwise the warm-up would consume numbers the eager path does not). `emulate` (CPU,
    tests): the same protocol run eagerly, so a CPU test can compare it with the eager path."""

    WARMUP = 2          # eager runs before a capture (compile and autotune every kernel)
    MAX_GRAPHS = 64     # keys are per sampling / penalty values, which requests choose: the least
                        # recently used graph goes past this many (a later request recaptures it)

    def __init__(self, device: torch.device, emulate: bool = False):
        self.device, self.emulate = torch.device(device), emulate
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple, _FnGraph] = OrderedDict()

    def clear(self) -> None:
        self.graphs.clear()

    def run(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
            keep: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
        g = self.graphs.get(key)
        if g is None:
            while len(self.graphs) >= self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
            g = self.graphs[key] = self._capture(fn, inputs, keep)
            log.info("captured a graph for %s", key)
        else:
            self.graphs.move_to_end(key)
        for dst, src in zip(g.inputs, inputs):
            dst.copy_(src)
        g.replay()
        return tuple(o.clone() for o in g.outputs)

    def _capture(self, fn, inputs, keep) -> _FnGraph:
        ins = tuple(x.clone() for x in inputs)
        saved = [t.clone() for t in keep]
        if self.emulate:
            outs = tuple(o.clone() for o in fn(*ins))
            for t, v in zip(keep, saved):
                t.copy_(v)

            def replay() -> None:
                for o, r in zip(outs, fn(*ins)):
                    o.copy_(r)
            return _FnGraph(replay, ins, outs)
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (kernel compilation)
                for _ in range(self.WARMUP):
                    fn(*ins)
            torch.cuda.current_stream().wait_stream(side)
            for t, v in zip(keep, saved):
                t.copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outs = tuple(fn(*ins))
        return _FnGraph(graph.replay, ins, outs)


@dataclass
class _ChainGraph:
    replay: Callable[[Callable[..., torch.Tensor]], None]   # given the chain (an emulated replay runs it)
    toks: torch.Tensor                      # [sum R] static inputs
    hidden: torch.Tensor                    # [sum R, H]
    pos: torch.Tensor                       # [S] each member's first position
    n: torch.Tensor                         # [S] each member's accepted count (the row its chain starts after)
    drafts: torch.Tensor                    # [S, k] the replay's output
    segs: list                              # the catch-up's and the steps' Segments (their tables are the graph's)
    tables: list | None                     # those Segments' tables, re-pointable (None: these states only)
    states: list                            # the head states the tables address now
    keep: tuple = ()                        # other tensors the replay reads (freed, their memory would be reused)


class PackedChains:
    """CUDA graphs of the packed greedy draft chain (drafters/chain.py packed_chain_after) that a
    round's MTP requests draft with together: a catch-up and k - 1 steps of the head, dozens of
    launches each, replayed as one, one graph per (members, rows, k, feed). As PackedGraphs does
    for the trunk, the graph owns every table its attention launches read (each member's head KV
    and block table), so a round of other slots rewrites them (`rebind`) instead of capturing
    again. The slots' drafters of one head share one (`for_head`). `emulate` (CPU tests): the
    same protocol, each replay the eager chain over the captured Segments, whose fused launches
    read the graph's tables as a replay does."""

    MAX_GRAPHS = 16

    def __init__(self, device: torch.device, emulate: bool = False):
        self.device, self.emulate = torch.device(device), emulate
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple, _ChainGraph] = OrderedDict()
        self.captures = 0
        self.rebinds = 0

    def run(self, chain: Callable[..., torch.Tensor], states: list, toks: list[torch.Tensor],
            hidden: list[torch.Tensor], pos: list[int], n: list[torch.Tensor], k: int, feed: str) -> torch.Tensor:
        """Drafts [S, k] of each member's chain: `chain(catch, step, step_pos, starts, toks, hidden,
        n, k, feed)` is packed_chain_after over the head."""
        key = (tuple(t.shape[0] for t in toks), k, feed)
        own = (key, tuple(id(st) for st in states))     # a graph whose tables are not re-pointable
        g = self.graphs.get(key) or self.graphs.get(own)
        if g is not None and not _same(g.states, states):
            if all(rebind(tb, sg.spans, g.states, states) is not None for tb, sg in zip(g.tables, g.segs)):
                g.states = list(states)
                self.rebinds += 1
            else:
                del self.graphs[key]
                g = None
        if g is None:
            while len(self.graphs) >= self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
            g = self._capture(chain, states, toks, hidden, pos, n, k, feed)
            self.graphs[key if g.tables is not None else own] = g
        else:
            self.graphs.move_to_end(key if g.tables is not None else own)
        _copy_in(g.pos, pos)
        g.toks.copy_(torch.cat(toks))
        g.hidden.copy_(torch.cat(hidden))
        g.n.copy_(torch.cat([x.reshape(1) for x in n]))
        g.replay(chain)
        return g.drafts.clone()

    def _capture(self, chain, states, toks, hidden, pos, n, k, feed) -> _ChainGraph:
        from ..model.state import Segments
        ids, hid = torch.cat(toks), torch.cat(hidden)
        nb = torch.cat([x.reshape(1) for x in n])
        pos_buf = torch.tensor(pos, dtype=torch.long, device=ids.device)
        step_pos = pos_buf.clone()
        counts = [t.shape[0] for t in toks]
        starts = torch.tensor([sum(counts[:i]) for i in range(len(counts))], dtype=torch.long, device=ids.device)
        catch = Segments.of(states, [pos_buf[i:i + 1] for i in range(len(states))], counts)
        step = Segments.of(states, [step_pos[i:i + 1] for i in range(len(states))], [1] * len(states))
        segs = [catch, step] if k > 1 else [catch]
        fn = lambda ch: ch(catch, step, step_pos, starts, ids, hid, nb, k, feed)    # noqa: E731
        self.captures += 1
        if self.emulate:                    # (the chain comes with each call: nothing here keeps the head alive)
            drafts = fn(chain).clone()
            tables = [own_tables(sg) for sg in segs]
            return _ChainGraph(lambda ch: drafts.copy_(fn(ch)), ids, hid, pos_buf, nb, drafts, segs,
                               None if any(t is None for t in tables) else tables, list(states), (step_pos, starts))
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up: compile, autotune and make the tables (the call's own KV rows)
                for _ in range(FnGraphs.WARMUP):
                    fn(chain)
            torch.cuda.current_stream().wait_stream(side)
            tables = [own_tables(sg) for sg in segs]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                drafts = fn(chain)
        log.info("captured a CUDA graph for %d slots' draft chains (k=%d)", len(states), k)
        return _ChainGraph(lambda ch: graph.replay(), ids, hid, pos_buf, nb, drafts, segs,
                           None if any(t is None for t in tables) else tables, list(states), (step_pos, starts))

    @staticmethod
    def of(head: torch.nn.Module) -> "PackedChains | None":
        """The chain graphs of `head`'s drafters, if any ran."""
        return _CHAINS.get(head)

    @staticmethod
    def for_head(head: torch.nn.Module, device: torch.device, emulate: bool) -> "PackedChains":
        """The chain graphs the slots' drafters of `head` share."""
        got = _CHAINS.get(head)
        if got is None or got.emulate != emulate:
            got = _CHAINS[head] = PackedChains(device, emulate)
        return got


_CHAINS: "weakref.WeakKeyDictionary[torch.nn.Module, PackedChains]" = weakref.WeakKeyDictionary()


def _same(a: list, b: list) -> bool:
    """The same state objects in the same order (a graph's tables address these already)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


Chain = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def penalty_key(pen: Penalties | None, sp: SamplingParams | None) -> tuple | None:
    """What a captured penalty-aware greedy chain bakes in: the penalty values and the device
    statistics it reads (fixed buffers, updated in place); None for a chain without penalties."""
    if pen is None or sp is None or not sp.penalized:
        return None
    return (float(sp.repetition_penalty), float(sp.frequency_penalty), float(sp.presence_penalty),
            pen.counts.data_ptr(), pen.prompt.data_ptr())


class DraftGraphs:
    """The MTP draft chain (`drafters/chain.py draft_chain`, the same function the eager path runs) as one
    CUDA graph per (pending rows m, draft length k, sampling params): greedy, or sampled from a
    device random stream (runtime/rng.py) whose counter the replay advances. The position is a
    device tensor, as in RowsGraphs."""

    WARMUP = FnGraphs.WARMUP

    def __init__(self, chain: Chain, device: torch.device, emulate: bool = False):
        self.chain = chain                  # (toks, hidden, pos tensor, k, sp, rng) -> (drafts [k], q [k, V] | None)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.fns = FnGraphs(device, emulate)

    @property
    def graphs(self) -> dict:
        return self.fns.graphs

    @property
    def warmup(self) -> int:
        """Eager runs of the chain before its first replay (an emulated capture runs it once)."""
        return 1 if self.fns.emulate else self.WARMUP

    def captured(self, m: int, k: int, kind: str | None = None) -> bool:
        """Whether the greedy chain over m pending rows and k drafts replays without a capture
        (`kind` "after": the chain from a device row index, `draft_after`)."""
        return (m, k, kind) in self.fns.graphs

    def draft_after(self, chain, toks: torch.Tensor, hidden: torch.Tensor, pos0: int, n: torch.Tensor,
                    k: int, pen=None, pen_sp=None) -> torch.Tensor:
        """The greedy chain(toks, hidden, pos tensor, n, k) -> drafts [k] over all of a verify's rows
        from row n ([1], on the device), replayed from a graph per (rows, k). `pen`, `pen_sp`: a
        penalised request's statistics and parameters; its graph is keyed by their values and
        buffers (`penalty_key`) and reads the statistics in place at every replay."""
        pkey = penalty_key(pen, pen_sp)
        self.pos.fill_(pos0)
        key = (toks.shape[0], k, "after") if pkey is None else (toks.shape[0], k, "after", pkey)
        return self.fns.run(key, lambda t, h, p, nn: (chain(t, h, p, nn, k, pen, pen_sp),),
                            (toks, hidden, self.pos, n))[0]

    def clear(self) -> None:
        self.fns.clear()

    def draft(self, toks: torch.Tensor, hidden: torch.Tensor, pos0: int, k: int, sp=None,
              rng=None, pen=None, pen_sp=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [k], the distributions they were drawn from [k, V] or None when greedy) on the device.
        `pen`, `pen_sp` (greedy only): penalised picks, one graph per penalty key (as `draft_after`)."""
        skey = None if sp is None else sampling_key(sp)
        self.pos.fill_(pos0)
        if skey is None:
            pkey = penalty_key(pen, pen_sp)
            if pkey is None:
                key = (toks.shape[0], k, None)
                fn = lambda t, h, p: (self.chain(t, h, p, k, None, None)[0],)    # noqa: E731
            else:
                key = (toks.shape[0], k, None, pkey)
                fn = lambda t, h, p: (self.chain(t, h, p, k, pen_sp, None, pen)[0],)    # noqa: E731
            out = self.fns.run(key, fn, (toks, hidden, self.pos))
            return out[0], None
        key = (toks.shape[0], k, skey, rng.state.data_ptr())
        out = self.fns.run(key, lambda t, h, p: self.chain(t, h, p, k, sp, rng), (toks, hidden, self.pos),
                           keep=(rng.state,))
        return out[0], out[1]


def own_tables(segs) -> _Tables | None:
    """Move the tables the warm-up made into one buffer of this graph's own (the attention
    tables are shared by content with other launches: a rewrite must not reach them). None
    where the forward reads its states otherwise (not the fused multi-sequence launches)."""
    from ..kernels.attention.multi import _parts
    from ..kernels.gdn.fused import SeqTable
    n_gdn = sum(lc.rec is not None for lc in segs.states[0].layers)
    gdn = list(segs.gdn_tables.items())
    pack = segs.attn_pack
    attn_layers = [i for i, lc in enumerate(segs.states[0].layers) if lc.k is not None]
    if (n_gdn and len(gdn) != 1) or (attn_layers and (pack is None or len(pack._caches) != len(attn_layers))):
        return None
    parts, aligned, place = [], [], []
    if gdn:
        k, t = gdn[0]
        parts.append(t.data.reshape(-1))
        aligned.append(t.aligned)
    for i in attn_layers:
        key = tuple(0 if x is None else x.data_ptr() for st in segs.states for x in _parts(st.layers[i]))
        got = pack._caches.get(key)
        if got is None:
            return None
        place.append((i, key))
        parts.append(got[0].reshape(-1))
        aligned.append(got[1])
    buf = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    off = 0
    if gdn:
        k, t = gdn[0]
        off = t.data.numel()
        segs.gdn_tables[k] = SeqTable(buf[:off].view(t.data.shape), t.spans, t.layers, t.dims, t.aligned)
    for i, key in place:
        table, al = pack._caches[key]
        n = table.numel()
        pack._caches[key] = (buf[off:off + n].view(table.shape), al)
        off += n
    return _Tables(buf, bool(gdn), [i for i, _ in place], tuple(aligned))


def rebind(tb: _Tables, spans: list[tuple[int, int]], bound: list, states: list) -> list | None:
    """Rewrite the tables `tb` of a forward over the states `bound` (rows `spans`) to address
    `states` instead: each state's log buffers per layer (where a replay leaves its log), or None
    where they are laid out otherwise than `bound` (then the graph is captured anew)."""
    from ..kernels.attention.multi import _layout, _parts
    from ..kernels.gdn.fused import SEQ_COLS
    first = bound[0]
    rows: list[int] = []
    aligned: list[bool] = []
    if tb.gdn:
        ref = first.book
        if any(st.book is None or st.book.rec.shape != ref.rec.shape or st.book.conv.shape != ref.conv.shape
               for st in states):
            return None
        for (i, j), st in zip(spans, states):
            bufs = (st.book.rec, st.book.conv, *st.book.log(j - i))
            ptrs = [x.data_ptr() for x in bufs]
            rows += [i, j - i, *ptrs]
        aligned.append(all(p % 16 == 0 for r in range(len(states)) for p in rows[r * SEQ_COLS + 2:(r + 1) * SEQ_COLS]))
    for li in tb.attn:
        want = [_layout(x) for x in _parts(first.layers[li])]
        if any([_layout(x) for x in _parts(st.layers[li])] != want for st in states):
            return None
        ptrs = [0 if x is None else x.data_ptr() for st in states for x in _parts(st.layers[li])]
        rows += ptrs
        aligned.append(all(p % 16 == 0 for k, p in enumerate(ptrs) if k % 5 < 4))
    if tuple(aligned) != tb.aligned:
        return None
    _copy_in(tb.buf, rows)
    return [[lc.log_buffers(j - i) if lc.rec is not None else None for lc in st.layers]
            for (i, j), st in zip(spans, states)]


def _copy_in(dst: torch.Tensor, values: list[int]) -> None:
    """Host ints into a device buffer, from pinned memory on CUDA: no host wait on the stream (the
    pinned block outlives the copy)."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.is_cuda)
