"""The host path of a cycle: the eager commit that replays the log in place,
and a worker's riders run straight (commit(n))."""
from __future__ import annotations

import torch

from specfire.config import FULL, LINEAR, ModelConfig
from specfire.model.state import SequenceState
from specfire.parallel.control import DRAFT, Call, RankExecutor


def _state() -> SequenceState:
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4, vocab_size=32,
                      layer_types=(LINEAR, FULL))
    return SequenceState.allocate(cfg, (LINEAR, FULL), 16, torch.device("cpu"), torch.float32)


def _log(st: SequenceState, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A random log of `rows` rows, as a verify leaves it (in the state's buffers)."""
    g = torch.Generator().manual_seed(seed)
    lc = st.layers[0]
    hv, dk, dv = lc.rec.shape
    log = (torch.randn(rows, hv, dk, generator=g), torch.randn(rows, hv, dv, generator=g),
           torch.rand(rows, hv, generator=g), torch.randn(lc.conv.shape[0] + rows, lc.conv.shape[1], generator=g))
    with torch.inference_mode():
        lc.set_log(*log)
    return log


def test_eager_commit_replays_the_log_in_place():
    """commit(n) applies rows 0..n of the log to the live state (dec S + k delta^T each), in place,
    and takes the conv window after row n; a state without a book commits the same bits."""
    for n in range(4):
        a, b = _state(), _state()
        b.book = None
        b.layers[0].book = None
        s0 = torch.randn(a.layers[0].rec.shape, generator=torch.Generator().manual_seed(n))
        for st in (a, b):
            st.layers[0].rec.copy_(s0)
        log = _log(a, 4, n)
        _log(b, 4, n)
        live = a.layers[0].rec.data_ptr()
        a.commit(n)
        b.commit(n)
        la, lb = a.layers[0], b.layers[0]
        assert la.rec.data_ptr() == live and la.log is None and lb.log is None
        assert torch.equal(la.rec, lb.rec) and torch.equal(la.conv, lb.conv)
        want = s0
        for t in range(n + 1):
            want = want * log[2][t][:, None, None] + log[0][t][:, :, None] * log[1][t][:, None, :]
        assert torch.equal(la.rec, want) and torch.equal(la.conv, log[3][n + 1:n + 4])
        a.reset()
        assert not a.layers[0].rec.any() and not a.layers[0].conv.any()


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


def test_rank_commit_counts_like_a_call():
    ex = RankExecutor(_Comm([]), _Trunk())
    ex.commit(2)
    ex.run(Call("commit", (1,)))
    assert ex.counts["commit"] == 2 and ex.trunk.log == [("commit", 2), ("commit", 1)]
    assert DRAFT == "draft_argmax"
