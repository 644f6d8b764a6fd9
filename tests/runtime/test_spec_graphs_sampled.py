"""Sampled speculation in graphs: the device-side random stream, and the graph protocol (static
inputs copied in, outputs overwritten, the stream's state kept out of the capture's warm-up)
emulated on the CPU, where it must give the eager path's tokens exactly for a seed."""
from __future__ import annotations

import torch

from specfire import LLM, SamplingParams
from specfire.runtime.graphs import DraftGraphs, FnGraphs
from specfire.runtime.rng import DeviceRng, hash_bits
from specfire.runtime.spec import StepBuffers, accept_device

M32 = 0xFFFFFFFF


def _mix32_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _bits_py(c: int, key: int) -> int:
    k1 = _mix32_py((key & M32) ^ 0x9E3779B9)
    k2 = _mix32_py(((key >> 32) & M32) ^ k1 ^ 0x85EBCA6B)
    return _mix32_py(_mix32_py((c & M32) ^ k1) ^ k2 ^ ((c >> 32) & M32))


def test_hash_is_exact_integer_arithmetic():
    cs = [0, 1, 7, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 12345, 2 ** 62 + 3]
    for key in (0, 1, 0xDEADBEEF, 2 ** 62 - 1):
        got = hash_bits(torch.tensor(cs), torch.tensor(key)).tolist()
        assert got == [_bits_py(c, key) for c in cs]


def test_stream_is_reproducible_and_advances():
    a, b = DeviceRng().seed(7), DeviceRng().seed(7)
    x1, x2 = a.uniform((5, 3)), a.uniform((4,))
    assert torch.equal(torch.cat([x1.flatten(), x2]), b.uniform((19,)))     # one stream, however it is cut
    assert a.state.tolist() == [7, 19]
    assert not torch.equal(DeviceRng().seed(8).uniform((19,)), torch.cat([x1.flatten(), x2]))
    u = DeviceRng().seed(3).uniform((20000,))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01


def test_emulated_graph_replays_fresh_draws_like_eager():
    """The warm-up of a capture must not consume numbers; each replay draws the next ones."""
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(1)), -1)
    draft = torch.tensor([3, 5, 7])
    sp = SamplingParams(temperature=0.9, top_k=8)
    eager_rng, graph_rng = DeviceRng().seed(11), DeviceRng().seed(11)
    bufs = StepBuffers(torch.device("cpu"), emulate=True)
    outs_e, outs_g = [], []
    for i in range(6):
        d = (draft + i) % 11
        outs_e.append(torch.cat([t.view(-1) for t in accept_device(logits, d, q, sp, eager_rng)]))
        outs_g.append(torch.cat([t.view(-1) for t in bufs.accept(logits, d, q, sp, graph_rng)]))
    assert len(bufs.graphs.graphs) == 1                        # captured once, replayed six times
    assert all(torch.equal(a, b) for a, b in zip(outs_e, outs_g))
    assert torch.equal(eager_rng.state, graph_rng.state)
    assert len({tuple(o.tolist()) for o in outs_g}) > 1         # fresh numbers each replay


def test_fn_graphs_copy_inputs_in():
    g = FnGraphs(torch.device("cpu"), emulate=True)
    x = torch.arange(4.0)
    assert torch.equal(g.run("k", lambda a: (a * 2,), (x,))[0], x * 2)
    assert torch.equal(g.run("k", lambda a: (a * 2,), (x + 1,))[0], (x + 1) * 2)


def test_fn_graphs_keep_at_most_max_graphs_least_recent_out(monkeypatch):
    """Keys come from requests' sampling / penalty values: the cache is bounded, the least
    recently used graph goes first, and an evicted key is recaptured and still right."""
    monkeypatch.setattr(FnGraphs, "MAX_GRAPHS", 3)
    g = FnGraphs(torch.device("cpu"), emulate=True)
    x = torch.arange(4.0)
    for i in range(3):
        g.run(i, lambda a, i=i: (a + i,), (x,))
    g.run(0, lambda a: (a + 0,), (x,))                    # 0 is now the most recent
    g.run(3, lambda a: (a + 3,), (x,))                    # evicts 1, the least recent
    assert list(g.graphs) == [2, 0, 3]
    assert torch.equal(g.run(1, lambda a: (a + 1,), (x,))[0], x + 1)
    assert len(g.graphs) == 3 and 2 not in g.graphs


def _run(llm: LLM, graphs: bool, sp: SamplingParams, mode: str = "mtp",
         prompt: str | list[int] = "def add(a, b):\n    return") -> tuple[list[int], dict, int]:
    eng = llm.engine
    d = eng.drafters["mtp"]
    eng.bufs = StepBuffers(eng.trunk.device, emulate=graphs)
    d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
    try:
        r = llm.generate(prompt, sp, spec={"mode": mode, "k": 3})
        n_graphs = (len(d.graphs.graphs) if graphs else 0) + (len(eng.bufs.graphs.graphs) if graphs else 0)
        return r.token_ids, r.stats, n_graphs
    finally:
        eng.bufs, d.graphs = StepBuffers(eng.trunk.device), None


def test_seeded_sampled_mtp_is_identical_eager_and_graphed(bundled):
    sp = SamplingParams(max_tokens=28, temperature=0.8, top_k=40, seed=1, ignore_eos=True)
    eager, st, _ = _run(bundled, False, sp)
    graphed, _, n_graphs = _run(bundled, True, sp)
    assert n_graphs >= 2                                    # draft chain and accept both went through graphs
    assert st["cycles"] > 0 and st["accepted"] > 0          # accepts and rejections both happened
    assert graphed == eager
    again, _, _ = _run(bundled, True, sp)
    assert again == eager


def test_greedy_mtp_with_graphed_chain_equals_ar(bundled):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = bundled.generate("def add(a, b):\n    return", sp, spec="off").token_ids
    assert _run(bundled, True, sp)[0] == ar


def test_shorter_last_cycle_takes_the_queued_chains_first_drafts():
    """A cycle at the end of the KV room (max_seq_len) drafts fewer than k: with `prefix` on it
    takes the first drafts of the chain queued after the previous verify (the same drafts a
    shorter chain gives: each step sees only the steps before it) instead of dropping it and
    catching its pending rows up in prefill mode; greedy MTP == AR either way, whichever phase of
    a cycle the room ends in, and the drafts it proposes are those of the chain queued for them.
    (The tokens an output has left never shorten a cycle: its surplus drafts are not emitted.)"""
    catchups, reused = {}, {}
    with LLM(device="cpu", progress=False, max_seq_len=40) as llm:
        d = llm.engine.drafters["mtp"]
        base = llm.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n")
        real_prefill, real_propose = d._prefill, d.propose

        def prefill(toks, hidden, pos0):
            if pos0 > 0:                                   # a propose's catch-up (the prompt's starts at 0)
                catchups[mode] += 1
            return real_prefill(toks, hidden, pos0)

        def propose(last, pos, k, sp, gen, *a):
            pre = d._pre
            out, q = real_propose(last, pos, k, sp, gen, *a)
            if pre is not None and pre[0][0] > k and out.data_ptr() == pre[1].data_ptr():   # the queued chain's own drafts
                reused[mode] += 1
                assert torch.equal(out, pre[1][:k]) and out.shape[0] == k
            return out, q

        d._prefill, d.propose = prefill, propose
        sp = SamplingParams(max_tokens=64, ignore_eos=True)
        for mode in (False, True):
            catchups[mode] = reused[mode] = 0
            d.prefix = mode
            for n in range(16, 24):
                ar = llm.generate(base[:n], sp, spec="off").token_ids
                assert len(ar) == 40 - n
                assert _run(llm, True, sp, prompt=base[:n])[0] == ar, (mode, n)
    assert reused[False] == 0 and reused[True] > 0, reused
    assert catchups[True] < catchups[False], catchups
