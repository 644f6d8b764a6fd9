"""Multi-turn prefix reuse: snapshots of a single-device trunk's state where its prefill ends a forward.

A chat's next turn re-sends the whole conversation. The Gated DeltaNet state cannot be sliced per
position, so the state is snapshotted whole (recurrent state and conv window of every GDN layer,
KV rows [0, p) of every attention layer, the post-norm hidden rows [0, p) the MTP drafter starts
from) at the last multiple of the prefill piece inside a prompt and, for a chat prompt, at its end
and its last cut before it. A later
prompt that starts with those p tokens restores it and prefills only the rest.

A snapshot is restored only where the cold prefill of the new prompt also ends a forward, after
the same forwards (trunk.prefill_cuts: the piece multiples, plus the turn ends a chat prompt
carries), so the resumed prefill runs exactly the forwards a cold one would, on the same bits:
output is identical to a cold run, not merely close. A chat's turn N+1 carries turn N's prompt
length and where its messages end as turn ends, so it resumes from one of them (the second where
the template renders turn N's answer unlike the prompt that asked for it). The end of an output is never a snapshot: its
state was built by decode steps of one row, which a cold prefill does not run. Memory is bounded
by `max_bytes` (least recently used snapshots go first)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

import torch

from ..kernels.attention import gather
from ..kernels.attention.paged import rows_of
from ..model.qwen35 import SequenceState

if TYPE_CHECKING:
    from .trunk import LocalTrunk, Rows


@dataclass
class Snapshot:
    ids: tuple[int, ...]                    # the p tokens this state has seen
    ends: tuple[int, ...]                   # the turn ends (not piece multiples) its prefill cut at, < p
    kv: list[tuple[torch.Tensor, ...]]      # per attention layer: k, v (and scales) rows [0, p)
    rec: list[tuple[torch.Tensor, torch.Tensor]]  # per GDN layer: recurrent state, conv window
    hidden: torch.Tensor                    # post-norm hidden rows [p, H]

    @property
    def nbytes(self) -> int:
        ts = [t for group in self.kv + self.rec for t in group] + [self.hidden]
        return sum(t.numel() * t.element_size() for t in ts)


def take(state: SequenceState, ids: list[int], hidden: torch.Tensor, ends: tuple[int, ...] = ()) -> Snapshot:
    """Copy of the state after the len(ids) tokens `ids` (hidden: their post-norm rows; `ends`: the
    turn ends below len(ids) its prefill cut at)."""
    p = len(ids)
    kv, rec = [], []
    for lc in state.layers:
        if lc.rec is not None:
            rec.append((lc.rec.clone(), lc.conv.clone()))
        else:
            kv.append(tuple(gather(t, lc.blocks, p).clone() for t in (lc.k, lc.v, lc.k_scale, lc.v_scale)
                            if t is not None))
    return Snapshot(tuple(ids), tuple(ends), kv, rec, hidden[:p].clone())


def restore(state: SequenceState, snap: Snapshot) -> None:
    """Make `state` the state after snap.ids (rows past them are left as they are: reads are
    bounded by position)."""
    p = len(snap.ids)
    state.grow(p)
    ikv, irec = iter(snap.kv), iter(snap.rec)
    for lc in state.layers:
        if lc.rec is not None:
            r, c = next(irec)
            lc.rec.copy_(r)
            lc.conv.copy_(c)
            lc.log = None
        else:
            live = [t for t in (lc.k, lc.v, lc.k_scale, lc.v_scale) if t is not None]
            rows = rows_of(lc.blocks, 0, p) if lc.blocks is not None else None
            for dst, src in zip(live, next(ikv)):
                if rows is None:
                    dst[:p].copy_(src)
                else:
                    dst.index_copy_(0, rows, src)


class PrefixCache:
    """Snapshots of the last prompts on one single-device trunk, at most `max_bytes` in all, keyed by
    their tokens and the turn ends their prefill cut at (the same tokens cut elsewhere hold other bits)."""

    def __init__(self, trunk: "LocalTrunk", max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.trunk, self.max_bytes, self.piece = trunk, max_bytes, trunk.piece
        self.entries: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], Snapshot] = OrderedDict()
        self.hits = self.lookups = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    def turn_ends(self, n_prompt: int, ends: tuple[int, ...]) -> tuple[int, ...]:
        """The cuts of `ends` the piece multiples do not already make, inside a prompt of n tokens."""
        return tuple(sorted({e for e in ends if 0 < e < n_prompt and e % self.piece}))

    def boundary(self, n_prompt: int) -> int:
        """The last piece multiple that leaves at least one prompt token to prefill."""
        return ((n_prompt - 1) // self.piece) * self.piece

    def lookup(self, ids: list[int], ends: tuple[int, ...] = ()) -> Snapshot | None:
        """The longest snapshot whose tokens start `ids`, that leaves at least one to prefill and
        sits where this prompt's cold prefill ends a forward, after the same forwards."""
        self.lookups += 1
        ends = self.turn_ends(len(ids), ends)
        best = None
        for (key, cut_at), snap in self.entries.items():
            p = len(key)
            if (p < len(ids) and (best is None or p > len(best.ids)) and (p % self.piece == 0 or p in ends)
                    and cut_at == tuple(e for e in ends if e < p) and tuple(ids[:p]) == key):
                best = snap
        if best is not None:
            self.hits += 1
            self.entries.move_to_end((best.ids, best.ends))
        return best

    def wants(self, ids: list[int], ends: tuple[int, ...] = ()) -> list[int]:
        """Where to snapshot this prompt: the last piece multiple inside it, and, where `ends` holds
        its end (a chat prompt), that end and its last cut before it (where its messages end: the
        next turn resumes at one of them), less what is already kept."""
        cuts = self.turn_ends(len(ids), ends)
        at = {self.boundary(len(ids))} | ({len(ids)} | set(cuts[-1:]) if len(ids) in ends else set())
        return [p for p in sorted(at)
                if p > 0 and (tuple(ids[:p]), tuple(e for e in cuts if e < p)) not in self.entries]

    def add(self, snap: Snapshot) -> None:
        if snap.nbytes > self.max_bytes:
            return
        self.entries[(snap.ids, snap.ends)] = snap
        while self.nbytes > self.max_bytes:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()

    def prefill(self, ids: list[int], prompt: torch.Tensor, trunk: "LocalTrunk | None" = None,
                ends: tuple[int, ...] = ()) -> tuple["Rows", int]:
        """The prefill of `prompt` (= ids, cut at `ends` too) on `trunk` (default: the one this
        cache was made for) from the longest usable cached prefix, keeping snapshots where `wants`
        says. Returns (rows: last logits, hidden of every prompt row; cached prompt tokens)."""
        from .trunk import drain

        return drain(self.prefill_steps(ids, prompt, trunk, ends))

    @torch.inference_mode()
    def prefill_steps(self, ids: list[int], prompt: torch.Tensor, trunk: "LocalTrunk | None" = None,
                      ends: tuple[int, ...] = ()) -> Generator[None, None, tuple["Rows", int]]:
        """`prefill`, yielding between its forwards (LocalTrunk.prefill_steps). Any trunk over the
        same model takes any snapshot: every slot's state has the same layout."""
        from .trunk import Rows

        t = trunk if trunk is not None else self.trunk
        at = self.wants(ids, ends)
        ends = self.turn_ends(len(ids), ends)
        snap = self.lookup(ids, ends)
        start = cached = len(snap.ids) if snap is not None else 0
        t.begin()
        hs = [] if snap is None else [snap.hidden]
        if snap is not None:
            restore(t.state, snap)
        rows = None
        for cut in at:
            if cut <= start:
                continue
            if start > cached:
                yield
            rows = yield from t.prefill_steps(prompt[start:cut], start=start, ends=ends)
            hs.append(rows.hidden)
            self.add(take(t.state, ids[:cut], torch.cat(hs), tuple(e for e in ends if e < cut)))
            start = cut
        if start < len(ids):
            if start > cached:
                yield
            rows = yield from t.prefill_steps(prompt[start:], start=start, ends=ends)
            hs.append(rows.hidden)
        assert rows is not None
        return Rows(rows.logits, torch.cat(hs)), cached


class Fork:
    """One prompt prefilled once for several requests (a request's n choices): the first member to
    reach its prefill (the leader) runs it and leaves a copy of the state after the prompt (`take`)
    and the last row's logits; the others restore that copy, which is exactly the state they would
    have computed (the same forwards), so each member's output is the one it gives alone. If the
    leader ends before its copy is made, the others prefill for themselves."""

    def __init__(self) -> None:
        self.leading = False              # a member is prefilling the prompt
        self.abandoned = False            # the leader ended before its copy was made
        self.snap: Snapshot | None = None
        self.logits: torch.Tensor | None = None

    def keep(self, state: SequenceState, ids: list[int], rows: "Rows") -> None:
        self.snap = take(state, ids, rows.hidden)
        self.logits = rows.logits[-1:].clone()

