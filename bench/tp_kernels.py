"""Kernel and collective stages of bench/tp.py (GPU): the canonical split-K kernels of the
row-parallel projections against the plain GEMV, a launch-settings sweep of the tree loop
(every setting checked bitwise against the two-launch form), and a decode step's collectives
alone through symmetric memory."""
from __future__ import annotations

import os

import torch

CEILING = 4.17e12     # measured device-to-device copy bandwidth of the H200 (bytes/s)

# tree-loop launch settings tried: (block_n, num_warps, num_stages, select)
LOOP_SWEEP = [(64, 4, 4, 0), (64, 4, 4, 1), (32, 4, 4, 1), (32, 4, 6, 1), (16, 4, 4, 1), (16, 4, 6, 1),
              (16, 2, 6, 1), (32, 8, 4, 1), (64, 8, 4, 1)]


def row_parallel_shapes(cfg) -> dict[str, tuple[int, int]]:
    h = cfg.hidden_size
    return {"o_proj": (h, cfg.num_attention_heads * cfg.head_dim),
            "out_proj": (h, cfg.linear_num_value_heads * cfg.linear_value_head_dim),
            "down_proj": (h, cfg.intermediate_size)}


def stage_kernels(cfg, log, best_path: str | None = None, smoke: bool = False, dev: str = "cuda") -> None:
    """Per row-parallel projection and degree (tp1: K whole in 8 chunks; tp2: a rank's K/2 in 4),
    M = 1: plain GEMV, the fused split-K kernel, the tree loop in each swept setting (bits vs the
    two-launch form, time). Then M = 4 for the default and the best setting. Column shards: the
    plain GEMV with a smaller BLOCK_N vs the default, bitwise (a shard could then use more
    programs and still give the whole's bits)."""
    from timing import graph_time

    from specfire.ops.splitk import chunk_bounds
    from specfire.ops.triton_gemv import GemvConfig, gemv, gemv_config
    from specfire.ops.triton_splitk import chunk_partials, gemv_chunks_fused, gemv_tree_loop, tree_combine

    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    best: dict[tuple, tuple[float, tuple]] = {}
    times: dict[tuple, dict[tuple, float]] = {}          # setting -> (proj, tp) -> seconds at M = 1 (inf: bits differ)
    fused_total = 0.0
    sweep = LOOP_SWEEP[:3] if smoke else LOOP_SWEEP
    for name, (n, k_all) in row_parallel_shapes(cfg).items():
        for tp in (1, 2):
            k, c = k_all // tp, 8 // tp
            reps = max(2, (160 << 20) // (n * k * 2))               # rotate weights beyond L2
            ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(reps)]
            b = torch.tensor(chunk_bounds(k_all)[:c + 1], dtype=torch.int32, device=dev)
            nbytes = n * k * 2
            for m in (1, 4):
                x = torch.randn(m, k, device=dev, dtype=dt)
                ref = tree_combine(chunk_partials(x, ws[0], b), dt)
                row = dict(proj=name, n=n, k=k, tp=tp, chunks=c, m=m)
                t = graph_time([lambda w=w: gemv(x, w) for w in ws])
                row["plain_us"], row["plain_bw"] = t * 1e6, nbytes / t / CEILING
                t = graph_time([lambda w=w: gemv_chunks_fused(x, w, b, dt) for w in ws])
                row["fused_us"], row["fused_equal"] = t * 1e6, bool(torch.equal(gemv_chunks_fused(x, ws[0], b, dt), ref))
                if m == 1:
                    fused_total += t
                for s in (sweep if m == 1 else [LOOP_SWEEP[0]] + ([best[(name, tp)][1]] if (name, tp) in best else [])):
                    g = GemvConfig(block_n=s[0], block_k=128, num_warps=s[1], num_stages=s[2])
                    try:
                        got = gemv_tree_loop(x, ws[0], c, dt, cfg=g, select=bool(s[3]))
                        eq = bool(torch.equal(got, ref))
                        t = graph_time([lambda w=w: gemv_tree_loop(x, w, c, dt, cfg=g, select=bool(s[3])) for w in ws])
                    except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported
                        log("error", where=f"tree loop {s}", error=f"{type(e).__name__}: {e}"[:500])
                        continue
                    key = "loop_" + "_".join(map(str, s))
                    row[key + "_us"], row[key + "_equal"] = t * 1e6, eq
                    if m == 1:
                        times.setdefault(s, {})[(name, tp)] = t if eq else float("inf")
                    if m == 1 and eq and ((name, tp) not in best or t < best[(name, tp)][0]):
                        best[(name, tp)] = (t, s)
                if m == 1 and (name, tp) in best:
                    t, s = best[(name, tp)]
                    row["best_loop"], row["best_loop_us"], row["best_loop_bw"] = list(s), t * 1e6, nbytes / t / CEILING
                log("kernels", **row)
            del ws
    log("kernels", best_per_shape={f"{a}/tp{b}": list(s) for (a, b), (_, s) in best.items()})
    # one setting for every shape: the least total M = 1 time, bits equal everywhere
    n_shapes = len(row_parallel_shapes(cfg)) * 2
    totals = {s: sum(v.values()) for s, v in times.items() if len(v) == n_shapes}
    if totals:
        s, t = min(totals.items(), key=lambda kv: kv[1])
        pick = dict(setting=list(s), loop_total_us=t * 1e6, fused_total_us=fused_total * 1e6,
                    default_loop_total_us=totals.get(LOOP_SWEEP[0], float("inf")) * 1e6, use_loop=t < fused_total)
        log("kernels", global_best=pick)
        if best_path and t < float("inf"):
            import json
            env = ({"SPECFIRE_SPLITK_KERNEL": "loop", "SPECFIRE_SPLITK_LOOP": ",".join(map(str, s))} if pick["use_loop"]
                   else {"SPECFIRE_SPLITK_KERNEL": "fused"})
            with open(best_path, "w") as f:
                json.dump(env, f)
    # column shards: a smaller BLOCK_N, the same bits? (then a shard may use more programs)
    h = cfg.hidden_size
    for n in (cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.intermediate_size):
        w = torch.randn(n, h, device=dev, dtype=dt)
        for m in (1, 4):
            x = torch.randn(m, h, device=dev, dtype=dt)
            whole = gemv(x, w)
            row = dict(column_n=n, k=h, m=m, default_us=graph_time([lambda: gemv(x, w)]) * 1e6)
            for bn in (16, 32):
                base = gemv_config(n, h)
                g = GemvConfig(block_n=bn, block_k=base.block_k, num_warps=base.num_warps, num_stages=base.num_stages)
                row[f"bn{bn}_equal_default"] = bool(torch.equal(gemv(x, w, cfg=g), whole))
                half = w[: n // 2].contiguous()
                row[f"half_shard_bn{bn}_us"] = graph_time([lambda: gemv(x, half, cfg=g)]) * 1e6
            half = w[: n // 2].contiguous()
            row["half_shard_default_us"] = graph_time([lambda: gemv(x, half, launch_n=n)]) * 1e6
            log("kernels", **row)


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
