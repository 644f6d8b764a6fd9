"""Paged KV on the GPU: the attention rows kernels, the fused q/k write, the Q8 rows write and the
prefill gather over a pool's scattered blocks (kernels/attention/paged.py) against the contiguous
cache holding the same rows, bit for bit, eager and replayed from a CUDA graph (positions on the
device), bf16 and Q8 caches; then the graph replay time of one layer's decode / verify attention
in both layouts (what paging costs).

    python -m bench.attn_paged                          # 27B shape (24 / 4 heads, head_dim 256)
    python -m bench.attn_paged --ctx 1000,8000,32000 --rows 1,4
"""
from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import torch

from bench.common import capture, replay_time
from specfire.kernels import attention as A
from specfire.kernels.attention import fused as af
from specfire.kernels.attention.kernel import attention_rows_triton
from specfire.kernels.attention.paged import BLOCK, gather, rows_of
from specfire.kernels.small import rope_cos_sin


def _caches(q8: bool, n: int, hkv: int, d: int, gen):
    """(contiguous cache of n positions, the same rows in a pool of twice the blocks, scattered)."""
    k = torch.randn(n, hkv, d, device="cuda", generator=gen)
    v = torch.randn(n, hkv, d, device="cuda", generator=gen)
    nb = -(-n // BLOCK)
    pool_blocks = 2 * nb + 1
    ids = (torch.randperm(pool_blocks - 1, device="cuda", generator=gen)[:nb] + 1).to(torch.int32)
    if q8:
        (kq, ks), (vq, vs) = A.quantize_q8(k), A.quantize_q8(v)
        vc = A.q8_value_cache(n, hkv, d, "cuda")
        vc.copy_(vq)
        cont = SimpleNamespace(k=kq, v=vc, k_scale=ks, v_scale=vs, blocks=None)
        pool = SimpleNamespace(
            k=torch.zeros(pool_blocks * BLOCK, hkv, d, device="cuda", dtype=A.Q8_KV),
            v=torch.zeros(hkv, d, pool_blocks * BLOCK, device="cuda", dtype=A.Q8_KV).permute(2, 0, 1),
            k_scale=torch.zeros(pool_blocks * BLOCK, hkv, 1, device="cuda", dtype=torch.float16),
            v_scale=torch.zeros(pool_blocks * BLOCK, hkv, 1, device="cuda", dtype=torch.float16), blocks=ids)
    else:
        cont = SimpleNamespace(k=k.bfloat16(), v=v.bfloat16(), k_scale=None, v_scale=None, blocks=None)
        pool = SimpleNamespace(k=torch.zeros(pool_blocks * BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16),
                               v=torch.zeros(pool_blocks * BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16),
                               k_scale=None, v_scale=None, blocks=ids)
    rows = rows_of(ids, 0, n)
    for f in ("k", "v", "k_scale", "v_scale"):
        if getattr(cont, f) is not None:
            getattr(pool, f).index_copy_(0, rows, getattr(cont, f))
    return cont, pool


def _parts(lc):
    return [x for x in (lc.k, lc.v, lc.k_scale, lc.v_scale) if x is not None]


def check(q8: bool, ctx: int, rows: int, hq: int, hkv: int, d: int, r: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(ctx + rows)
    n = ctx + 64
    pos0 = ctx - 3                                   # odd; rows reach past a block bound at some contexts
    cont, pool = _caches(q8, n, hkv, d, gen)
    qg = torch.randn(rows, hq, 2 * d, device="cuda", generator=gen).bfloat16()
    kx = torch.randn(rows, hkv, d, device="cuda", generator=gen).bfloat16()
    vx = torch.randn(rows, hkv, d, device="cuda", generator=gen).bfloat16()
    qw = kw = (torch.randn(d, device="cuda", generator=gen) * 0.1).bfloat16()
    cs = rope_cos_sin(torch.arange(pos0, pos0 + rows, device="cuda"), r, 1e7)
    pos_t = torch.tensor([pos0], device="cuda")

    def step(lc, pos):
        if q8:
            q = qg[:, :, :d].contiguous()
            A.kv_write(lc, pos, kx, vx)
        else:
            q = af.qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, *cs, lc.k, lc.v, pos, blocks=lc.blocks)
        return attention_rows_triton(q, lc.k, lc.v, pos, d ** -0.5, lc.k_scale, lc.v_scale, blocks=lc.blocks)

    want, got = step(cont, pos0), step(pool, pos0)
    same = torch.equal(got, want) and all(torch.equal(gather(x, pool.blocks, n), y)
                                          for x, y in zip(_parts(pool), _parts(cont)))
    gc, out_c = capture(lambda: step(cont, pos_t))
    gp, out_p = capture(lambda: step(pool, pos_t))
    gc.replay()
    gp.replay()
    torch.cuda.synchronize()
    same = same and torch.equal(out_c, want) and torch.equal(out_p, want)
    # prefill over the gathered rows (SDPA on CUDA for bf16, the reference for Q8)
    t = min(512, pos0)
    qp = torch.randn(t, hq, d, device="cuda", generator=gen).bfloat16()
    p0 = pos0 - t
    pre_c = A.attention_prefill(qp, cont.k, cont.v, p0, d ** -0.5, cont.k_scale, cont.v_scale)
    pre_p = A.attention_prefill(qp, pool.k, pool.v, p0, d ** -0.5, pool.k_scale, pool.v_scale, blocks=pool.blocks)
    same = same and torch.equal(pre_c, pre_p)
    mc, mp = 1e3 * replay_time(gc, 100), 1e3 * replay_time(gp, 100)
    return {"cache": "q8" if q8 else "bf16", "ctx": ctx, "rows": rows, "bit_exact": same,
            "graph_ms_contiguous": round(mc, 4), "graph_ms_paged": round(mp, 4),
            "paged_over_contiguous": round(mp / mc, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="1000,8000,32000", help="contexts (positions before the rows)")
    ap.add_argument("--rows", default="1,4", help="rows per step (1: AR decode; k+1: a verify)")
    ap.add_argument("--heads", default="24,4,256,64", help="query heads, KV heads, head_dim, rotary dims")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON records")
    a = ap.parse_args()
    hq, hkv, d, r = (int(x) for x in a.heads.split(","))
    res = []
    print(f"{'cache':>5} {'ctx':>6} {'rows':>4} {'exact':>5} {'contig ms':>10} {'paged ms':>9} {'ratio':>6}")
    for q8 in (False, True):
        for ctx in (int(x) for x in a.ctx.split(",")):
            for rows in (int(x) for x in a.rows.split(",")):
                x = check(q8, ctx, rows, hq, hkv, d, r)
                res.append(x)
                print(f"{x['cache']:>5} {ctx:>6} {rows:>4} {str(x['bit_exact']):>5} {x['graph_ms_contiguous']:>10} "
                      f"{x['graph_ms_paged']:>9} {x['paged_over_contiguous']:>6}", flush=True)
                if a.out:
                    os.makedirs(a.out, exist_ok=True)
                    with open(os.path.join(a.out, "attn_paged.jsonl"), "a") as f:
                        f.write(json.dumps(x) + "\n")
    print(json.dumps({"bench": "attn_paged", "results": res}))
    if not all(x["bit_exact"] for x in res):
        raise SystemExit("paged attention differs from the contiguous cache")


if __name__ == "__main__":
    main()
