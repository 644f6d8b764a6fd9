"""One GPU: the fused cross-rank tree + residual + RMSNorm (kernels/splitk/tree_norm.py) at the 27B row-parallel
shapes, ranks emulated on one device (the peers' slots are local buffers reached through the same
address tables), bitwise against one device's W = 1 path; then the consumer's time in a CUDA graph
against add_rms_norm's. A check that the kernels compile and agree on the GPU before a mesh runs them
(the NVLink stores and system-scope atomics across devices need the 2-GPU machine: bench/tp.py speed2)."""
from __future__ import annotations

import torch


def stage_treenorm(cfg, log, dev: str = "cuda") -> None:
    from specfire.kernels.splitk.tree_norm import Push
    from specfire.kernels.splitk.loop import gemv_tree_loop
    from specfire.kernels.splitk.tree_norm_kernel import ll_pack, tree_add_rms_norm, tree_add_rms_norm_ll

    h = cfg.hidden_size
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(7)
    shapes = {"down_proj": cfg.intermediate_size, "o_proj": cfg.num_attention_heads * cfg.head_dim}
    if dev != "cuda":                  # the smoke run (TRITON_INTERPRET=1): one small shape of whole 128-column chunks
        shapes = {"down_proj": 1024}
    nw = (torch.randn(h, generator=g, device=dev) * 0.1).to(dt)
    for name, k in shapes.items():
        w = (torch.randn(h, k, generator=g, device=dev) * k ** -0.5).to(dt)
        for m in ((1, 4) if dev == "cuda" else (2,)):
            x = torch.randn(m, k, generator=g, device=dev).to(dt)
            res = torch.randn(m, h, generator=g, device=dev).to(dt)
            whole = gemv_tree_loop(x, w, 8, torch.float32)
            s1, y1 = tree_add_rms_norm(whole.unsqueeze(0), res, nw, 1e-6)
            row = dict(shape=name, k=k, rows=m)
            for world in (2, 4):
                kl = k // world
                bufs = [torch.zeros(world, m, h, device=dev) for _ in range(world)]
                syncs = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
                tab = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
                sig = torch.tensor([s.data_ptr() for s in syncs], dtype=torch.int64, device=dev)
                pushes = []
                for r in range(world):
                    p = Push(tab, sig, r, world)
                    gemv_tree_loop(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl], 8 // world, torch.float32,
                                   out=bufs[r][r], push=p)
                    pushes.append(p)
                outs = [tree_add_rms_norm(bufs[r], res, nw, 1e-6, syncs[r], pushes[r].target) for r in range(world)]
                torch.cuda.synchronize() if dev == "cuda" else None
                row[f"tp{world}_slots_tree_equal_whole"] = all(
                    torch.equal(_tree(b), whole) for b in bufs)
                row[f"tp{world}_equal_tp1"] = all(torch.equal(s, s1) and torch.equal(y, y1) for s, y in outs)
                row[f"tp{world}_sync_rearmed"] = all(int(s.abs().sum()) == 0 for s in syncs)
                f1 = tree_add_rms_norm(whole.unsqueeze(0), res, nw, 1e-6, fold=True)
                fs = [tree_add_rms_norm(bufs[r], res, nw, 1e-6, fold=True) for r in range(world)]
                row[f"fold_tp{world}_equal_fold_tp1"] = all(torch.equal(a, f1[0]) and torch.equal(b, f1[1]) for a, b in fs)
                # the LL form (SPECFIRE_TREE_NORM=ll): (value, flag) words, the consumer polls the flags
                llb = [torch.zeros(world, m, h, dtype=torch.int64, device=dev) for _ in range(world)]
                lls = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
                ltab = torch.tensor([b.data_ptr() for b in llb], dtype=torch.int64, device=dev)
                for r in range(world):
                    gemv_tree_loop(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl], 8 // world, torch.float32,
                                   out=llb[r][r], push=Push(ltab, lls[r][1:2], r, world, ll=True))
                one = tree_add_rms_norm_ll(ll_pack(whole.unsqueeze(0)), res, nw, 1e-6)
                outs = [tree_add_rms_norm_ll(llb[r], res, nw, 1e-6, lls[r]) for r in range(world)]
                row[f"ll_tp{world}_equal_ll_tp1"] = all(torch.equal(s, one[0]) and torch.equal(y, one[1]) for s, y in outs)
                row[f"ll_tp{world}_epoch_advanced"] = all(s.tolist() == [0, 1, 0, 0] for s in lls)
            log("treenorm", **row)
    if dev != "cuda":
        return
    from specfire.kernels.small.kernel import add_rms_norm_triton
    res = torch.randn(1, h, generator=g, device=dev).to(dt)
    parts = torch.randn(2, 1, h, generator=g, device=dev)
    summed = parts.sum(0)
    t = {}
    lparts = ll_pack(parts)
    k = cfg.intermediate_size // 2                     # a tp2 rank's down_proj: the producer's epilogue cost
    wd = (torch.randn(h, k, generator=g, device=dev) * k ** -0.5).to(dt)
    xd = torch.randn(1, k, generator=g, device=dev).to(dt)
    slots = torch.zeros(2, 1, h, device=dev)
    sigw = torch.zeros(4, dtype=torch.int32, device=dev)
    cpush = Push(torch.tensor([slots.data_ptr()] * 2, dtype=torch.int64, device=dev),
                 torch.tensor([sigw.data_ptr()] * 2, dtype=torch.int64, device=dev), 0, 2)
    lslots = torch.zeros(2, 1, h, dtype=torch.int64, device=dev)
    lpush = Push(torch.tensor([lslots.data_ptr()] * 2, dtype=torch.int64, device=dev), sigw[1:2], 0, 2, ll=True)
    for name, fn in (("tree_add_norm_w2", lambda: tree_add_rms_norm(parts, res, nw, 1e-6, fold=False)),
                     ("tree_add_norm_fold_w2", lambda: tree_add_rms_norm(parts, res, nw, 1e-6, fold=True)),
                     ("tree_add_norm_ll_w2", lambda: tree_add_rms_norm_ll(lparts, res, nw, 1e-6, fold=False)),
                     ("tree_add_norm_ll_fold_w2", lambda: tree_add_rms_norm_ll(lparts, res, nw, 1e-6, fold=True)),
                     ("add_rms_norm", lambda: add_rms_norm_triton(res, summed, nw, 1e-6)),
                     ("tree_loop_down_tp2", lambda: gemv_tree_loop(xd, wd, 4, torch.float32, out=slots[0])),
                     ("tree_loop_down_tp2_push_count", lambda: gemv_tree_loop(xd, wd, 4, torch.float32, out=slots[0],
                                                                               push=cpush)),
                     ("tree_loop_down_tp2_push_ll", lambda: gemv_tree_loop(xd, wd, 4, torch.float32, out=lslots[0],
                                                                            push=lpush))):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(64):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            graph.replay()
        e1.record()
        e1.synchronize()
        t[name + "_us"] = e0.elapsed_time(e1) * 1e3 / (20 * 64)
    log("treenorm_time", rows=1, hidden=h, down_k_per_rank=k, **t)


def _tree(b: torch.Tensor) -> torch.Tensor:
    from specfire.kernels.splitk import tree_stack
    return tree_stack(b)
