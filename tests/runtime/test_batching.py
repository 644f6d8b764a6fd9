"""Concurrent requests (runtime/slots.py, runtime/scheduler.py): each request runs on its own slot,
and its output, greedy or seeded sampled, is the one it gives alone, whatever shares the rounds and
in whatever order the requests arrive."""
from __future__ import annotations

import threading

import pytest
import torch

import specfit
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.errors import SpecfireError
from specfire.params import parse_bytes
from specfire.runtime import scheduler as sch
from specfire.runtime.slots import state_bytes

# mixed policies and sampling: greedy AR, greedy MTP, seeded sampled n-gram, penalised auto, a stop
# string on seeded sampled MTP, min_tokens on AR
MIXED = [
    (SamplingParams(max_tokens=20), SpecPolicy("off")),
    (SamplingParams(max_tokens=24), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=18, temperature=0.8, seed=5), SpecPolicy("ngram", 2)),
    (SamplingParams(max_tokens=22, frequency_penalty=0.5, repetition_penalty=1.1), SpecPolicy("auto", 3)),
    (SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=11, stop=["C"]), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=16, min_tokens=12), SpecPolicy("off")),
]


@pytest.fixture(scope="module")
def path(ckpt_cache) -> str:
    """The fitted tiny model (drafts really get accepted) with a one-character-per-token tokenizer."""
    return specfit.variant(specfit.fitted_checkpoint(ckpt_cache["shared"]), str(ckpt_cache["root"] / "batch_chars"),
                           tokenizer=True)


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=4) as m:
        yield m


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return specfit.prompts(len(MIXED), length=10, seed=42)


@pytest.fixture(scope="module")
def alone(llm, prompts) -> list[list[int]]:
    """Each request by itself, one after another."""
    before = len(llm.slots.engines)             # (another test of this module may have built slots)
    out = [llm.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, MIXED)]
    assert len(llm.slots.engines) == max(1, before)     # one at a time builds no other slot
    return out


def _storage_bytes(tensors) -> int:
    seen, got = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            got += t.untyped_storage().nbytes()
    return got


def test_state_bytes_is_what_a_slot_allocates(path):
    """The admission figures are the bytes allocated, for every KV dtype: a slot's own state (its
    recurrent state: its KV rows, the MTP head's too, are the pool's), the pool's blocks (without a
    budget max_num_seqs whole sequences, the sink block beside them), and a state holding its own
    KV (a mesh rank's slot) the whole figure."""
    from specfire.model.kvpool import SINK, blocks_for
    from specfire.model.state import SequenceState
    from specfire.runtime.slots import block_bytes

    for kv in ("auto", "q8"):
        with LLM(path, device="cpu", progress=False, max_seq_len=300, kv_dtype=kv) as m:
            slot = m.slots.first.fork()
            states = [slot.trunk.state, slot.drafters["mtp"].state]
            pool = m.slots.kv
            assert all(lc.k is pool.k[i] for i, lc in enumerate(lc for lc in states[0].layers if lc.rec is None))
            assert states[1].layers[0].k is pool.k[-1] and states[1].table is states[0].table
            own = _storage_bytes(t for st in states for lc in st.layers for t in (lc.rec, lc.conv))
            assert own == state_bytes(m.cfg, 300, m.kv_dtype, True, kv=False) == m.slots.slot_bytes, kv
            pooled = _storage_bytes(t for ts in (pool.k, pool.v, pool.k_scale, pool.v_scale) for t in ts)
            heads = m.engine.trunk.model.kv_heads() + [m.cfg.num_key_value_heads]
            assert pool.num_blocks == 4 * blocks_for(300) + SINK
            assert pooled == pool.nbytes() == block_bytes(heads, m.cfg.head_dim, m.kv_dtype) * pool.num_blocks, kv
            alone = SequenceState.allocate(m.cfg, m.cfg.layer_types, 300, torch.device("cpu"), m.kv_dtype)
            whole = _storage_bytes(t for lc in alone.layers for t in (lc.k, lc.v, lc.k_scale, lc.v_scale, lc.rec,
                                                                     lc.conv))
            assert whole == state_bytes(m.cfg, 300, m.kv_dtype, False) > state_bytes(m.cfg, 300, m.kv_dtype, False,
                                                                                       kv=False)


def test_generate_list_equals_each_alone_in_any_order(llm, prompts, alone):
    """LLM.generate(list) runs the requests concurrently on four slots; each output is its own
    alone, token for token, in arrival order and reversed."""
    sched = llm.scheduler
    before = (sched.forwards, sched.verifies)
    sched.widest = 0
    got = llm.generate(prompts, [sp for sp, _ in MIXED], spec=[pol for _, pol in MIXED])
    assert [r.token_ids for r in got] == alone
    assert len(llm.slots.engines) == 4 and llm.slots.busy == 0
    # the requests' verifies really shared forwards: four at a time at most, more than one on average
    forwards, verifies = sched.forwards - before[0], sched.verifies - before[1]
    assert sched.widest == 4 and verifies > 1.5 * forwards
    rev = llm.generate(prompts[::-1], [sp for sp, _ in MIXED][::-1], spec=[pol for _, pol in MIXED][::-1])
    assert [r.token_ids for r in rev] == alone[::-1]
    assert any(r.stats["cycles"] for r in got) and got[4].finish_reason in ("stop", "length")


def test_a_requests_verifies_keep_one_row_count(path, prompts, monkeypatch):
    """Packed CUDA graphs are one per row pattern, so a request's verifies keep one row count: an
    MTP cycle drafts k whatever its output has left (the surplus is never emitted) and an n-gram
    match drafts k (or none), never a pattern of its own per last cycle or partial match. Each
    output is its own alone (which one of ten lengths ends in each phase of a cycle)."""
    from specfire.runtime.trunk import LocalTrunk

    reqs = ([(SamplingParams(max_tokens=n, ignore_eos=True), SpecPolicy("mtp", 3)) for n in (17, 18, 19)]
            + [(SamplingParams(max_tokens=21, ignore_eos=True), SpecPolicy("ngram", 3)),
               (SamplingParams(max_tokens=16, ignore_eos=True), SpecPolicy("off"))])
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=len(reqs)) as m:
        want = [m.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
        rows: dict[int, set[int]] = {}
        real = LocalTrunk.verify_packed

        def verify_packed(self, trunks, ids, pos):
            for t, x in zip(trunks, ids):
                rows.setdefault(id(t), set()).add(x.shape[0])
            return real(self, trunks, ids, pos)
        monkeypatch.setattr(LocalTrunk, "verify_packed", verify_packed)
        got = m.generate(prompts[:len(reqs)], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        assert [r.token_ids for r in got] == want
    per_slot = sorted(rows.values(), key=sorted)
    assert len(per_slot) == len(reqs) and per_slot.count({4}) >= 3, per_slot     # the MTP requests: 4 rows always
    assert all(r <= {1, 4} for r in per_slot), per_slot                         # n-gram: k drafts or none


def test_a_packed_rounds_greedy_accepts_run_once_for_all(path, prompts, monkeypatch):
    """A packed verify computes the greedy accept of every member at once (runtime/trunk.py
    packed_rows): plain greedy members read theirs and launch none of their own; a penalised one
    (its rows processed first) and a sampled one still accept their own rows, and rounds of those
    alone launch no batched accept. Each output is its own alone."""
    from specfire.runtime import spec as spec_mod
    from specfire.runtime import trunk as trunk_mod

    reqs = [(SamplingParams(max_tokens=18, ignore_eos=True), SpecPolicy("mtp", 3)),
            (SamplingParams(max_tokens=15, ignore_eos=True), SpecPolicy("off")),
            (SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.2), SpecPolicy("mtp", 2)),
            (SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, seed=3), SpecPolicy("ngram", 2))]
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=len(reqs)) as m:
        want = [m.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
        packs, own = [], []
        many, one = trunk_mod.greedy_accept_many, spec_mod.greedy_accept

        def accept_many(logits, ids, spans):
            packs.append([b - a for a, b in spans])
            return many(logits, ids, spans)

        def accept_one(logits, draft):
            own.append(logits.shape[0])
            return one(logits, draft)
        monkeypatch.setattr(trunk_mod, "greedy_accept_many", accept_many)
        monkeypatch.setattr(spec_mod, "greedy_accept", accept_one)
        got = m.generate(prompts[:len(reqs)], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        assert [r.token_ids for r in got] == want
        n_packs = len(packs)
        m.generate(prompts[:2], [reqs[2][0], reqs[3][0]], spec=[reqs[2][1], reqs[3][1]])
        assert len(packs) == n_packs        # no plain greedy member: the rounds launch no batched accept
    assert packs and max(map(len, packs)) == len(reqs), packs
    # the plain MTP member (4 rows a verify) never accepts on its own; the penalised one (3 rows)
    # does in every pack it shares (the 1-row calls: the AR member's rounds alone, after the rest)
    shared = sum(3 in p for p in packs)
    assert own.count(4) == 0 and shared and own.count(3) >= shared, (own, packs)


def test_the_kv_pool_runs_requests_whose_whole_sequences_exceed_it(path, prompts, alone):
    """Paged KV: a pool of 1.5 sequences of max_seq runs two requests at once (each promised only
    the blocks its prompt, max_tokens and drafts may reach), each output its own alone; two that
    may each reach max_seq take turns (the second waits for the first's blocks, no out-of-memory),
    each still its own; every block and promise comes back."""
    from specfire.model.kvpool import SINK, blocks_for
    with LLM(path, device="cpu", progress=False, max_seq_len=512) as m:
        per = m.slots.kv.nbytes() // m.slots.kv.num_blocks
        longs = specfit.prompts(2, length=470, seed=7)
        long_alone = [m.generate(p, SamplingParams(max_tokens=8)).token_ids for p in longs]
    budget = int(per * (1.5 * blocks_for(512) + SINK))
    with LLM(path, device="cpu", progress=False, max_seq_len=512, kv_cache_memory_bytes=budget) as m:
        pool, sched = m.slots.kv, m.scheduler
        assert 2 * blocks_for(512) > pool.capacity and m.max_num_seqs == 4
        sched.widest = 0
        got = m.generate(prompts[:2], [sp for sp, _ in MIXED[:2]], spec=[pol for _, pol in MIXED[:2]])
        assert [r.token_ids for r in got] == alone[:2]
        assert sched.widest == 2 and pool.used == 0 and pool.reserved == 0
        sched.widest = 0
        got = m.generate(longs, SamplingParams(max_tokens=8))
        assert [r.token_ids for r in got] == long_alone
        assert sched.widest == 1 and pool.used == 0 and pool.reserved == 0


def test_requests_interleave_and_wait_in_arrival_order(path, prompts, alone):
    """With two slots six requests take turns: every running request advances once a round (the
    second's first token comes before the first's last), the rest wait and start in arrival order,
    and the outputs are still each one's own."""
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=2) as m:
        log: list[tuple[int, str]] = []
        reqs = []
        for i, (p, (sp, pol)) in enumerate(zip(prompts, MIXED)):
            def on_event(kind, payload, i=i):
                log.append((i, kind))
                if kind == sch.DONE:
                    results[i] = payload.result
            reqs.append(sch.Request(p, sp, pol, on_event))
        results: list = [None] * len(reqs)
        for r in reqs:
            m.scheduler.submit(r)
        m.scheduler.drive_until(lambda: all(r.over for r in reqs))
        assert [r.token_ids for r in results] == alone
        starts = [i for i, kind in log if kind == sch.STARTED]
        assert starts == list(range(len(reqs)))
        assert log.index((1, sch.CHUNK)) < log.index((0, sch.DONE))
        # never more than two running at once
        running = peak = 0
        for _, kind in log:
            running += kind == sch.STARTED
            running -= kind in (sch.DONE, sch.ERROR, sch.CANCELLED)
            peak = max(peak, running)
        assert peak == 2 and len(m.slots.engines) == 2


def test_streams_from_threads_share_the_rounds(llm, prompts):
    """LLM.stream from four threads: each thread gets its own request's chunks, equal to the request
    alone, and the streams overlap (each has its first chunk before any has ended)."""
    reqs = [(SamplingParams(max_tokens=80, ignore_eos=True), SpecPolicy("off")),
            (SamplingParams(max_tokens=80, ignore_eos=True), SpecPolicy("mtp", 3)),
            (SamplingParams(max_tokens=80, ignore_eos=True, temperature=0.8, seed=2), SpecPolicy("ngram", 2)),
            (SamplingParams(max_tokens=80, ignore_eos=True, presence_penalty=0.5), SpecPolicy("auto", 3))]
    alone = [llm.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
    order: list[tuple[int, bool]] = []
    got: list = [None] * 4
    lock = threading.Lock()
    ready = threading.Barrier(4)

    def go(i: int) -> None:
        ids = []
        it = llm.stream(prompts[i], *reqs[i])
        ready.wait(60)
        for chunk in it:
            ids += chunk.token_ids
            with lock:
                order.append((i, chunk.result is not None))
        got[i] = ids

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == alone
    first_end = next(n for n, (_, last) in enumerate(order) if last)
    assert {i for i, _ in order[:first_end]} == {0, 1, 2, 3}, order


def test_prefill_pauses_scale_with_the_piece():
    """A piece of PREFILL_PAUSE_ROWS rows or more pauses every PREFILL_PAUSE layers; a smaller one
    runs proportionally more layers between pauses (a small piece's run costs its launches, not
    its rows); pause 0 never pauses."""
    from types import SimpleNamespace

    from specfire.runtime.trunk import PREFILL_PAUSE, PREFILL_PAUSE_ROWS, LocalTrunk

    t = SimpleNamespace(pause=PREFILL_PAUSE, pause_rows=PREFILL_PAUSE_ROWS)
    assert (PREFILL_PAUSE, PREFILL_PAUSE_ROWS) == (4, 512)
    assert [LocalTrunk.pause_for(t, r) for r in (1024, 512, 256, 128, 16)] == [4, 4, 8, 16, 128]
    assert LocalTrunk.pause_for(SimpleNamespace(pause=0, pause_rows=512), 256) == 0
    assert LocalTrunk.pause_for(SimpleNamespace(pause=1, pause_rows=0), 16) == 1


@pytest.mark.parametrize("pause", [0, 1])
def test_a_long_prompt_prefills_between_the_others_steps(path, prompts, alone, pause):
    """A prompt of many prefill pieces joins while another request streams: the running one keeps
    getting tokens between the newcomer's pieces (and, pausing every layer, between the layers of
    each piece's forward), and both outputs are their own alone, unpaused."""
    long = specfit.prompts(1, length=200, seed=7)[0]
    sp = SamplingParams(max_tokens=8)
    with LLM(path, device="cpu", progress=False, max_seq_len=512) as m:
        m.enable_prefix_cache(0, piece=16)       # no cache; prefill pieces of 16 rows
        for eng in m.slots.engines:
            eng.trunk.piece, eng.trunk.pause = 16, 0
        want_long = m.generate(long, sp, spec="off").token_ids
        for eng in m.slots.engines:
            eng.trunk.pause, eng.trunk.pause_rows = pause, 0     # every layer, whatever the piece
        log: list[tuple[str, str]] = []
        a = sch.Request(prompts[0], SamplingParams(max_tokens=60, ignore_eos=True), SpecPolicy("off"),
                        lambda kind, payload: log.append(("a", kind)))
        b = sch.Request(long, sp, SpecPolicy("off"), lambda kind, payload: log.append(("b", kind)))
        res = {}
        a.on_event = lambda kind, payload: (log.append(("a", kind)), kind == sch.DONE and res.update(a=payload))
        b.on_event = lambda kind, payload: (log.append(("b", kind)), kind == sch.DONE and res.update(b=payload))
        m.scheduler.submit(a)
        m.scheduler.drive_until(lambda: ("a", sch.CHUNK) in log)
        m.scheduler.submit(b)
        m.scheduler.drive_until(lambda: a.over and b.over)
        assert m.slots.first.trunk.piece == 16
        i0, i1 = log.index(("b", sch.STARTED)), log.index(next(e for e in log if e[0] == "b" and e[1] != sch.STARTED))
        between = [e for e in log[i0:i1] if e == ("a", sch.CHUNK)]
        layers = len(m.slots.first.trunk.model.layers)
        # 13 pieces: one step of `a` after each but the last (and after each of a piece's layers)
        assert len(between) >= (10 if pause == 0 else 12 * layers), log
        assert res["b"].result.token_ids == want_long
        assert res["a"].result.token_ids == m.generate(prompts[0], SamplingParams(max_tokens=60, ignore_eos=True),
                                                       spec="off").token_ids


def test_cancel_frees_the_slot_at_the_next_step(path, prompts, alone):
    """One slot: a stream left early is cancelled and its slot goes to the next request at the next
    boundary; a waiting request cancelled never starts."""
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=1) as m:
        it = m.stream(prompts[1], SamplingParams(max_tokens=200, ignore_eos=True), SpecPolicy("mtp", 3))
        next(it)
        next(it)
        it.close()                                 # the consumer leaves
        log = []
        w = sch.Request(prompts[2], *MIXED[2], lambda kind, payload: log.append(kind))
        w.cancel.set()
        m.scheduler.submit(w)
        assert m.generate(prompts[1], *MIXED[1]).token_ids == alone[1]
        assert log == [sch.CANCELLED] and len(m.slots.engines) == 1 and m.scheduler.num_running == 0


@pytest.mark.parametrize("slots", [4, 2])
def test_a_forked_prompt_is_prefilled_once_and_each_request_is_its_own(path, prompts, slots, monkeypatch):
    """Requests of one prompt sharing a prefix.Fork (a request's n choices): the prompt is prefilled
    once, the others restore its copy, and each output is the request alone; with fewer slots than
    members the later ones restore the copy after the leader has ended."""
    from specfire.runtime.prefix import Fork
    from specfire.runtime.trunk import LocalTrunk

    members = [(SamplingParams(max_tokens=16, temperature=0.9, seed=3), SpecPolicy("mtp", 3)),
               (SamplingParams(max_tokens=20, temperature=0.9, seed=4), SpecPolicy("ngram", 2)),
               (SamplingParams(max_tokens=18), SpecPolicy("off")),
               (SamplingParams(max_tokens=12, frequency_penalty=0.4), SpecPolicy("mtp", 3))]
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=slots) as m:
        want = [m.generate(prompts[1], sp, spec=pol).token_ids for sp, pol in members]
        real, calls = LocalTrunk.prefill_steps, []

        def counted(self, ids, *a, **k):
            calls.append(ids.shape[0])
            return real(self, ids, *a, **k)

        monkeypatch.setattr(LocalTrunk, "prefill_steps", counted)
        fork = Fork()
        reqs = [sch.Request(prompts[1], sp, pol, None, fork=fork) for sp, pol in members]
        got = [chunk.result.token_ids for chunk in sch.run_all(m.scheduler, reqs)]
        assert got == want
        assert calls == [len(prompts[1])]                      # one prefill for the four
        assert fork.snap is not None and not fork.abandoned


def test_auto_measures_cycle_costs_only_when_alone(path, prompts, monkeypatch):
    """A cycle that shared its forward costs the round whatever its route, so auto's cost table
    takes only cycles run alone (their acceptance still counts): four requests at once add few
    samples, the same four one after another one per cycle."""
    from specfire.runtime.route import CostTable

    added = []
    real = CostTable.add
    monkeypatch.setattr(CostTable, "add", lambda self, *a: added.append(a) or real(self, *a))
    reqs = [(SamplingParams(max_tokens=24, ignore_eos=True), SpecPolicy("auto", 3)) for _ in range(4)]
    views = []
    real_round = sch.Scheduler.round

    def round_(self):
        real_round(self)
        v = self.pool.first.shared.round
        views.append((len(v.members), v.seconds or 0.0))
    monkeypatch.setattr(sch.Scheduler, "round", round_)
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=4) as m:
        for p, (sp, pol) in zip(prompts, reqs):
            m.generate(p, sp, spec=pol)
        alone, added[:] = len(added), []
        got = m.generate(prompts[:4], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        cycles = sum(r.stats["per_route"][route]["steps"] for r in got for route in r.stats["per_route"])
    assert alone >= cycles / 2 and len(added) < cycles / 4, (alone, len(added), cycles)
    # the rounds in which all the running requests verified together were recorded for auto
    assert max(n for n, _ in views) == 4 and all(t > 0 for n, t in views if n)


def test_score_runs_on_a_free_slot_beside_a_stream(llm, prompts, alone):
    ref = llm.score(prompts[0])
    it = llm.stream(prompts[1], *MIXED[1])
    ids = list(next(it).token_ids)
    mid = llm.score(prompts[0])                    # between the stream's steps, on another slot
    for chunk in it:
        ids += chunk.token_ids
    assert torch.equal(mid, ref) and ids == alone[1]


def test_prefix_reuse_under_concurrency(path, prompts):
    """Prompts that extend a cached one resume from its snapshot on whatever slot they get; greedy
    output is a cold run's."""
    turn = specfit.prompts(1, length=40, seed=3)[0]
    nexts = [turn + p for p in prompts[:3]]
    sp = SamplingParams(max_tokens=12)
    with LLM(path, device="cpu", progress=False, max_seq_len=512) as cold:
        want = [cold.generate(p, sp, spec="mtp").token_ids for p in nexts]
    with LLM(path, device="cpu", progress=False, max_seq_len=512) as m:
        m.enable_prefix_cache(64 << 20, piece=16)
        m.generate(turn, sp)
        got = m.generate(nexts, sp, spec="mtp")
        assert [r.token_ids for r in got] == want
        # the first turn's 32 (a repeated prompt may find the 48 its twin kept a round earlier)
        assert all(r.stats["cached_tokens"] in (32, 48) for r in got) and got[0].stats["cached_tokens"] == 32


def test_admission_limits_and_their_errors(path):
    from specfire.model.kvpool import SINK, blocks_for
    with LLM(path, device="cpu", progress=False, max_seq_len=256) as m:
        per = m.slots.kv.nbytes() // m.slots.kv.num_blocks
        assert m.max_num_seqs == 4 and m.slots.why == ""
    one = per * (blocks_for(256) + SINK)
    with LLM(path, device="cpu", progress=False, max_seq_len=256, kv_cache_memory_bytes=int(2.5 * one)) as m:
        assert m.slots.kv.num_blocks == int(2.5 * one) // per and m.max_num_seqs == 4 and m.slots.why == ""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes .* less than one sequence's state"):
        LLM(path, device="cpu", progress=False, max_seq_len=256, kv_cache_memory_bytes=one - 1)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        LLM(path, device="cpu", progress=False, max_num_seqs=0)
    assert parse_bytes("16G") == 16 << 30 and parse_bytes("1.5K") == 1536 and parse_bytes(1000) == 1000
    for bad in ("lots", "-1", 0, True, "inf"):
        with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
            parse_bytes(bad)


def test_batch_flags_are_checked_and_named(cli_run):
    import argparse

    from specfire.flags import add_batch_args, check_batch_flags

    p = argparse.ArgumentParser()
    add_batch_args(p)
    for argv, flag in ((["--max-num-seqs", "0"], "--max-num-seqs"), (["--kv-cache-memory-bytes", "x"],
                                                                      "--kv-cache-memory-bytes")):
        with pytest.raises(ValueError, match=flag):
            check_batch_flags(p.parse_args(argv))
    check_batch_flags(p.parse_args(["--max-num-seqs", "3", "--kv-cache-memory-bytes", "2G"]))


def test_generate_list_arguments(llm, prompts):
    with pytest.raises(ValueError, match="params has 2 entries for 3 prompts"):
        llm.generate(prompts[:3], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="out of range"):          # refused before anything runs
        llm.generate([prompts[0], [10 ** 6]], SamplingParams(max_tokens=4))
    assert llm.scheduler.num_waiting == 0 and llm.scheduler.num_running == 0
    one = llm.generate(prompts[0], SamplingParams(max_tokens=4))
    assert not isinstance(one, list) and llm.generate([prompts[0]], SamplingParams(max_tokens=4))[0].token_ids == \
        one.token_ids


def test_closed_llm_refuses_and_ends_waiting_requests(path, prompts):
    m = LLM(path, device="cpu", progress=False, max_seq_len=256)
    log = []
    m.scheduler.submit(sch.Request(prompts[0], SamplingParams(max_tokens=4), SpecPolicy("off"),
                                   lambda kind, payload: log.append(kind)))
    m.close()
    assert log == [sch.CANCELLED]
    with pytest.raises(SpecfireError, match="closed"):
        m.generate(prompts[0])


def test_the_mesh_batches_concurrent_requests_exactly(path, prompts, monkeypatch):
    """A 2-rank gloo mesh holds a sequence state per slot on every rank: four concurrent requests
    (AR, MTP k=3, n-gram k=2, seeded sampled MTP) run at once, their verifies packed into one call
    per round (one forward on every rank), each output its request alone on the mesh and the
    tp-invariant one-device output; from threads too; every rank ran every packed call."""
    from specfire.runtime.trunk import LocalTrunk

    reqs = [(SamplingParams(max_tokens=24), SpecPolicy("off")), (SamplingParams(max_tokens=24), SpecPolicy("mtp", 3)),
            (SamplingParams(max_tokens=20), SpecPolicy("ngram", 2)),
            (SamplingParams(max_tokens=20, temperature=0.8, seed=5), SpecPolicy("mtp", 3))]
    with LLM(path, tp=1, device="cpu", progress=False, max_seq_len=256, tp_invariant=True) as one:
        canon = [one.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
        one.engine.trunk.piece = 4
        canon_pieces = one.generate(prompts[1], *reqs[1]).token_ids
    with LLM(path, tp=2, device="cpu", progress=False, max_seq_len=256, max_num_seqs=4, tp_invariant=True) as mesh:
        assert mesh.max_num_seqs == 4 and mesh.slots.why == ""
        with pytest.raises(SpecfireError, match="the prefix cache serves one device; this model runs with tp=2"):
            mesh.enable_prefix_cache(1 << 20)
        alone = [mesh.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
        assert len(mesh.slots.engines) == 1
        trunk, sched = mesh.engine.trunk, mesh.scheduler
        s0 = trunk.rank_stats()
        before, sched.widest = (sched.forwards, sched.verifies), 0
        got = mesh.generate(prompts[:4], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        s1 = trunk.rank_stats()
        assert [r.token_ids for r in got] == alone
        assert len(mesh.slots.engines) == 4 and mesh.slots.busy == 0
        forwards, verifies = sched.forwards - before[0], sched.verifies - before[1]
        assert sched.widest == 4 and verifies > 1.5 * forwards
        d = [{k: b[k] - a[k] for k in a if k != "max_verify_rows"} for a, b in zip(s0, s1)]
        assert d[0] == d[1] and d[0]["verify_packed"] > 0 and d[0]["verify_packed"] + d[0]["verify"] == forwards
        assert got[1].stats["accepted"] > 0 and got[2].stats["drafted"] > 0
        streamed: list = [None] * 4

        def go(i: int) -> None:
            streamed[i] = [t for c in mesh.stream(prompts[i], *reqs[i]) for t in c.token_ids]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert streamed == alone
        # through the server: n seeded choices run at once, choice i is the request with seed + i
        # alone (the mesh keeps no state copy to share: each choice prefills the prompt itself)
        from fastapi.testclient import TestClient

        from specfire.serve.app import build_app

        sp = dict(max_tokens=12, temperature=0.8, seed=7)
        want = [mesh.generate(prompts[1], SamplingParams(**{**sp, "seed": 7 + i}), spec="mtp").text for i in range(3)]
        sched.widest = 0
        with TestClient(build_app(mesh, "m")) as tc:
            r = tc.post("/v1/completions", json={"prompt": prompts[1], "n": 3, "speculation": {"mode": "mtp"}, **sp})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == want
        assert sched.widest > 1
        # packed calls cut at the rows the captured collectives hold (5 here): the same outputs
        from specfire.parallel.control import Call

        monkeypatch.setattr("specfire.parallel.trunk.ROWS_MAX", 5)
        comm, packs = trunk._mesh.comm, []
        real = comm.send_command
        monkeypatch.setattr(comm, "send_command", lambda h: packs.append(Call.parse(h)) or real(h))
        got = mesh.generate(prompts[:4], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        assert [r.token_ids for r in got] == alone
        rows = [sum(c.args[2]) for c in packs if c.name == "verify_packed"]
        assert rows and max(rows) == 5, rows
        # a rank with no memory for another slot: no rank keeps it (the pool stops there) and the mesh goes on
        monkeypatch.setattr(LocalTrunk, "view", lambda self: (_ for _ in ()).throw(torch.OutOfMemoryError("full")))
        with pytest.raises(torch.OutOfMemoryError, match="tensor-parallel rank 0 has no memory for another sequence"):
            mesh.slots.first.fork()
        assert len(trunk._ex.slots) == 4 and not trunk.closed
        assert mesh.generate(prompts[0], *reqs[0]).token_ids == alone[0]
        # a prompt of several prefill pieces: one call each (other slots' steps run between them)
        for eng in mesh.slots.engines:
            eng.trunk.piece = 4
        s0 = trunk.rank_stats()
        assert mesh.generate(prompts[1], *reqs[1]).token_ids == canon_pieces
        s1 = trunk.rank_stats()
        assert [b["prefill"] - a["prefill"] for a, b in zip(s0, s1)] == [3, 3]
    assert alone == canon              # tp_invariant: seeded sampling too


def test_greedy_draft_chains_of_a_round_run_packed(path, prompts, monkeypatch):
    """Where chains are queued after the verify (graphs; emulated here), a round's greedy MTP
    chains run as one packed chain (every weight, the lm_head's included, read once for all the
    requests): each output is its own alone, and each request accepts what it accepts alone (the
    packed chain drafts what each chain drafts alone), and the round view that auto prices
    drafting by marks them packed. A packed chain that reads another member's verify rows changes
    the acceptance (the check can fail)."""
    from specfire.runtime.drafters import chain as chain_mod
    from specfire.runtime.drafters import mtp as mtp_mod
    from specfire.runtime.graphs import DraftGraphs

    sizes = []
    real = chain_mod.packed_chain_after
    monkeypatch.setattr(mtp_mod, "packed_chain_after", lambda *a: sizes.append(len(a[4].states)) or real(*a))
    reqs = [SamplingParams(max_tokens=n) for n in (24, 20, 28)]
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=3) as m:
        slots = [m.slots.acquire() for _ in range(3)]
        for eng in slots:
            d = eng.drafters["mtp"]
            d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True)
        for eng in slots:
            m.slots.release(eng)
        alone = [m.generate(p, sp, spec=SpecPolicy("mtp", 3)) for p, sp in zip(prompts, reqs)]
        assert sizes == []                                      # one at a time: each chain alone
        views, real_round = [], sch.Scheduler.round

        def round_(self):
            real_round(self)
            views.append(self.pool.first.shared.round.members)
        monkeypatch.setattr(sch.Scheduler, "round", round_)
        got = m.generate(prompts[:3], reqs, spec=[SpecPolicy("mtp", 3)] * 3)
        assert [r.token_ids for r in got] == [r.token_ids for r in alone]
        assert sizes and max(sizes) == 3, sizes
        # auto's view of those rounds says the three chains ran as one (they split one chain's cost)
        assert (("mtp", 3, True),) * 3 in views, views
        assert [r.stats["per_route"]["mtp"] for r in got] == [r.stats["per_route"]["mtp"] for r in alone]
        # negative control: each member's packed chain fed the previous member's verify rows
        def mixed_rows(head, lm, emb, ew, catch, step, step_pos, starts, toks, hidden, *a):
            shift = catch.spans[0][1] - catch.spans[0][0]
            return real(head, lm, emb, ew, catch, step, step_pos, starts, toks, hidden.roll(shift, 0), *a)
        monkeypatch.setattr(mtp_mod, "packed_chain_after", mixed_rows)
        bad = m.generate(prompts[:3], reqs, spec=[SpecPolicy("mtp", 3)] * 3)
        assert [r.token_ids for r in bad] == [r.token_ids for r in alone]       # greedy output holds regardless
        assert [r.stats["per_route"]["mtp"] for r in bad] != [r.stats["per_route"]["mtp"] for r in alone]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_rounds_steps_are_read_with_one_wait(path, prompts, ahead, monkeypatch):
    """Four AR requests at once: every step's (n, tokens) joins one batched host read a round
    (runtime/reads.py), so the host waits once a round, not once per request, with the GPU's
    one-step-ahead AR forced on too; each output is the request's alone."""
    from specfire.runtime.engine import Engine

    sp = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=33, ignore_eos=True),
          SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=3),
          SamplingParams(max_tokens=36, ignore_eos=True, presence_penalty=0.5)]
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=4) as m:
        want = [m.generate(p, s, spec="off").token_ids for p, s in zip(prompts, sp)]
        if ahead:
            real = Engine.steps

            def steps(self, *a, **k):
                self.queue_ahead = True
                try:
                    yield from real(self, *a, **k)
                finally:
                    self.queue_ahead = False
            monkeypatch.setattr(Engine, "steps", steps)
        reads, s = m.slots.first.shared.reads, m.scheduler
        f0, w0 = s.forwards, reads.waits
        got = m.generate(prompts[:4], sp, spec="off")
        assert [r.token_ids for r in got] == want
        assert len(m.slots.engines) == 4 and all(e.bufs.reads is reads for e in m.slots.engines)
        forwards, waits = s.forwards - f0, reads.waits - w0
        steps = sum(len(r.token_ids) - 1 for r in got)         # a step per token after the first
        # one wait a round (and one per request for its first step, read as soon as it is launched)
        assert steps > 3 * forwards and forwards <= waits <= forwards + len(got), (steps, forwards, waits)


@pytest.mark.parametrize("ahead", [True, False])
def test_ahead_ar_rounds_launch_the_forward_before_any_wait(path, prompts, ahead, monkeypatch):
    """The batched form of the one-step-ahead AR: every request stages its next verify from the
    device-side token before reading its last step, so a round's packed forward is queued before
    the host waits on anything (it reads the round before while the forward runs). A CPU, which
    reads each step first, waits before the forward instead; the outputs are the same either way."""
    from specfire.runtime import reads as rd
    from specfire.runtime.engine import Engine

    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=4) as m:
        want = [m.generate(p, sp, spec="off").token_ids for p in prompts[:4]]
        real_steps, real_row, real_vm, real_round = Engine.steps, rd.Batch.row, sch.verify_many, sch.Scheduler.round
        log: list[str] = []

        def steps(self, *a, **k):
            self.queue_ahead = ahead
            try:
                yield from real_steps(self, *a, **k)
            finally:
                self.queue_ahead = False

        def row(self, i):
            if self.values is None:
                log.append("wait")
            return real_row(self, i)
        monkeypatch.setattr(Engine, "steps", steps)
        monkeypatch.setattr(rd.Batch, "row", row)
        monkeypatch.setattr(sch, "verify_many", lambda calls: log.append("forward") or real_vm(calls))
        monkeypatch.setattr(sch.Scheduler, "round", lambda self: log.append("round") or real_round(self))
        got = m.generate(prompts[:4], sp, spec="off")
        assert [r.token_ids for r in got] == want
    rounds = [r.split() for r in " ".join(log).split("round") if "forward" in r]
    early = [r for r in rounds if "wait" in r[:r.index("forward")]]
    assert len(rounds) >= 29 and all(r.count("wait") <= 1 for r in rounds[2:])
    assert (early == []) if ahead else (len(early) >= len(rounds) - 3), early


def test_greedy_drafting_steps_keep_their_own_copy(path, prompts, monkeypatch):
    """A greedy MTP step queues its next draft chain behind its result's copy, so it keeps a copy of
    its own (the round's, queued after every request's chain, would make its read wait for them all);
    the AR and sampled steps of the same rounds share the round's. Outputs are each one's alone."""
    from specfire.runtime.reads import RoundReads

    reqs = [(SamplingParams(max_tokens=24, ignore_eos=True), SpecPolicy("mtp", 3)),
            (SamplingParams(max_tokens=24, ignore_eos=True), SpecPolicy("off")),
            (SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=1), SpecPolicy("mtp", 3))]
    with LLM(path, device="cpu", progress=False, max_seq_len=512, max_num_seqs=3) as m:
        want = [m.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(prompts, reqs)]
        real, put = RoundReads.put, []
        monkeypatch.setattr(RoundReads, "put", lambda self, n, t: put.append(t.shape[0]) or real(self, n, t))
        got = m.generate(prompts[:3], [sp for sp, _ in reqs], spec=[pol for _, pol in reqs])
        assert [r.token_ids for r in got] == want
        greedy, sampled = got[0].stats["per_route"]["mtp"], got[2].stats["per_route"]["mtp"]
        undrafted = greedy["steps"] - greedy["cycles"]            # (a last step with room for no draft)
        assert greedy["cycles"] > 3 and len(put) == len(got[1].token_ids) - 1 + sampled["steps"] + undrafted
