"""A packed verify's attention on the GPU: every sequence's rows in one launch per kernel
(kernels/attention/multi.py) against each sequence alone, bit for bit, eager and replayed from a
CUDA graph, 16-bit and Q8 caches; then the time of both forms of one layer's attention.

    python -m bench.attn_multi                   # 27B shape (24 / 4 heads, head_dim 256), 8 sequences
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from bench.common import capture, replay_time
from specfire.kernels import attention as A
from specfire.kernels.attention import fused as af
from specfire.kernels.attention.kernel import attention_rows_triton
from specfire.kernels.attention.multi import RowsPack
from specfire.kernels.small import rope_cos_sin


def _cache(q8: bool, n: int, hkv: int, d: int, gen) -> SimpleNamespace:
    k = torch.randn(n, hkv, d, device="cuda", generator=gen)
    v = torch.randn(n, hkv, d, device="cuda", generator=gen)
    if not q8:
        return SimpleNamespace(k=k.bfloat16(), v=v.bfloat16(), k_scale=None, v_scale=None)
    (kq, ks), (vq, vs) = A.quantize_q8(k), A.quantize_q8(v)
    vc = A.q8_value_cache(n, hkv, d, "cuda")
    vc.copy_(vq)
    return SimpleNamespace(k=kq, v=vc, k_scale=ks, v_scale=vs)


def check(q8: bool, rows: list[int], ctx: int, hq: int, hkv: int, d: int, r: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = ctx + 64
    spans = [(sum(rows[:i]), sum(rows[:i + 1])) for i in range(len(rows))]
    pos0s = [ctx - 7 * i - (i % 3) for i in range(len(rows))]           # odd, different positions
    lcs = [_cache(q8, n, hkv, d, gen) for _ in rows]
    t = sum(rows)
    qg = torch.randn(t, hq, 2 * d, device="cuda", generator=gen).bfloat16()
    kx = torch.randn(t, hkv, d, device="cuda", generator=gen).bfloat16()
    vx = torch.randn(t, hkv, d, device="cuda", generator=gen).bfloat16()
    qw = kw = (torch.randn(d, device="cuda", generator=gen) * 0.1).bfloat16()
    rots = [rope_cos_sin(torch.arange(p, p + b - a, device="cuda"), r, 1e7) for p, (a, b) in zip(pos0s, spans)]
    pos_t = [torch.tensor([p], device="cuda") for p in pos0s]
    f = lcs[0]

    def alone(pos):
        outs = []
        for (a, b), lc, p, cs in zip(spans, lcs, pos, rots):
            if q8:
                q = qg[a:b, :, :d].contiguous()
                A.kv_write(lc, p, kx[a:b], vx[a:b])
            else:
                q = af.qk_norm_rope_write_triton(qg[a:b], kx[a:b], vx[a:b], qw, kw, 1e-6, *cs, lc.k, lc.v, p)
            outs.append(attention_rows_triton(q, lc.k, lc.v, p, d ** -0.5, lc.k_scale, lc.v_scale))
        return torch.cat(outs)

    pack = RowsPack(spans, torch.device("cuda"))

    def packed(pos):
        pack.at(pos, list(rots))
        launch = pack.launch(lcs)
        if q8:
            q = qg[:, :, :d].contiguous()
            af.q8_write_multi_triton(kx, vx, lcs, launch)
        else:
            cos, sin, _ = pack.rotary
            q = af.qk_norm_rope_write_triton(qg, kx, vx, qw, kw, 1e-6, cos, sin, f.k, f.v, None, multi=launch)
        return attention_rows_triton(q, f.k, f.v, None, d ** -0.5, f.k_scale, f.v_scale, multi=launch)

    def kv():
        return [x.clone() for lc in lcs for x in (lc.k, lc.v, lc.k_scale, lc.v_scale) if x is not None]

    def restore(saved):
        for x, y in zip([x for lc in lcs for x in (lc.k, lc.v, lc.k_scale, lc.v_scale) if x is not None], saved):
            x.copy_(y)

    init = kv()
    want = alone(pos0s)
    want_kv = kv()
    restore(init)
    got = packed(pos0s)
    got_kv = kv()
    ga, out_a = capture(lambda: alone(pos_t))
    gp, out_p = capture(lambda: packed(pos_t))
    ga.replay()
    gp.replay()
    torch.cuda.synchronize()
    same = (torch.equal(got, want) and all(torch.equal(x, y) for x, y in zip(got_kv, want_kv))
            and torch.equal(out_a, want) and torch.equal(out_p, want))
    return {"cache": "q8" if q8 else "bf16", "rows": rows, "ctx": ctx, "bit_exact": same,
            "graph_ms_alone": round(1e3 * replay_time(ga, 50), 4), "graph_ms_packed": round(1e3 * replay_time(gp, 50), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,3,1,4,2,1,4", help="each sequence's verify rows")
    ap.add_argument("--ctx", type=int, default=1000, help="about where the sequences' rows sit")
    ap.add_argument("--heads", default="24,4,256,64", help="query heads, KV heads, head_dim, rotary dims")
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    hq, hkv, d, r = (int(x) for x in a.heads.split(","))
    res = [check(q8, rows, a.ctx, hq, hkv, d, r) for q8 in (False, True)]
    for x in res:
        print(json.dumps(x))
    if not all(x["bit_exact"] for x in res):
        raise SystemExit("packed attention differs from the sequences alone")


if __name__ == "__main__":
    main()
