"""The steps' batched host reads (runtime/reads.py): rows put on the device come back as they were
put, one wait per batch, whatever the order of sends and reads."""
from __future__ import annotations

import torch

from specfire.runtime.reads import RoundReads


def _put(r: RoundReads, n: int, toks: list[int]):
    return r.put(torch.tensor(n), torch.tensor(toks))


def test_a_round_of_rows_is_read_with_one_wait():
    r = RoundReads(torch.device("cpu"), width=6)
    rows = [(0, [5]), (2, [1, 2, 3]), (1, [7, 8, 9, 4, 4])]
    tickets = [_put(r, n, t) for n, t in rows]
    r.send()
    assert (r.sends, r.waits) == (1, 0)
    assert [tk.read()[:len(t) + 1] for tk, (n, t) in zip(tickets, rows)] == [[n] + t for n, t in rows]
    assert (r.sends, r.waits) == (1, 1)


def test_a_row_read_before_its_send_sends_its_batch():
    r = RoundReads(torch.device("cpu"), width=4)
    a = _put(r, 0, [3])
    assert a.read()[:2] == [0, 3] and (r.sends, r.waits) == (1, 1)
    b = _put(r, 1, [4, 6])                          # a new batch: the device row 0 is taken again
    r.send()
    assert b.read()[:3] == [1, 4, 6] and a.read()[:2] == [0, 3]
    r.send()                                        # nothing put since: nothing sent
    assert r.sends == 2


def test_unread_batches_keep_their_rows_past_the_buffers():
    """More batches sent than host buffers, none read: each keeps its own rows (a buffer whose batch
    is unread is read before it takes another), and a full batch is sent as it fills."""
    r = RoundReads(torch.device("cpu"), width=3)
    tickets = []
    for i in range(RoundReads.BUFFERS + 2):
        tickets.append(_put(r, i % 2, [10 + i, 20 + i]))
        r.send()
    assert [tk.read()[:3] for tk in tickets] == [[i % 2, 10 + i, 20 + i] for i in range(len(tickets))]
    full = [_put(r, 0, [i]) for i in range(RoundReads.ROWS + 1)]
    assert r.sends == len(tickets) + 1              # the 33rd row started a new batch
    r.send()
    assert [tk.read()[:2] for tk in full] == [[0, i] for i in range(len(full))]
