"""The host path of a cycle: the eager commit that takes row n's capture instead of copying it,
a worker's riders run straight (commit(n)), and the clocked serve loop bench/cycle_host.py reads."""
from __future__ import annotations

import json

import torch

from specfire.config import FULL, LINEAR, ModelConfig
from specfire.model.state import SequenceState
from specfire.parallel import control
from specfire.parallel.control import DRAFT, Call, RankExecutor


def _state() -> SequenceState:
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4, vocab_size=32,
                      layer_types=(LINEAR, FULL))
    return SequenceState.allocate(cfg, (LINEAR, FULL), 16, torch.device("cpu"), torch.float32)


def _capture(st: SequenceState, rows: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lc = st.layers[0]
    with torch.inference_mode():       # as a verify makes them
        lc.cap_rec = torch.randn((rows,) + tuple(lc.rec.shape), generator=g)
        lc.cap_conv = torch.randn(lc.conv.shape[0] + rows, lc.conv.shape[1], generator=g)


def test_eager_commit_takes_the_capture_and_equals_the_copy():
    for n in range(4):
        a, b = _state(), _state()
        _capture(a, 4, n)
        _capture(b, 4, n)
        cap = b.layers[0].cap_rec
        a.commit(n)
        b.commit(n, in_place=False)
        la, lb = a.layers[0], b.layers[0]
        assert torch.equal(la.rec, lb.rec) and torch.equal(la.conv, lb.conv)
        assert lb.rec.data_ptr() == cap[n].data_ptr()          # no copy: row n's capture itself
        assert la.cap_rec is None and lb.cap_rec is None
        _capture(b, 2, 10 + n)                                  # the next verify's captures are fresh
        want = b.layers[0].cap_rec[1].clone()
        b.commit(1, in_place=False)
        assert torch.equal(b.layers[0].rec, want)
        b.reset()                                               # zeroes an inference tensor: allowed
        assert not b.layers[0].rec.any() and not b.layers[0].conv.any()


def test_eager_commit_copies_a_mismatched_capture():
    st = _state()
    _capture(st, 3, 0)
    lc = st.layers[0]
    live = lc.rec
    lc.cap_rec = lc.cap_rec.double()                           # another dtype: copied into the live state
    st.commit(2, in_place=False)
    assert lc.rec is live and lc.rec.dtype == torch.float32


class _Trunk:
    def __init__(self):
        self.log = []

    def commit(self, n):
        self.log.append(("commit", n))

    def begin(self):
        self.log.append(("begin",))


class _Comm:
    rank, device, symm, draft_coll = 1, torch.device("cpu"), None, None

    def __init__(self, headers):
        self.headers = list(headers)

    def recv_command(self):
        return self.headers.pop(0)

    def captured(self, on=True):
        import contextlib
        return contextlib.nullcontext()


def test_clocked_serve_runs_riders_in_order_and_writes_the_timeline(tmp_path, monkeypatch):
    trunk = _Trunk()
    comm = _Comm([Call("begin", (), (3, 1)).header(), Call("close", ()).header()])
    monkeypatch.setenv(control.CLOCK_ENV, str(tmp_path / "clock"))
    control.serve(comm, trunk)
    assert trunk.log == [("commit", 3), ("commit", 1), ("begin",)]
    rows = json.loads((tmp_path / "clock.rank1.json").read_text())
    assert [r[:2] for r in rows] == [["begin", 2], ["close", 0]]
    assert all(r[2] <= r[3] <= r[4] <= r[5] <= r[6] for r in rows)


def test_rank_commit_counts_like_a_call():
    ex = RankExecutor(_Comm([]), _Trunk())
    ex.commit(2)
    ex.run(Call("commit", (1,)))
    assert ex.counts["commit"] == 2 and ex.trunk.log == [("commit", 2), ("commit", 1)]
    assert DRAFT == "draft_argmax"
