"""Paged KV on a 2-rank gloo mesh (parallel/control.py, model/kvpool.py): every rank's slots share
one pool the per-rank budget sizes (rank 0's holding the MTP head's KV too, over each slot's own
block table), admission reserves blocks on rank 0's pool, and every rank takes and frees the same
blocks in the same order, so a request's output is its own alone and the one-device tp-invariant
one, while a request the pool cannot cover yet waits."""
from __future__ import annotations

import pytest

import specfit
from procs import wait_gone
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.model.kvpool import SINK, blocks_for
from specfire.parallel.shard import ShardPlan
from specfire.runtime import scheduler as sch
from specfire.runtime.drafters.mtp import AHEAD
from specfire.runtime.slots import block_bytes, state_bytes

MAX_SEQ = 256
# greedy AR, greedy MTP, n-gram, seeded sampled MTP, penalised auto
MIXED = [
    (SamplingParams(max_tokens=24), SpecPolicy("off")),
    (SamplingParams(max_tokens=24), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=20), SpecPolicy("ngram", 2)),
    (SamplingParams(max_tokens=20, temperature=0.8, seed=5), SpecPolicy("mtp", 3)),
    (SamplingParams(max_tokens=22, frequency_penalty=0.5, repetition_penalty=1.1), SpecPolicy("auto", 3)),
]
LONG = SamplingParams(max_tokens=8)     # with a 200-token prompt: 4 blocks promised of the pool's 6
EDGE = 60                               # a prompt whose prefill reaches one block, and past it with the head's reach


def _heads(llm: LLM) -> list[int]:
    """Rank 0's pool layers: its shard of the trunk's KV heads, then the MTP head's (whole)."""
    cfg = llm.cfg
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    return [ShardPlan(cfg, 2, 0).n_kv] * n_attn + [cfg.num_key_value_heads]


@pytest.fixture(scope="module")
def path(ckpt_cache) -> str:
    """The fitted tiny model (drafts really get accepted)."""
    return specfit.variant(specfit.fitted_checkpoint(ckpt_cache["shared"]), str(ckpt_cache["root"] / "mesh_pages"))


def _pool_bytes(llm: LLM, blocks: int) -> int:
    """A rank's budget for `blocks` of rank 0's blocks (the sink among them; the other rank's
    smaller blocks, without the head's, fit more, and its pool shrinks to rank 0's)."""
    return block_bytes(_heads(llm), llm.cfg.head_dim, llm.kv_dtype) * blocks


def _same_tables(stats: list[dict[str, int]]) -> bool:
    return all(s["kv_used"] == stats[0]["kv_used"] and s["kv_digest"] == stats[0]["kv_digest"] for s in stats)


def test_a_mesh_pages_its_slots_kv_in_one_pool_per_rank(path):
    short = specfit.prompts(len(MIXED), length=10, seed=42)
    longs = specfit.prompts(2, length=200, seed=7)
    edges = specfit.prompts(2, length=EDGE, seed=9)
    with LLM(path, tp=1, device="cpu", progress=False, max_seq_len=MAX_SEQ, tp_invariant=True) as one:
        canon = [one.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(short, MIXED)]
        canon_long = [one.generate(p, LONG, spec="mtp").token_ids for p in longs]
        canon_edge = [one.generate(p, LONG, spec="mtp").token_ids for p in edges]
        budget = _pool_bytes(one, int(1.5 * blocks_for(MAX_SEQ)) + SINK)
    mesh = LLM(path, tp=2, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_num_seqs=4, tp_invariant=True,
               kv_cache_memory_bytes=budget)
    pids = mesh.engine.trunk.worker_pids
    try:
        trunk, sched, pool = mesh.engine.trunk, mesh.scheduler, mesh.slots.kv
        assert pool is trunk._local.kv_pool and pool.capacity == 6 < 4 * blocks_for(MAX_SEQ)
        assert mesh.max_num_seqs == 4 and mesh.slots.why == ""
        # the MTP head's KV is the last layer of rank 0's pool (whole heads, beside the trunk's
        # shards) over the slot's own block table: no max_seq of it per slot, none outside the pool
        cfg = mesh.cfg
        assert [k.shape[1] for k in pool.k] == _heads(mesh) and AHEAD > 0
        assert pool.nbytes() == block_bytes(_heads(mesh), cfg.head_dim, mesh.kv_dtype) * pool.num_blocks
        assert mesh.slots.slot_bytes == state_bytes(cfg, MAX_SEQ, mesh.kv_dtype, True, ShardPlan(cfg, 2, 0), kv=False)
        alone = [mesh.generate(p, sp, spec=pol).token_ids for p, (sp, pol) in zip(short, MIXED)]
        assert alone == canon                       # tp2 == tp1 (tp_invariant), seeded sampling too
        # four at once (each promised one block), the fifth waits for a slot; every round's
        # block tables are the same on both ranks
        seen: list[list[dict[str, int]]] = []
        sched.after_round = lambda: seen.append(trunk.rank_stats())
        sched.widest = 0
        got = mesh.generate(short, [sp for sp, _ in MIXED], spec=[pol for _, pol in MIXED])
        sched.after_round = None
        assert [r.token_ids for r in got] == alone
        assert sched.widest == 4 and len(mesh.slots.engines) == 4
        for eng in mesh.slots.engines:
            head, st = eng.drafters["mtp"].state, eng.trunk.kv_state
            assert head.layers[0].k is pool.k[-1] and head.table is st.table and head.shared
            assert st.ahead == AHEAD and st.table.pool is pool
        assert seen and all(_same_tables(s) for s in seen)
        assert max(s[0]["kv_used"] for s in seen) == 4
        assert pool.used == pool.reserved == 0
        # two long requests: each may reach 4 blocks, so the second waits for the first's (no
        # failure, no out-of-memory), and each is still its own
        log: list[tuple[int, str]] = []
        results: list = [None, None]
        reqs = []
        for i, p in enumerate(longs):
            def on_event(kind, payload, i=i):
                log.append((i, kind))
                if kind == sch.DONE:
                    results[i] = payload.result
            reqs.append(sch.Request(p, LONG, SpecPolicy("mtp"), on_event))
        seen.clear()
        sched.after_round = lambda: seen.append(trunk.rank_stats())
        sched.widest = 0
        for r in reqs:
            sched.submit(r)
        assert sched.num_waiting == 2
        sched.drive_until(lambda: all(r.over for r in reqs))
        sched.after_round = None
        assert [r.token_ids for r in results] == canon_long
        assert log.index((1, sch.STARTED)) > log.index((0, sch.DONE)) and sched.widest == 1
        assert all(_same_tables(s) for s in seen) and max(s[0]["kv_used"] for s in seen) == 4
        # prompts of EDGE tokens: the prefill's rows fit one block, the head's reach past them
        # does not, so every rank takes a second block (each rank's slots grow alike)
        seen.clear()
        sched.after_round = lambda: seen.append(trunk.rank_stats())
        got = mesh.generate(edges, [LONG] * 2, spec=["mtp"] * 2)
        sched.after_round = None
        assert [r.token_ids for r in got] == canon_edge
        assert blocks_for(EDGE) < blocks_for(EDGE + AHEAD) and max(s[0]["kv_used"] for s in seen) == 4
        assert seen and all(_same_tables(s) for s in seen)
        stats = trunk.rank_stats()
        assert _same_tables(stats) and stats[0]["kv_used"] == 0 and pool.used == pool.reserved == 0
        assert stats[0]["end"] == stats[1]["end"] > 0
    finally:
        mesh.close()
    assert wait_gone(pids, 10.0)


def test_a_budget_below_one_sequence_is_refused_naming_it(path):
    with LLM(path, tp=1, device="cpu", progress=False, max_seq_len=MAX_SEQ) as one:
        budget = _pool_bytes(one, blocks_for(MAX_SEQ) + SINK) - 1
    with pytest.raises(ValueError, match="kv_cache_memory_bytes .* less than one sequence's state"):
        LLM(path, tp=2, device="cpu", progress=False, max_seq_len=MAX_SEQ, kv_cache_memory_bytes=budget)
