"""Tensor-parallel invariance: tp = 1, 2, 4 compute the same bits (CPU, gloo), and the pieces that
make it so: the canonical 8-chunk split of row-parallel reductions (kernels/splitk), column shards
computed as the whole matrix (kernels/gemv), lane-independent transcendentals (kernels/lanes.py),
and the CUDA kernels of the same scheme under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

from tinymodels import make_checkpoint

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.kernels import lanes
from specfire.kernels.gemv import linear
from specfire.kernels.splitk import CHUNKS, ChunkCache, KSplit, chunk_bounds, subtree, tree_sum


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, vocab - 1, (n,), generator=g).tolist()
    return body + body[: n // 2]           # a repeat, so n-gram lookup finds drafts


# ---- the canonical split, in one process --------------------------------------------------------

def test_chunks_align_with_every_shard_bound():
    """Rank r of tp holds chunks [r*8/tp, (r+1)*8/tp): their columns are exactly its shard, for even
    splits (heads) and the floor(I*r/tp) split of an uneven MLP."""
    for k in (64, 96, 98, 17408, 6144, 13):
        b = chunk_bounds(k)
        for tp in (1, 2, 4, 8):
            for r in range(tp):
                s = KSplit.for_rank(k, r, tp)
                assert b[s.c0] == k * r // tp and b[s.c1] == k * (r + 1) // tp
                assert s.k_local == k * (r + 1) // tp - k * r // tp
    with pytest.raises(ValueError, match="tp=3 does not divide 8"):
        KSplit.for_rank(96, 0, 3)


def test_tree_sum_is_the_pairwise_tree():
    p = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0, 3.0, 5.0, 7.0, 11.0)]
    want = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert torch.equal(tree_sum(p), want)
    # a rank's subtree then the ranks' tree is the same tree (tp = 2 and 4)
    assert torch.equal(tree_sum([tree_sum(p[:4]), tree_sum(p[4:])]), want)
    assert torch.equal(tree_sum([tree_sum(p[i:i + 2]) for i in range(0, 8, 2)]), want)


def _shards_vs_whole(x, w, rows):
    """The whole product (tp = 1) and, per degree, the ranks' subtrees combined by the tree."""
    k = w.shape[1]
    whole = subtree(x, w, KSplit(k), rows, ChunkCache())
    out = {}
    for tp in (2, 4, 8):
        subs = []
        for r in range(tp):
            s = KSplit.for_rank(k, r, tp)
            lo = chunk_bounds(k)[s.c0]
            subs.append(subtree(x[:, lo:lo + s.k_local].contiguous(), w[:, lo:lo + s.k_local].contiguous(),
                                s, rows, ChunkCache()))
        out[tp] = tree_sum(subs)
    return whole, out


@pytest.mark.parametrize("n,k", [(64, 98), (64, 48), (32, 64), (40, 1000), (64, 256), (48, 768)])
def test_row_parallel_subtrees_equal_whole_bitwise(n, k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g)
    for m, rows in ((1, True), (5, True), (40, False)):
        x = torch.randn(m, k, generator=g)
        whole, per = _shards_vs_whole(x, w, rows)
        torch.testing.assert_close(whole, x @ w.t(), rtol=1e-5, atol=1e-4)
        for tp, got in per.items():
            assert torch.equal(got, whole), (m, tp)
        if k in (256, 768):                    # the one-call batched form equals the chunk-by-chunk one
            from specfire.kernels.splitk import partials_cpu
            ref = tree_sum(partials_cpu(x, w, KSplit(k), rows, ChunkCache()))
            assert torch.equal(whole, ref)
    # row invariance of the rows path
    x = torch.randn(5, k, generator=g)
    y = subtree(x, w, KSplit(k), True, ChunkCache())
    assert all(torch.equal(subtree(x[i:i + 1], w, KSplit(k), True, ChunkCache())[0], y[i]) for i in range(5))


@pytest.mark.parametrize("n", [131, 98, 151, 24])
def test_column_shards_equal_whole_bitwise(n):
    """The exact product of a mesh rank (one device's own product need not match a shard)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 64, generator=g)
    for m, rows in ((1, True), (6, True), (40, False)):
        x = torch.randn(m, 64, generator=g)
        whole = linear(x, w, rows, exact=True)
        for tp in (2, 4):
            parts = [linear(x, w[n * r // tp:n * (r + 1) // tp].contiguous(), rows, exact=True) for r in range(tp)]
            assert torch.equal(torch.cat(parts, dim=-1), whole), (m, tp)


@pytest.mark.parametrize("fn", [lanes.exp, lanes.sigmoid, lanes.silu, lanes.softplus, lanes.rsqrt])
def test_transcendentals_do_not_depend_on_position(fn):
    """In an invariant scope (a mesh's forward, or one device with tp_invariant)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(7, 98, generator=g) * 4 + 0.1
    with lanes.invariant():
        whole = fn(x)
        for lo, hi in ((0, 49), (49, 98), (24, 73), (1, 2)):
            assert torch.equal(fn(x[:, lo:hi].contiguous()), whole[:, lo:hi])
        assert torch.equal(fn(x[3:4]), whole[3:4])


# ---- the CUDA kernels of the scheme, interpreted -------------------------------------------------

def test_chunk_kernels_tree_and_shards():
    """The one-launch chunk form: close to the product, row-invariant, and a rank's subtree (its
    chunks of K) combines with the others' in the canonical tree to the whole's bits; the one-loop
    form gives the same bits for equal 128-multiple chunks."""
    from specfire.kernels.gemv.kernel import gemv
    from specfire.kernels.splitk.fused import gemv_chunks_fused
    from specfire.kernels.splitk.loop import gemv_tree_loop

    def bounds(k, c):
        return torch.tensor([k * j // c for j in range(c + 1)], dtype=torch.int32)

    g = torch.Generator().manual_seed(5)
    n, k = 37, 200                                          # odd N; chunks of 25 (masked K tails)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(5, k, generator=g)
    b = chunk_bounds(k)
    whole = gemv_chunks_fused(x, w, bounds(k, CHUNKS), torch.float32)
    ref = tree_sum([x[:, b[c]:b[c + 1]] @ w[:, b[c]:b[c + 1]].t() for c in range(CHUNKS)])
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(gemv_chunks_fused(x[2:3], w, bounds(k, CHUNKS), torch.float32), whole[2:3])
    for tp in (2, 4):
        subs = []
        for r in range(tp):
            s = KSplit.for_rank(k, r, tp)
            lo = b[s.c0]
            subs.append(gemv_chunks_fused(x[:, lo:lo + s.k_local].contiguous(), w[:, lo:lo + s.k_local].contiguous(),
                                          torch.tensor(s.bounds, dtype=torch.int32), torch.float32))
        assert torch.equal(tree_sum(subs), whole)
    wl, xl = torch.randn(37, 1024, generator=g), torch.randn(5, 1024, generator=g)
    for c in (8, 4, 1):
        assert torch.equal(gemv_tree_loop(xl, wl, c, torch.float32),
                           gemv_chunks_fused(xl, wl, bounds(1024, c), torch.float32))
    bt = bounds(k, CHUNKS)
    xb = torch.randn(70, k, generator=g)                   # a prefill: 5 tiles of 16, or 2 of 64 (masked)
    for tile in (16, 64):
        y = gemv_chunks_fused(xb, w, bt, torch.float32, tile)
        assert torch.equal(y[:5], gemv_chunks_fused(xb[:5], w, bt, torch.float32, tile))
        torch.testing.assert_close(y, xb @ w.t(), rtol=1e-4, atol=1e-3)
    # a column shard with the whole matrix's launch settings gives the whole's bits. Interpreted,
    # tl.dot is numpy's matmul, whose result depends on an element's position in the tile, so the
    # shard starts on a tile bound here; on the GPU an MMA computes every element alike and
    # bench/tp.py checks real shards (e.g. 24 of 48 GDN heads, within one tile).
    w2 = torch.randn(200, k, generator=g)
    whole = gemv(x, w2)
    cfg_n = gemv(x, w2[128:].contiguous(), launch_n=200)
    assert torch.equal(cfg_n, whole[:, 128:])


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_argmax_pick_equals_argmax(tp):
    """The ranks' (best logit, first index) pairs combine to argmax over the whole vocabulary:
    ties go to the first index, NaN wins as in argmax, a rank of padding only never wins."""
    from specfire.parallel.draft import local_best, pick

    g = torch.Generator().manual_seed(tp)
    for case in range(40):
        v = 5 + case % 9
        x = torch.randint(-2, 3, (1, v), generator=g).float()       # small integers: many ties
        if case % 5 == 0:
            x[0, torch.randint(0, v, (1,), generator=g)] = float("nan")
        if case % 7 == 0:
            x[:] = float("-inf")
        shard = -(-v // tp)                                          # vocabulary rows per rank, padded
        pairs = torch.stack([local_best(x[:, r * shard:min(v, (r + 1) * shard)], r * shard) for r in range(tp)])
        assert pick(pairs).item() == x.argmax(-1).item(), (case, x)


# ---- the mesh: logits and greedy tokens identical on every degree ----------------------------------

CASES = [  # (config, degrees): KV heads replicated (2 on 4 ranks), odd vocabulary 151, MLP 98 rows
    ("tp4", (2, 4)),   # split 49/49 and 24/25/24/25; a single KV head, tied embeddings, vocabulary 127
    ("kv1", (2,)),
]


@pytest.mark.parametrize("name,degrees", CASES)
def test_mesh_bits_equal_one_device(ckpt_cache, name, degrees):
    """Odd vocabularies (padded), replicated KV heads (2 KV heads on 4 ranks, 1 on 2), tied and
    untied embeddings, uneven MLP rows: every degree gives one device's logits bit for bit and its
    tokens. Each mesh starts tp - 1 workers and leaves no process behind when closed."""
    from procs import children, wait_gone

    path = str(ckpt_cache["root"] / f"tpinv-{name}")
    if path not in ckpt_cache["made"].values():
        ckpt_cache["made"][f"tpinv-{name}"] = make_checkpoint(path, name, seed=11)
    sp = SamplingParams(max_tokens=32)
    samp = SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=5)
    with LLM(path, tp=1, device="cpu", progress=False, tp_invariant=True) as one:
        ids = _prompt(one.cfg.vocab_size, 36, seed=3)
        ref = one.score(ids)
        ar = one.generate(ids, sp, spec="off").token_ids
        assert one.generate(ids, sp, spec=SpecPolicy("mtp", k=3)).token_ids == ar
        sampled = one.generate(ids, samp, spec="off").token_ids
    for tp in degrees:
        before = children()
        with LLM(path, tp=tp, device="cpu", progress=False, tp_invariant=True) as mesh:
            pids = mesh.engine.trunk.worker_pids
            assert len(pids) == tp - 1
            symm = mesh.engine.trunk._mesh.comm.symm         # the captured forward's collectives
            calls = []
            real_tree = symm.tree
            symm.tree = lambda x: calls.append(x.shape) or real_tree(x)
            got = mesh.score(ids)
            assert got.shape == ref.shape == (len(ids), mesh.cfg.vocab_size)
            assert torch.equal(got, ref), f"tp={tp}: max diff {(got - ref).abs().max().item()}"
            assert mesh.generate(ids, sp, spec="off").token_ids == ar
            r = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            assert r.stats["drafted"] > 0 and r.token_ids == ar
            mesh.engine.trunk.draft_sharded = True         # the greedy chain's picks scored on every rank
            r = mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
            mesh.engine.trunk.draft_sharded = False
            assert r.stats["drafted"] > 0 and r.token_ids == ar
            r = mesh.generate(ids, sp, spec=SpecPolicy("ngram", k=4))
            assert r.stats["route"] == "ngram" and r.token_ids == ar
            assert mesh.generate(ids, samp, spec="off").token_ids == sampled
            # rows forwards (decode, verify) went through the GPU graph path's collectives, prefill not
            n_rows = 2 * mesh.cfg.num_hidden_layers
            assert len(calls) >= n_rows and len(calls) % n_rows == 0 and all(c[0] <= 5 for c in calls)
            assert symm.reserved == len(calls)       # each subtree written straight into the send buffer
        assert wait_gone(pids, 10.0)
        assert children() == before


def test_four_bit_mesh_bits_equal_one_device(ckpt_cache, tmp_path):
    """A 4-bit checkpoint (Hadamard-rotated groups of 32) whose row-parallel inputs split on group
    bounds at tp = 2: same logits and greedy tokens as one device. (A shard off the groups is
    refused before any process starts: tests/test_tp.py.)"""
    from specfire.cli import main

    src = make_checkpoint(str(tmp_path / "src"), "tp4", seed=5, intermediate_size=128, linear_value_head_dim=16)
    dst = str(tmp_path / "q4")
    assert main(["quantize", src, dst, "--group-size", "32", "--hadamard", "--device", "cpu"]) == 0
    sp = SamplingParams(max_tokens=16)
    with LLM(dst, tp=1, device="cpu", progress=False, tp_invariant=True) as one:
        ids = _prompt(one.cfg.vocab_size, 30, seed=4)
        ref = one.score(ids)
        ar = one.generate(ids, sp, spec="off").token_ids
    with LLM(dst, tp=2, device="cpu", progress=False) as mesh:
        assert torch.equal(mesh.score(ids), ref)
        assert mesh.generate(ids, sp, spec="off").token_ids == ar
        assert mesh.generate(ids, sp, spec=SpecPolicy("mtp", k=2)).token_ids == ar


# ---- one command starts the mesh ----------------------------------------------------------------

def test_cli_run_and_serve_start_the_mesh(tmp_path, capsys):
    """`specfire run --tp 2` and `specfire serve --tp 2` (bundled model, CPU) each start the
    2-rank mesh themselves and answer exactly as `specfire run --tp-invariant` on one device."""
    import json

    import httpx
    from serving import start_server, stop

    from specfire.cli import main

    outs = {}
    for tp in (1, 2):
        assert main(["run", "--tp", str(tp), "--tp-invariant", "--device", "cpu", "--spec", "off", "--prompt",
                     "def fibonacci(n):", "-n", "12", "--json"]) == 0
        outs[tp] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs[2]["token_ids"] == outs[1]["token_ids"] and len(outs[1]["token_ids"]) == 12
    proc, base = start_server(["--tp", "2", "--tp-invariant", "--device", "cpu"], str(tmp_path / "serve.log"))
    try:
        assert "tp-invariant: the bits of every --tp degree" in (tmp_path / "serve.log").read_text()
        r = httpx.post(base + "/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 12,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == outs[1]["text"]
        assert len(_worker_children(proc.pid)) == 1           # the server (its engine process) started rank 1
    finally:
        stop(proc)


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            pass
    return kids


def _worker_children(pid: int) -> list[int]:
    """Descendants of `pid` that run the mesh worker module (the server's engine process starts
    them: grandchildren of the server)."""
    out, todo = [], _children(pid)
    while todo:
        k = todo.pop()
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"specfire.parallel.worker" in f.read():
                    out.append(k)
            todo += _children(k)
        except FileNotFoundError:
            pass
    return out


def test_grouped_column_launch_equals_separate_launches():
    """gemv_group: two to four column projections of one input in one launch give each output the
    bits of its own launch with the group's settings (odd N, masked K tail, 1 and 5 rows); shards
    that pass the whole matrices' N get the whole's bits (interpreted, shards start on a tile
    bound: see the note above)."""
    from specfire.kernels.gemv.kernel import gemv, gemv_group, group_config

    g = torch.Generator().manual_seed(11)
    k = 200
    ws = [torch.randn(n, k, generator=g) for n in (37, 70, 5, 130)]
    for m in (1, 5):
        x = torch.randn(m, k, generator=g)
        for sel, lns in (((0, 1), (None, None)), ((0, 1, 2), (None, 140, 10)), ((3, 2, 0, 1), (None,) * 4)):
            group = [ws[i] for i in sel]
            cfg = group_config([ln or w.shape[0] for w, ln in zip(group, lns)], k)
            got = gemv_group(x, group, list(lns))
            assert [tuple(y.shape) for y in got] == [(m, w.shape[0]) for w in group]
            assert all(y.is_contiguous() and (y.data_ptr() - got[0].data_ptr()) % 128 == 0 for y in got)
            for y, w in zip(got, group):
                assert torch.equal(y, gemv(x, w, cfg))
    x = torch.randn(3, 64, generator=g)
    wholes = [torch.randn(n, 64, generator=g) for n in (8192, 130, 200)]      # settings of the 8192-row matrix
    full = gemv_group(x, wholes, [None] * 3)
    shards = gemv_group(x, [w[64:].contiguous() for w in wholes], [w.shape[0] for w in wholes])
    for a, b in zip(shards, full):
        assert torch.equal(a, b[:, 64:])


def test_tree_loop_split_programs_give_the_same_bits():
    """gemv_tree_loop with a tile's chunks shared by 2 or 4 programs (the last adds their subtrees)
    equals the one-program fold and the one-launch chunk form, into a given float32 `out` too."""
    from specfire.kernels.splitk.fused import gemv_chunks_fused
    from specfire.kernels.splitk.loop import gemv_tree_loop

    g = torch.Generator().manual_seed(12)
    w, x = torch.randn(70, 1024, generator=g), torch.randn(3, 1024, generator=g)
    for c in (8, 4, 2):
        kc = 1024 // (8 // c) if c < 8 else 1024
        wc, xc = w[:, :kc].contiguous(), x[:, :kc].contiguous()
        bc = torch.tensor([kc * j // c for j in range(c + 1)], dtype=torch.int32)
        ref = gemv_chunks_fused(xc, wc, bc, torch.float32)
        for split in (1, 2, 4):
            if c % split:
                continue
            assert torch.equal(gemv_tree_loop(xc, wc, c, torch.float32, split=split), ref)
            out = torch.empty(3, 70)
            gemv_tree_loop(xc[1:2], wc, c, torch.float32, out=out[:1], split=split)
            assert torch.equal(out[:1], ref[1:2])
    with pytest.raises(ValueError, match="split 3"):
        gemv_tree_loop(x, w, 8, torch.float32, split=3)
