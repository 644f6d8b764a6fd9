"""CUDA graphs for the rows forward (decode = 1 row, verify = k+1 rows), one graph per row count.

Why: a batch-1 step of these models is several hundred small kernels; launched eagerly from
Python they cost about 30 ms per step on the H200 whatever the model size (bench/decode.py,
docs/BENCHMARKS.md), far above the bandwidth bound. Replaying one captured graph removes that.

What makes the forward capturable: the position is a device tensor (read by the rotary, the KV
write and the attention kernel), every kernel's launch shape depends only on the row count and
the cache size, and the per-row state capture buffers that `commit()` reads are graph outputs,
re-attached to the sequence state after each replay. The live recurrent state is only changed
by `commit()`, outside the graph, so capture and warm-up never disturb a sequence.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..model.qwen35 import Qwen35Trunk, SequenceState

log = logging.getLogger("specfire")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor                       # [R] static input
    hidden: torch.Tensor                    # [R, H] static outputs
    logits: torch.Tensor                    # [R, V]
    caps: list[tuple[torch.Tensor | None, torch.Tensor | None]]


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
        self._rows = 0                      # row count of the last replay (whose captures commit reads)

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
        for lc, (cap_rec, cap_conv) in zip(self.state.layers, g.caps):
            if lc.rec is not None:
                lc.cap_rec, lc.cap_conv = cap_rec, cap_conv

    def attached(self, state: SequenceState) -> bool:
        """Whether the state holds the captures of a replay not yet committed."""
        return self._rows > 0 and any(lc.cap_rec is not None for lc in state.layers)

    def commit(self, n: int) -> None:
        """`SequenceState.commit(n)` after a replay, as one graph per (rows, n): the captures are
        the rows graph's fixed outputs and the live state is allocated once, so the copies of
        every Gated DeltaNet layer replay with one launch instead of two per layer."""
        key = (self._rows, n)
        g = self.commits.get(key)
        if g is None:
            with torch.cuda.device(self.pos.device):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.state.commit(n)           # recorded, not run; it detaches the captures
        g.replay()
        self.commits[key] = g
        for lc in self.state.layers:
            lc.cap_rec = lc.cap_conv = None

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
        caps = [(lc.cap_rec, lc.cap_conv) for lc in self.state.layers]
        log.info("captured a CUDA graph for %d row(s)", ids.shape[0])
        return _Graph(graph, ids_buf, hidden, logits, caps)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    toks: torch.Tensor                      # [m] tokens following the pending hidden rows
    hidden: torch.Tensor                    # [m, H] pending trunk hidden rows
    drafts: torch.Tensor                    # [k] greedy drafts


Chain = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class DraftGraphs:
    """The greedy MTP draft chain (`drafters.draft_chain`, the same function the eager path runs)
    as one CUDA graph per (pending rows m, draft length k). The position is a device tensor, as in
    RowsGraphs; sampled drafting stays eager (it needs a host generator)."""

    def __init__(self, chain: Chain, device: torch.device):
        self.chain = chain                  # (toks, hidden, pos tensor, k) -> drafts [k]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _DraftGraph] = {}

    def clear(self) -> None:
        self.graphs.clear()

    def draft(self, toks: torch.Tensor, hidden: torch.Tensor, pos0: int, k: int) -> torch.Tensor:
        """The drafts [k] on the device (a copy: the next replay overwrites the graph's output)."""
        key = (toks.shape[0], k)
        self.pos.fill_(pos0)
        g = self.graphs.get(key)
        if g is None:
            with torch.cuda.device(toks.device):
                g = self.graphs[key] = self._capture(toks, hidden, k)
        g.toks.copy_(toks)
        g.hidden.copy_(hidden)
        g.graph.replay()
        return g.drafts.clone()

    def _capture(self, toks: torch.Tensor, hidden: torch.Tensor, k: int) -> _DraftGraph:
        tb, hb = toks.clone(), hidden.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (kernel compilation)
            for _ in range(2):
                self.chain(tb, hb, self.pos, k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.chain(tb, hb, self.pos, k)
        log.info("captured an MTP draft graph for %d pending row(s), k=%d", toks.shape[0], k)
        return _DraftGraph(graph, tb, hb, out)
