"""Tensor parallelism on the CPU (gloo, 2 and 4 ranks): the mesh is just another Trunk.

One mesh per (config, degree) is opened and reused across checks, because starting a rank costs
an interpreter and a torch import."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from procs import children, wait_gone
from repo import REPO
from tinymodels import make_checkpoint

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.config import ModelConfig
from specfire.parallel import valid_tp_degrees
from specfire.parallel.shard import ShardPlan
from specfire.errors import MeshError, SpecfireError

GREEDY = SamplingParams(max_tokens=24)


def ckpt(cache, name: str) -> str:
    if name not in cache["made"]:
        cache["made"][name] = make_checkpoint(str(cache["root"] / f"tp-{name}"), name, seed=7)
    return cache["made"][name]


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, vocab - 1, (n,), generator=g).tolist()
    return body + body[: n // 2]          # a repeat, so n-gram lookup has something to find


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="class")
def base(ckpt_cache):
    """The base config (vocab 131: odd, 2 KV heads) on one device and on a 2-rank mesh, both
    tp-invariant (one device computes the mesh's bits; the mesh's MTP head, whole on rank 0, too)."""
    path = ckpt(ckpt_cache, "base")
    one = LLM(path, tp=1, device="cpu", progress=False, tp_invariant=True)
    mesh = LLM(path, tp=2, device="cpu", progress=False, tp_invariant=True)
    yield one, mesh
    pids = mesh.engine.trunk.worker_pids
    mesh.close()
    one.close()
    assert wait_gone(pids, 10.0)


# ---- degrees ------------------------------------------------------------------------------------

def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                layer_types=("full_attention",), num_attention_heads=12, num_key_value_heads=3, head_dim=8,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8)
    return ModelConfig(**{**base, **kw})


def test_valid_degrees_follow_every_head_count():
    assert valid_tp_degrees(_cfg()) == [1]                     # 3 KV heads vs 2 and 4 q/GDN splits
    assert valid_tp_degrees(_cfg(num_key_value_heads=2)) == [1, 2, 4]
    assert valid_tp_degrees(_cfg(num_key_value_heads=1)) == [1, 2, 4]
    assert valid_tp_degrees(_cfg(num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                                 linear_num_value_heads=48)) == [1, 2, 4, 8]
    # replicated KV: rank r's query heads all read the one KV head it holds
    cfg = _cfg(num_attention_heads=8, num_key_value_heads=2)
    assert [ShardPlan(cfg, 4, r).kv0 for r in range(4)] == [0, 0, 1, 1]
    assert [ShardPlan(cfg, 4, r).n_kv for r in range(4)] == [1, 1, 1, 1]
    assert [ShardPlan(cfg, 2, r).kv0 for r in range(2)] == [0, 1]


def test_refused_degree_names_the_heads_before_any_process(ckpt_cache):
    path = ckpt(ckpt_cache, "base")
    before = children()
    with pytest.raises(ValueError, match=r"tp=4 does not divide linear_num_key_heads=2; valid tp degrees for "
                                         r"this model: 1, 2$"):
        LLM(path, tp=4, device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4"):
        LLM(path, tp=3, device="cpu", progress=False)
    assert children() == before


def test_each_rank_reads_only_its_slices(ckpt_cache):
    """Over all ranks, every split tensor is read exactly once (KV heads once per replica), whole
    tensors only for the replicated norms, and the shapes fit the sharded modules."""
    from specfire.model import loader

    path = ckpt(ckpt_cache, "tp4")
    src = loader.open_checkpoint(path)
    cfg = ModelConfig.from_dir(path)
    reads: dict[str, int] = {}
    whole: set[str] = set()
    real_get = src.get

    def get(name, index=None):
        t = real_get(name, index)
        reads[name] = reads.get(name, 0) + t.numel()
        if index is None:
            whole.add(name)
        return t

    src.get = get
    tp = 4
    names = [n for n in src.names() if not n.startswith("mtp.")]
    for r in range(tp):
        plan = ShardPlan(cfg, tp, r)
        for n in names:
            t = plan.fetch(src, n, None)
            if n in ("embed_tokens.weight", "lm_head.weight"):
                assert t.shape[0] == plan.vocab_shard == 38     # 151 padded to 152
    assert whole == {n for n in names if "norm" in n}
    for n in names:
        numel = 1
        for d in src.shape(n):
            numel *= d
        per_rank = 1 if n not in whole else tp
        if n.endswith(("k_proj.weight", "v_proj.weight")):
            per_rank = tp // cfg.num_key_value_heads        # 2 KV heads on 4 ranks: each read twice
        assert reads[n] == numel * per_rank, n


def test_four_bit_checkpoint_refused_before_any_process(ckpt_cache, tmp_path, capsys):
    from specfire.cli import main
    from specfire.errors import CheckpointError

    dst = str(tmp_path / "q4")
    assert main(["quantize", ckpt(ckpt_cache, "base"), dst, "--group-size", "32", "--device", "cpu"]) == 0
    before = children()
    with pytest.raises(CheckpointError, match=r"tp=2 splits the 96 input columns of 4-bit 'layers.0.mlp.down_proj.weight' "
                                              r"at 0..48, not on its 32-column quantization groups; tp degrees this "
                                              r"4-bit checkpoint allows: 1$"):
        LLM(dst, tp=2, device="cpu", progress=False)
    assert children() == before


def test_info_lists_valid_degrees(ckpt_cache):
    from specfire.info import describe

    assert describe(ckpt(ckpt_cache, "base"))["tp_degrees"] == [1, 2]
    assert describe(ckpt(ckpt_cache, "tp4"))["tp_degrees"] == [1, 2, 4]


# ---- numerics: the mesh equals one device ---------------------------------------------------------

# One device's logits and tokens on the tp4 and kv1 configs at every degree, bit for bit
# (tp_invariant), with the workers counted and gone after close: tests/kernels/test_tp_invariance.py.

class TestMeshOfTwo:
    """Checks sharing one 2-rank mesh of the base config (closed when the class is done)."""

    def test_each_model_is_built_from_its_targets_layers(self, base):
        """One device with tp_invariant is built from the canonical layers (the split-K
        reductions whole); rank 0 from its shards (parallel/layers.py), the mesh's fields on its
        row-parallel projections only. The MTP head, whole on rank 0, is the canonical one on both."""
        from specfire.layers import CPU_EXACT, ExactLinear, Linear, SplitLinear
        from specfire.parallel.layers import ColumnParallelLinear, RowParallelLinear

        one, mesh = base
        assert one.tp_invariant and mesh.tp_invariant
        ref, rank0 = one.engine.trunk.model, mesh.engine.trunk._local.model
        assert ref.target is CPU_EXACT and rank0.target.exact
        assert one.engine.drafters["mtp"].head.target is CPU_EXACT
        assert mesh.engine.drafters["mtp"].head.target is CPU_EXACT
        full = next(i for i, layer in enumerate(ref.layers) if layer.kind == "full_attention")
        a, r = ref.layers[full].self_attn, rank0.layers[full].self_attn
        assert type(a.q_proj) is ExactLinear and type(a.o_proj) is SplitLinear
        assert isinstance(r.q_proj, ColumnParallelLinear) and r.q_proj.launch_n == a.q_proj.weight.shape[0]
        assert r.q_proj.weight.shape[0] * 2 == a.q_proj.weight.shape[0]
        assert isinstance(r.o_proj, RowParallelLinear) and r.o_proj.weight.shape[1] * 2 == a.o_proj.weight.shape[1]
        assert not any(hasattr(m, "combine") for m in ref.modules() if isinstance(m, Linear))

    def test_score_tp2_matches(self, base):
        one, mesh = base
        ids = prompt(one.cfg.vocab_size, 50, seed=1)
        assert rel_err(mesh.score(ids), one.score(ids)) < 1e-5


    def test_greedy_ar_mtp_ngram_on_mesh_equal_ar(self, base):
        one, mesh = base
        ids = prompt(one.cfg.vocab_size, 30, seed=2)
        sp = SamplingParams(max_tokens=40)
        ar = one.generate(ids, sp, spec="off").token_ids
        assert mesh.generate(ids, sp, spec="off").token_ids == ar
        for k in (1, 3, 5):
            r = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=k))
            assert r.stats["route"] == "mtp" and r.stats["drafted"] > 0
            assert r.token_ids == ar
            r1 = one.generate(ids, sp, spec=SpecPolicy("mtp", k=k))      # the same drafts, accepted alike
            assert (r.stats["drafted"], r.stats["accepted"]) == (r1.stats["drafted"], r1.stats["accepted"])
        r = mesh.generate(ids, sp, spec=SpecPolicy("ngram", k=4))
        assert r.stats["route"] == "ngram" and r.stats["drafted"] > 0
        assert r.token_ids == ar


    def test_turn_ends_cut_the_mesh_prefill_too(self, base):
        """A chat prompt's turn ends reach every rank: the mesh's prefill ends its forwards where one
        device's does, on the same bits (a prefill cut elsewhere computes other bits)."""
        one, mesh = base
        ids = torch.tensor(prompt(one.cfg.vocab_size, 50, seed=4))
        rows = {}
        for name, m, ends in (("one", one, (21,)), ("mesh", mesh, (21,)), ("uncut", one, ())):
            m.engine.trunk.begin()
            rows[name] = m.engine.trunk.prefill(ids, ends=ends)
        assert torch.equal(rows["mesh"].logits, rows["one"].logits)
        assert torch.equal(rows["mesh"].hidden, rows["one"].hidden)
        assert not torch.equal(rows["uncut"].hidden, rows["one"].hidden)

    def test_penalties_on_mesh_equal_ar(self, base):
        """Penalties are applied on rank 0 to the gathered verify rows: greedy AR, MTP and n-gram on
        the mesh equal one device's AR with each penalty (and the penalty changes the output). One
        MTP k: this random model accepts almost no draft, so every k re-checks rank 0's penalised
        row 0 (the rows' arithmetic at each k, with drafts accepted, is test_penalties.py's)."""
        one, mesh = base
        ids = prompt(one.cfg.vocab_size, 30, seed=6)
        plain = one.generate(ids, SamplingParams(max_tokens=40), spec="off").token_ids
        for kw in (dict(repetition_penalty=1.3), dict(frequency_penalty=0.6, presence_penalty=0.4)):
            sp = SamplingParams(max_tokens=40, **kw)
            ar = one.generate(ids, sp, spec="off").token_ids
            assert ar != plain
            assert mesh.generate(ids, sp, spec="off").token_ids == ar
            for k in (3,):
                r = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=k))
                assert r.stats["route"] == "mtp" and r.stats["drafted"] > 0 and "penalties" in r.stats["route_reason"]
                assert r.token_ids == ar, (kw, k)
            r = mesh.generate(ids, sp, spec=SpecPolicy("ngram", k=4))
            assert r.stats["route"] == "ngram" and r.stats["drafted"] > 0
            assert r.token_ids == ar, kw

    def test_policy_per_request_reaches_every_rank(self, base):
        """Every rank runs exactly the verify rows rank 0's route asks for: one row per step with
        speculation off, k+1 rows with MTP at k."""
        _, mesh = base
        trunk = mesh.engine.trunk
        ids = prompt(mesh.cfg.vocab_size, 20, seed=3)

        def delta(spec):
            s0 = trunk.rank_stats()
            res = mesh.generate(ids, SamplingParams(max_tokens=12), spec=spec)
            s1 = trunk.rank_stats()
            d = [{k: b[k] - a[k] for k in a if k != "max_verify_rows"} for a, b in zip(s0, s1)]
            assert all(x == d[0] for x in d), d            # every rank did the same work
            return res, d[0]

        res, d = delta("off")
        assert res.stats["route"] == "ar" and d["verify_rows"] == d["verify"] == res.stats["generated_tokens"] - 1
        assert d["lm_logits"] == 0
        res, d = delta(SpecPolicy("mtp", k=4))
        assert res.stats["route"] == "mtp" and d["verify_rows"] == d["verify"] + res.stats["drafted"]
        assert d["lm_logits"] == 0                           # on the CPU the drafter scores on rank 0
        res, d = delta(SpecPolicy("auto", k=2))                # measured per cycle: any route, same rows
        assert res.stats["route"] in ("ar", "mtp", "ngram") and d["verify_rows"] == d["verify"] + res.stats["drafted"]


    def test_a_step_is_one_header_and_no_host_read(self, base):
        """An AR step sends one command (its commit rides in the next header, as the request's end
        does) and no token ids: they stay on rank 0's device and reach the ranks inside the rows
        forward, so rank 0 never waits on the device to send a step. Workers still commit every
        step (equal counters)."""
        from specfire.parallel.control import Call, IdsArg, SharedIdsArg

        one, mesh = base
        trunk = mesh.engine.trunk
        comm = trunk._mesh.comm
        sent = []
        real = comm.send_command
        comm.send_command = lambda h: sent.append(Call.parse(h)) or real(h)
        try:
            ids = prompt(one.cfg.vocab_size, 20, seed=4)
            s0 = trunk.rank_stats()
            res = mesh.generate(ids, SamplingParams(max_tokens=10), spec="off")
            s1 = trunk.rank_stats()
        finally:
            comm.send_command = real
        assert res.token_ids == one.generate(ids, SamplingParams(max_tokens=10), spec="off").token_ids
        names = [c.name for c in sent]
        steps = res.stats["generated_tokens"] - 1
        assert names == ["rank_stats", "begin", "prefill"] + ["verify"] * steps + ["rank_stats"]
        verifies = [c for c in sent if c.name == "verify"]
        assert all(isinstance(c.args[0], SharedIdsArg) and not any(isinstance(a, IdsArg) for a in c.args)
                   for c in verifies)
        # the last commit and the request's end (its KV blocks back to every rank's pool) ride together
        assert [c.commits for c in verifies] == [()] + [(0,)] * (steps - 1) and sent[-1].commits == (0, ("end", 0))
        d = [{k: b[k] - a[k] for k in a} for a, b in zip(s0, s1)]
        assert d[0]["commit"] == d[1]["commit"] == steps and d[0]["end"] == d[1]["end"] == 1

    def test_a_header_past_one_command_buffer_goes_in_two(self, base):
        """A header longer than the command buffer (a packed verify of many slots with their
        riders) sends its tail in a second broadcast: the ranks read it whole and stay in step."""
        from specfire.parallel.comm import CMD_BYTES

        one, mesh = base
        trunk = mesh.engine.trunk
        got = trunk.rank_time(1, 1, "p" * (3 * CMD_BYTES))      # no graph on the CPU: NaN on every rank
        assert len(got) == 2 and all(t != t for t in got)
        ids = prompt(one.cfg.vocab_size, 12, seed=8)
        sp = SamplingParams(max_tokens=6)
        assert mesh.generate(ids, sp, spec="off").token_ids == one.generate(ids, sp, spec="off").token_ids

    def test_drafter_vocab_calls_through_the_mesh_match(self, base):
        """The mesh's vocab-parallel embedding and lm_head equal one device (the GPU's drafter path)."""
        one, mesh = base
        ids = torch.tensor(prompt(one.cfg.vocab_size, 9, seed=9) + [one.cfg.vocab_size - 1])
        trunk, ref = mesh.engine.trunk, one.engine.trunk
        assert torch.equal(trunk.mesh_embed(ids), ref.embed(ids))       # one rank holds each row: exact
        assert torch.equal(trunk.embed(ids), ref.embed(ids))
        h = torch.randn(3, one.cfg.hidden_size, generator=torch.Generator().manual_seed(10))
        assert rel_err(trunk.mesh_lm_logits(h), ref.lm_logits(h)) < 1e-6
        assert torch.equal(trunk.lm_logits(h), ref.lm_logits(h))
        assert trunk.mesh_lm_logits(h).shape == (3, one.cfg.vocab_size)

    def test_sharded_draft_equals_the_whole_lm_head_draft(self, base):
        """The greedy draft chain scored by every rank's vocabulary rows (parallel/draft.py, the
        GPU mesh's default) picks the tokens the whole lm_head picks, and greedy MTP still == AR."""
        one, mesh = base
        trunk, ref = mesh.engine.trunk, one.engine.trunk
        assert not trunk.draft_sharded                    # the CPU default: rank 0's whole copy
        h = torch.randn(4, one.cfg.hidden_size, generator=torch.Generator().manual_seed(12))
        h[3] = 0.0                                        # every logit ties: the first index wins
        trunk.draft_sharded = True
        try:
            trunk.draft_rounds(4, 1, 0)                   # the other rank's side of 4 picks
            got = torch.cat([trunk.draft_pick(h[i:i + 1]) for i in range(4)])
        finally:
            trunk.draft_sharded = False
        whole = ref.lm_logits(h)                          # the canonical whole lm_head: paneled like the shards
        assert got.tolist() == whole.argmax(-1).tolist() and got[3] == 0
        drafter = mesh.engine.drafters["mtp"]
        seen = {}
        real = drafter.propose

        def spy(*a):
            d, q = real(*a)
            seen.setdefault(trunk.draft_sharded, []).append(d.tolist())
            return d, q
        drafter.propose = spy
        ids = prompt(one.cfg.vocab_size, 20, seed=13)
        sp = SamplingParams(max_tokens=14)
        ar = one.generate(ids, sp, spec="off").token_ids
        try:
            whole_out = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=3)).token_ids
            trunk.draft_sharded = True
            shard_out = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=3)).token_ids
        finally:
            trunk.draft_sharded = False
            drafter.propose = real
        assert whole_out == shard_out == ar
        assert seen[True] == seen[False] and len(seen[True]) > 2

    def test_chain_queued_before_the_read_drafts_the_same(self, base):
        """With the draft chain in (emulated) graphs, the next chain is queued right after a verify,
        from the accepted row on the device (MtpDrafter.prepare), before the host reads the step: its
        drafts equal the chain run after the read, on one device and on the mesh (sharded picks)."""
        from specfire.runtime.graphs import DraftGraphs

        one, mesh = base
        ids = prompt(one.cfg.vocab_size, 20, seed=14)
        sp = SamplingParams(max_tokens=16)
        ar = one.generate(ids, sp, spec="off").token_ids

        def run(llm, graphs: bool):
            d = llm.engine.drafters["mtp"]
            log, real = [], d.propose

            def spy(*a):
                pre = d._pre
                out, q = real(*a)
                log.append((out.tolist(), pre is not None and out is pre[1]))
                return out, q
            d.propose = spy
            d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
            try:
                toks = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3)).token_ids
            finally:
                d.propose, d.graphs = real, None
            return toks, log

        t0, eager = run(one, False)
        t1, queued = run(one, True)
        mesh.engine.trunk.draft_sharded = True
        try:
            t2, queued_mesh = run(mesh, True)
        finally:
            mesh.engine.trunk.draft_sharded = False
        assert t0 == t1 == t2 == ar
        assert [x for x, _ in queued] == [x for x, _ in eager] == [x for x, _ in queued_mesh]
        used = sum(u for _, u in queued)
        assert used >= len(queued) // 2 and used == sum(u for _, u in queued_mesh) and not any(u for _, u in eager)

    def test_mesh_trunk_is_read_only_through_the_protocol(self, base):
        """The MTP drafter over the mesh trunk (sharded picks, the chain in emulated graphs, greedy
        with and without penalties, sampled) reads only `Trunk` members of it."""
        from recorder import Recorder, members

        from specfire.runtime.graphs import DraftGraphs
        from specfire.runtime.trunk import Trunk

        one, mesh = base
        d = mesh.engine.drafters["mtp"]
        real = d.trunk
        ids = prompt(one.cfg.vocab_size, 16, seed=15)
        d.trunk = rec = Recorder(real)
        d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True)
        real.draft_sharded = True
        try:
            for sp in (SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, frequency_penalty=0.5),
                       SamplingParams(max_tokens=10, temperature=0.8, seed=2)):
                r = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
                if sp.greedy:
                    assert r.token_ids == one.generate(ids, sp, spec="off").token_ids
        finally:
            real.draft_sharded = False
            d.trunk, d.graphs = real, None
        assert rec.seen - members(Trunk) == set()
        assert {"draft_pick", "draft_rounds", "draft_sharded"} <= rec.seen

    def test_state_isolation_across_requests(self, base):
        one, mesh = base
        a = prompt(one.cfg.vocab_size, 25, seed=4)
        b = prompt(one.cfg.vocab_size, 33, seed=5)
        sp = SamplingParams(max_tokens=16)
        ref_a = one.generate(a, sp, spec="off").token_ids
        first = mesh.generate(a, sp, spec="mtp").token_ids
        mesh.generate(b, sp, spec="ngram")
        mesh.generate(b, SamplingParams(max_tokens=9, temperature=0.8, seed=1), spec="mtp")
        assert mesh.generate(a, sp, spec="mtp").token_ids == first == ref_a
        assert mesh.generate(a, sp, spec="off").token_ids == ref_a


    def test_sampling_on_mesh_runs_and_is_seeded(self, base):
        _, mesh = base
        ids = prompt(mesh.cfg.vocab_size, 20, seed=6)
        sp = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=11)
        r1 = mesh.generate(ids, sp, spec="mtp")
        r2 = mesh.generate(ids, sp, spec="mtp")
        assert r1.token_ids == r2.token_ids and len(r1.token_ids) == 12
        assert all(0 <= t < mesh.cfg.vocab_size for t in r1.token_ids)


# ---- load-time policy, faults, lifecycle -------------------------------------------------------------

def test_constrained_and_logprobs_on_mesh_equal_one_device(ckpt_cache):
    """The grammar mask and the logprobs are rank 0's, after the gathered verify rows, as the
    penalties are: a constrained request on a 2-rank mesh gives one device's tokens and logprobs
    (tp_invariant), AR, MTP and n-gram alike."""
    from ckpts import tiny
    from specfire.grammar import GrammarSpec

    path = tiny(ckpt_cache, "base", tokenizer=True)
    sp = SamplingParams(max_tokens=40, logprobs=2,
                        structured_outputs=GrammarSpec("regex", r"[a-f]{2,6}( [0-9a-f]{1,4}){2,6}", "guided_regex"))
    with (LLM(path, tp=1, device="cpu", progress=False, tp_invariant=True) as one,
          LLM(path, tp=2, device="cpu", progress=False, tp_invariant=True) as mesh):
        ids = prompt(one.cfg.vocab_size, 20, seed=3)
        ar = one.generate(ids, sp, spec="off")
        assert ar.finish_reason == "stop" and ar.text
        for spec in ("off", SpecPolicy("mtp", k=3), SpecPolicy("ngram", k=2)):
            r = mesh.generate(ids, sp, spec=spec)
            assert "grammar" in r.stats["route_reason"]
            assert r.token_ids == ar.token_ids and r.logprobs == ar.logprobs, spec


def test_load_time_off_then_killed_worker(ckpt_cache):
    """spec=off at load: no MTP head anywhere, an explicit mtp request is refused, n-gram still
    served. Then a killed worker surfaces as MeshError at once, the mesh closes, nothing hangs."""
    path = ckpt(ckpt_cache, "base")
    llm = LLM(path, tp=2, device="cpu", spec="off", progress=False)
    trunk = llm.engine.trunk
    assert not llm.mtp_loaded
    ids = prompt(llm.cfg.vocab_size, 20, seed=8)
    with pytest.raises(SpecfireError, match="no MTP head is loaded"):
        llm.generate(ids, GREEDY, spec="mtp")
    assert llm.generate(ids, GREEDY).stats["route"] == "ar"
    assert llm.generate(ids, GREEDY, spec="ngram").stats["route"] == "ngram"
    (pid,) = trunk.worker_pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(MeshError, match=r"worker rank 1 \(pid \d+\) died"):
        llm.generate(ids, GREEDY, spec="off")
    assert time.monotonic() - t0 < 5.0
    assert trunk.closed and wait_gone([pid], 5.0)
    with pytest.raises(MeshError, match="failed earlier"):
        trunk.score(torch.tensor(ids))
    llm.close()
    llm.close()


def test_a_mesh_without_tp_invariant_keeps_its_exact_trunk(ckpt_cache):
    """tp_invariant=False is a mesh's default too: its trunk computes the canonical math anyway (a
    shard has no other), so greedy output is still one invariant device's; only rank 0's whole MTP
    head is one device's plain one (its drafts may then differ in the last bits)."""
    from specfire.layers import CPU

    path = ckpt(ckpt_cache, "base")
    ids = prompt(131, 20, seed=11)
    with LLM(path, tp=1, device="cpu", progress=False, tp_invariant=True) as one:
        ar = one.generate(ids, GREEDY, spec="off").token_ids
    with LLM(path, tp=2, device="cpu", progress=False, tp_invariant=False) as mesh:
        assert not mesh.tp_invariant and mesh.engine.trunk._local.model.target.exact
        assert mesh.engine.drafters["mtp"].head.target is CPU
        assert mesh.generate(ids, GREEDY, spec="off").token_ids == ar
        assert mesh.generate(ids, GREEDY, spec=SpecPolicy("mtp", k=3)).token_ids == ar


def test_hung_worker_times_out(ckpt_cache, monkeypatch):
    monkeypatch.setenv("SPECFIRE_TP_TIMEOUT", "2")
    path = ckpt(ckpt_cache, "base")
    with LLM(path, tp=2, device="cpu", progress=False) as llm:
        (pid,) = llm.engine.trunk.worker_pids
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(MeshError, match="did not answer within 2 s"):
            llm.generate([1, 2, 3], GREEDY)
        assert time.monotonic() - t0 < 10.0
        assert wait_gone([pid], 5.0)


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_no_orphans_and_exit_without_close_and_torchrun(ckpt_cache):
    """At once: (a) a parent killed with SIGKILL takes its worker with it; (b) a torchrun-style
    launch (RANK/WORLD_SIZE/MASTER_*) joins the group: rank 0 drives and exits without close(),
    so only the finalizer at interpreter exit can tell rank 1, which then exits 0."""
    path = ckpt(ckpt_cache, "base")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    common = f"""
        import os, signal, sys
        from specfire import LLM, SamplingParams
        llm = LLM({path!r}, tp=2, device="cpu", progress=False)
    """
    kill = subprocess.Popen(_script(common + """
        print(llm.engine.trunk.worker_pids[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """), env=env, stdout=subprocess.PIPE, text=True)
    from serving import free_port

    port = free_port()                   # not a fixed one: other test runs may share the machine
    ranks = [subprocess.Popen(_script(common + """
        print(llm.generate([5, 6, 7, 5, 6], SamplingParams(max_tokens=6), spec="mtp").token_ids, flush=True)
    """), env={**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}, stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out_kill, _ = kill.communicate(timeout=120)
        outs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in [kill, *ranks]:
            if p.poll() is None:
                p.kill()
    assert kill.returncode == -signal.SIGKILL
    assert wait_gone([int(out_kill.split()[0])], 5.0), "worker outlived its killed parent"
    with LLM(path, tp=1, device="cpu", progress=False, tp_invariant=True) as one:
        ref = one.generate([5, 6, 7, 5, 6], SamplingParams(max_tokens=6), spec="off").token_ids
    assert [p.returncode for p in ranks] == [0, 0]
    assert outs[0].strip() == str(ref) and outs[1].strip() == ""
