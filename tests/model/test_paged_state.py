"""A sequence's KV in the model's pool (model/kvpool.py): blocks are taken as the forwards reach
them, kept through a rollback, given back when the sequence ends; a sequence over scattered
blocks computes the bits of one holding its own KV; the MTP head writes over its trunk
sequence's blocks; admission promises blocks and refuses what the pool cannot cover."""
from __future__ import annotations

import pytest
import torch

from ckpts import tiny
from specfire import LLM, SamplingParams
from specfire.model.kvpool import SINK, KvPool, blocks_for
from specfire.params import MAX_SPEC_K
from specfire.runtime.slots import request_blocks
from specfire.runtime.trunk import LocalTrunk


@pytest.fixture(scope="module")
def llm(ckpt_cache):
    with LLM(tiny(ckpt_cache, "base"), device="cpu", spec="off", progress=False, max_seq_len=300) as m:
        yield m


def _ids(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_blocks_follow_growth_rollback_and_release(llm):
    trunk = llm.engine.trunk
    pool, st = trunk.kv_pool, trunk.state
    assert st.table.cap == blocks_for(300) and st.ahead == 0        # no MTP head loaded
    v = llm.cfg.vocab_size
    trunk.begin()
    trunk.prefill(_ids(70, 1, v))
    assert len(st.table.blocks) == 2 and pool.used == 2
    trunk.verify(_ids(3, 2, v), 70)
    assert len(st.table.blocks) == 2                                 # 73 positions: still two blocks
    trunk.commit(2)
    trunk.verify(_ids(60, 3, v)[:1], 73)
    trunk.commit(0)
    ids_before = st.table.ids.clone()
    trunk.verify(_ids(4, 4, v), 126)                                 # rows 126..129 cross into a third block
    assert len(st.table.blocks) == 3 and pool.used == 3
    trunk.commit(0)                                                  # rollback: the length drops, the blocks stay
    trunk.verify(_ids(2, 5, v), 127)
    assert len(st.table.blocks) == 3 and torch.equal(st.table.ids[:2], ids_before[:2])
    addr = st.table.ids.data_ptr()
    trunk.end()
    assert pool.used == 0 and st.table.blocks == [] and not st.table.ids.any()
    trunk.begin()
    trunk.prefill(_ids(5, 6, v))
    assert st.table.ids.data_ptr() == addr and pool.used == 1        # the table's address never changes
    trunk.end()


def test_scattered_blocks_give_the_bits_of_a_sequence_with_its_own_kv(llm):
    """Two views grow in turns so one's blocks are not consecutive; its logits (prefill and verify
    rows crossing block bounds) equal a trunk whose state holds its own KV, bit for bit."""
    a_t = llm.engine.trunk
    b_t = a_t.view()
    own = LocalTrunk(a_t.model, a_t.max_seq, a_t.kv_dtype, cuda_graphs=False)
    assert own.kv_pool is None and not own.state.shared
    v = llm.cfg.vocab_size
    p, q = _ids(120, 7, v), _ids(90, 8, v)
    for t in (a_t, b_t, own):
        t.begin()
    got, want = [a_t.prefill(p, logits="all").logits], [own.prefill(p, logits="all").logits]
    b_t.prefill(q)                                                   # takes the blocks after a's two
    rows = _ids(10, 9, v)
    got.append(a_t.verify(rows, 120).logits)                         # 120..129 cross into a third block
    want.append(own.verify(rows, 120).logits)
    for t in (a_t, own):
        t.commit(9)
    got.append(a_t.verify(rows[:3], 130).logits)
    want.append(own.verify(rows[:3], 130).logits)
    blocks = a_t.state.table.blocks
    assert len(blocks) == 3 and blocks[2] != blocks[1] + 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    a_t.end()
    b_t.end()
    assert a_t.kv_pool.used == 0


def test_the_mtp_head_writes_over_the_trunk_sequences_blocks(ckpt_cache):
    with LLM(tiny(ckpt_cache, "base"), device="cpu", spec="mtp", progress=False, max_seq_len=300) as m:
        trunk, head = m.engine.trunk, m.engine.drafters["mtp"]
        assert head.state.table is trunk.state.table and trunk.state.ahead == MAX_SPEC_K + 1
        assert head.state.layers[0].k is trunk.kv_pool.k[-1]
        out = m.generate(_ids(20, 3, m.cfg.vocab_size).tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
        assert len(out.token_ids) == 30 and trunk.kv_pool.used == 0 and trunk.kv_pool.reserved == 0


def test_reservations_and_their_limits():
    pool = KvPool([2], 16, 6, torch.device("cpu"), torch.float32)
    assert pool.capacity == 6 - SINK and pool.k[0].shape == (6 * 64, 2, 16)
    assert pool.reserve(3) and pool.reserve(2) and not pool.reserve(1)
    pool.unreserve(2)
    assert pool.reserve(2)
    tab = pool.table(300)
    assert tab.cap == 5
    tab.grow(300)
    assert sorted(tab.blocks) == list(range(1, 6)) and 0 not in tab.ids.tolist()
    other = pool.table(300)
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        other.grow(1)
    tab.release()
    assert pool.used == 0
    assert request_blocks(300, 10, 20) == blocks_for(10 + 20 + 2 * MAX_SPEC_K + 2)
    assert request_blocks(300, 250, 100) == blocks_for(300) == request_blocks(300, 0, None)
    with pytest.raises(ValueError, match="more than"):
        KvPool([2], 16, SINK, torch.device("cpu"), torch.float32)


def test_a_request_the_pool_cannot_promise_waits(llm):
    slots = llm.slots
    pool = slots.kv
    assert pool.reserve(pool.capacity - 1)          # as if others held nearly all of it
    try:
        assert slots.acquire(2) is None and pool.reserved == pool.capacity - 1
        eng = slots.acquire(1)
        assert eng is not None and pool.reserved == pool.capacity
        slots.release(eng)
        assert pool.reserved == pool.capacity - 1
    finally:
        pool.unreserve(pool.capacity - 1)
