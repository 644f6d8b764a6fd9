"""Kernel and collective stages of bench/tp.py (GPU): the canonical split-K kernel of the
row-parallel projections with 1, 2, 4 programs per output tile against the plain GEMV, the
grouped column launch against one launch per projection (every form checked bitwise), and a
decode step's collectives alone through symmetric memory."""
from __future__ import annotations

import json
import os

import torch

CEILING = 4.17e12     # measured device-to-device copy bandwidth of the H200 (bytes/s)

SPLITS = (1, 2, 4)     # programs sharing an output tile's chunks in the tree loop (same bits)


def row_parallel_shapes(cfg) -> dict[str, tuple[int, int]]:
    h = cfg.hidden_size
    return {"o_proj": (h, cfg.num_attention_heads * cfg.head_dim),
            "out_proj": (h, cfg.linear_num_value_heads * cfg.linear_value_head_dim),
            "down_proj": (h, cfg.intermediate_size)}


def column_groups(cfg) -> dict[str, list[int]]:
    """Column projections of one input that the model launches together (whole N of each)."""
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {"mlp gate+up": [cfg.intermediate_size] * 2,
            "gdn qkv+z+b+a": [cfg.conv_dim, vd, cfg.linear_num_value_heads, cfg.linear_num_value_heads],
            "attn q+k+v": [2 * cfg.num_attention_heads * cfg.head_dim, kv, kv]}


def stage_kernels(cfg, log, best_path: str | None = None, smoke: bool = False, dev: str = "cuda") -> None:
    """Row-parallel projections (tp1: K whole in 8 chunks; tp2: a rank's K/2 in 4), M = 1 and 4:
    the plain GEMV and the tree loop with 1, 2, 4 programs per output tile (bits vs the two-launch
    form). Column groups per degree: one launch each vs one grouped launch (bits vs each alone).
    Writes the faster bit-equal choices as environment variables for the later jobs."""
    from timing import graph_time

    from specfire.kernels.splitk import chunk_bounds
    from specfire.kernels.gemv.kernel import GemvConfig, gemv, gemv_config, gemv_group
    from specfire.kernels.splitk.fused import chunk_partials, tree_combine
    from specfire.kernels.splitk.loop import gemv_tree_loop

    def choose(env: dict) -> None:
        if best_path:
            with open(best_path, "w") as f:
                json.dump(env, f)
    choose({"SPECFIRE_SPLITK_SPLIT": "1", "SPECFIRE_GEMV_GROUP": "0"})   # until measured: the old forms
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    totals = {s: 0.0 for s in SPLITS}
    all_equal = {s: True for s in SPLITS}
    for name, (n, k_all) in row_parallel_shapes(cfg).items():
        for tp in (1, 2):
            k, c = k_all // tp, 8 // tp
            reps = max(2, min(20, (160 << 20) // (n * k * 2)))      # rotate weights beyond L2
            ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(reps)]
            b = torch.tensor(chunk_bounds(k_all)[:c + 1], dtype=torch.int32, device=dev)
            nbytes = n * k * 2
            for m in (1, 4):
                x = torch.randn(m, k, device=dev, dtype=dt)
                ref = tree_combine(chunk_partials(x, ws[0], b), dt)
                row = dict(proj=name, n=n, k=k, tp=tp, chunks=c, m=m)
                t = graph_time([lambda w=w: gemv(x, w) for w in ws])
                row["plain_us"], row["plain_bw"] = t * 1e6, nbytes / t / CEILING
                for s in SPLITS:
                    try:
                        eq = bool(torch.equal(gemv_tree_loop(x, ws[0], c, dt, split=s), ref))
                        t = graph_time([lambda w=w: gemv_tree_loop(x, w, c, dt, split=s) for w in ws])
                    except Exception as e:  # noqa: BLE001 - reported; that split is not chosen
                        log("error", where=f"tree loop split {s}", error=f"{type(e).__name__}: {e}"[:500])
                        eq, t = False, float("inf")
                    row[f"split{s}_us"], row[f"split{s}_bw"], row[f"split{s}_equal"] = t * 1e6, nbytes / t / CEILING, eq
                    all_equal[s] &= eq
                    if m == 1 and tp == 2:          # a tp2 step: each projection once per layer that has it
                        totals[s] += t * {"o_proj": cfg.n_full, "out_proj": cfg.n_linear,
                                          "down_proj": cfg.num_hidden_layers}[name]
                log("kernels", **row)
            del ws
    ok = {s: t for s, t in totals.items() if all_equal[s]}
    split = min(ok, key=ok.get) if ok else 1
    log("kernels", tree_split_tp2_step_us={str(s): t * 1e6 for s, t in totals.items()},
        tree_split_equal={str(s): v for s, v in all_equal.items()}, tree_split_pick=split)
    # column projections of one input: one launch each (their own settings, the old form) vs one
    # grouped launch; bits: a tp2 shard's grouped outputs == the whole matrices' grouped outputs
    h = cfg.hidden_size
    sep_total = grp_total = 0.0
    group_equal = True
    for gname, whole in column_groups(cfg).items():
        wholes = [torch.randn(n, h, device=dev, dtype=dt) * h ** -0.5 for n in whole]
        halves = [w[: -(-w.shape[0] // 2)].contiguous() for w in wholes]
        for m in (1, 4):
            x = torch.randn(m, h, device=dev, dtype=dt)
            try:
                full = gemv_group(x, wholes, list(whole))
                half = gemv_group(x, halves, list(whole))
                eq = all(torch.equal(a, b[:, :a.shape[1]]) for a, b in zip(half, full))
                old = all(torch.equal(a, gemv(x, w)) for a, w in zip(full, wholes))
            except Exception as e:  # noqa: BLE001 - reported; grouping is then not chosen
                log("error", where=f"gemv_group {gname}", error=f"{type(e).__name__}: {e}"[:500])
                eq = old = False
            group_equal &= eq
            log("kernels", column_group=gname, m=m, shard_equals_whole=eq, grouped_equals_own_settings=old)
        del wholes, halves
        for tp in (1, 2):
            shard = [-(-n // tp) for n in whole]
            nbytes = sum(shard) * h * 2
            reps = max(2, min(20, (160 << 20) // nbytes))
            sets = [[torch.randn(n, h, device=dev, dtype=dt) * h ** -0.5 for n in shard] for _ in range(reps)]
            x = torch.randn(1, h, device=dev, dtype=dt)
            t_sep = graph_time([lambda ws=ws: [gemv(x, w, launch_n=ln) for w, ln in zip(ws, whole)] for ws in sets])
            try:
                t_grp = graph_time([lambda ws=ws: gemv_group(x, ws, list(whole)) for ws in sets])
            except Exception as e:  # noqa: BLE001
                log("error", where=f"gemv_group time {gname}", error=f"{type(e).__name__}: {e}"[:500])
                t_grp = float("inf")
            layers = {"mlp": cfg.num_hidden_layers, "gdn": cfg.n_linear, "attn": cfg.n_full}[gname.split()[0]]
            if tp == 2:
                sep_total += t_sep * layers
                grp_total += t_grp * layers
            log("kernels", column_group=gname, tp=tp, m=1, rows=shard, k=h, separate_us=t_sep * 1e6,
                grouped_us=t_grp * 1e6, separate_bw=nbytes / t_sep / CEILING, grouped_bw=nbytes / t_grp / CEILING)
            del sets
    use_group = group_equal and grp_total <= sep_total
    log("kernels", column_groups_tp2_step_us=dict(separate=sep_total * 1e6, grouped=grp_total * 1e6),
        group_bits_equal=group_equal, group_pick=use_group)
    choose({"SPECFIRE_SPLITK_SPLIT": str(split), "SPECFIRE_GEMV_GROUP": "1" if use_group else "0"})
    # does BLOCK_K change an element's bits? (if not, projections with other BLOCK_K could share a launch)
    for n in (cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.num_key_value_heads * cfg.head_dim):
        w = torch.randn(n, h, device=dev, dtype=dt)
        base = gemv_config(n, h)
        for m in (1, 4):
            x = torch.randn(m, h, device=dev, dtype=dt)
            ys = {bk: gemv(x, w, cfg=GemvConfig(block_n=base.block_n, block_k=bk, num_warps=base.num_warps,
                                                num_stages=base.num_stages)) for bk in (64, 128, 256)}
            log("kernels", block_k_check_n=n, m=m, default_block_k=base.block_k,
                bk128_equals_bk256=bool(torch.equal(ys[128], ys[256])), bk64_equals_bk256=bool(torch.equal(ys[64], ys[256])))


# ---- a decode step's collectives alone ------------------------------------------------------------

def _collect_rank(rank: int, world: int, port: int, cfg_d: dict, q) -> None:
    import datetime

    import torch.distributed as dist

    from specfire.config import ModelConfig
    from specfire.parallel.symm import SymmCollectives

    from timing import graph_time

    cfg = ModelConfig(**cfg_d)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="nccl")
    dev = torch.device("cuda", rank)
    h = cfg.hidden_size
    vs = -(-cfg.vocab_size // world)
    sym = SymmCollectives(group, rank, world, dev, 4 * 16 * max(world * vs, world * h))
    out = {}
    for m in (1, 4):
        part = torch.randn(m, h, device=dev)
        emb = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        lg = torch.randn(m, vs, device=dev)
        ids = torch.arange(m, device=dev)

        def step():
            sym.share_ids(ids)
            sym.sum(emb)
            for _ in range(2 * cfg.num_hidden_layers):
                sym.tree(part)
            sym.all_gather(lg)

        t = graph_time([step], iters=5)
        one = graph_time([lambda: sym.tree(part)], iters=50)
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part, group=group)
        ok = torch.equal(sym.tree(part), parts[0] + parts[1])
        out[m] = dict(step_collectives_us=t * 1e6, tree_us=one * 1e6, n_calls=2 * cfg.num_hidden_layers + 3,
                      tree_equals_sum=bool(ok))
    dist.barrier(group)
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def stage_collect(cfg, log) -> None:
    import dataclasses
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29600 + os.getpid() % 300
    cfg_d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    procs = [ctx.Process(target=_collect_rank, args=(r, 2, port, cfg_d, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for m, r in out.items():
        log("collect", rows=m, **r)


def stage_prefill_heads(cfg, log, dev: str = "cuda") -> None:
    """Does a head's prefill attention depend on how many heads run with it? A tp2 rank runs half
    of the query and KV heads through the same call; the fused (SDPA) path may split the keys by a
    heuristic over heads x row blocks. Per (rows, keys): the first half of the heads of a whole-call
    output vs the same heads alone, bitwise (the long-context identity check of the fifth session
    differed between tp1 and tp2 at 8192 positions, equal at 512). Then the same for the GDN prefill."""
    from specfire.kernels.attention import attention_prefill
    from specfire.kernels.splitk import head_block

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(3)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    for rows, keys in ((512, 512), (1024, 1024), (1024, 8192), (1024, 33792)):
        q = torch.randn(rows, hq, d, generator=g, device=dev).to(dt)
        kc = torch.randn(keys, hkv, d, generator=g, device=dev).to(dt)
        vc = torch.randn(keys, hkv, d, generator=g, device=dev).to(dt)
        pos0 = keys - rows
        whole = attention_prefill(q, kc, vc, pos0, d ** -0.5)
        row = dict(rows=rows, keys=keys)
        for tp in (2, 4):
            if hq % tp or (hkv % tp and tp % hkv):
                continue
            hk = max(1, hkv // tp)
            part = attention_prefill(q[:, :hq // tp].contiguous(), kc[:, :hk].contiguous(), vc[:, :hk].contiguous(),
                                     pos0, d ** -0.5)
            row[f"tp{tp}_heads_equal"] = bool(torch.equal(part, whole[:, :hq // tp]))
            row[f"tp{tp}_max_diff"] = float((part - whole[:, :hq // tp]).abs().max())
            # the canonical form (fixed heads per call, what a mesh / canonical forward runs)
            cw = attention_prefill(q, kc, vc, pos0, d ** -0.5, q_block=head_block(hq))
            cp = attention_prefill(q[:, :hq // tp].contiguous(), kc[:, :hk].contiguous(), vc[:, :hk].contiguous(),
                                   pos0, d ** -0.5, q_block=head_block(hq))
            row[f"tp{tp}_canon_equal"] = bool(torch.equal(cp, cw[:, :hq // tp]))
        log("prefill_heads", **row)
        del q, kc, vc, whole
    _gdn_prefill_heads(cfg, log, dev, g)


def _gdn_prefill_heads(cfg, log, dev: str, g: torch.Generator) -> None:
    """The same question for the Gated DeltaNet chunked prefill (batched matmuls and triangular
    solves over heads x chunks, then the scan kernel): a rank's heads alone vs within all heads."""
    from specfire.kernels.gdn import gdn_chunked

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for rows in (512, 1024):
        q = torch.randn(rows, hk, dk, generator=g, device=dev) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(rows, hk, dk, generator=g, device=dev), dim=-1)
        v = torch.randn(rows, hv, dv, generator=g, device=dev)
        gate = -torch.rand(rows, hv, generator=g, device=dev) * 0.1
        beta = torch.rand(rows, hv, generator=g, device=dev)
        state = torch.randn(hv, dk, dv, generator=g, device=dev) * 0.1
        o, st = gdn_chunked(q, k, v, gate, beta, state)
        row = dict(rows=rows, heads=hv)
        for tp in (2, 4):
            if hk % tp or hv % tp:
                continue
            a, b = hk // tp, hv // tp
            o2, st2 = gdn_chunked(q[:, :a].contiguous(), k[:, :a].contiguous(), v[:, :b].contiguous(),
                                  gate[:, :b].contiguous(), beta[:, :b].contiguous(), state[:b].contiguous())
            row[f"tp{tp}_out_equal"] = bool(torch.equal(o2, o[:, :b]))
            row[f"tp{tp}_state_equal"] = bool(torch.equal(st2, st[:b]))
            row[f"tp{tp}_max_diff"] = float((o2 - o[:, :b]).abs().max())
            cw, cws = gdn_chunked(q, k, v, gate, beta, state, canonical=True)   # what a mesh runs
            cp, cps = gdn_chunked(q[:, :a].contiguous(), k[:, :a].contiguous(), v[:, :b].contiguous(),
                                  gate[:, :b].contiguous(), beta[:, :b].contiguous(), state[:b].contiguous(),
                                  canonical=True)
            row[f"tp{tp}_canon_equal"] = bool(torch.equal(cp, cw[:, :b]) and torch.equal(cps, cws[:b]))
        log("prefill_gdn_heads", **row)
