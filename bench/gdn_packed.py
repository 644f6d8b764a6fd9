"""The Gated DeltaNet core of a packed verify on the GPU: every sequence in one launch per layer
(kernels/gdn/fused.py gdn_rows_triton, as Qwen35Trunk.packed runs it) against one launch per
sequence and layer (what a lone verify launches), both replayed from CUDA graphs over every GDN
layer of the shape; and each sequence's output, log and window in one launch == alone, bit for bit.

    python -m bench.gdn_packed --shape 27B --rows 1,1,1,1,1,1,1,1 --rows 4,4,4,4,4,4,4,4 --rows 1,4,3,4
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_time, model_config
from specfire.config import FULL
from specfire.kernels.gdn import fused as gf


def _case(cfg, rows: list[int], dev: str) -> dict:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    n_l = sum(t != FULL for t in cfg.layer_types)
    c, total = 2 * hk * dk + hv * dv, sum(rows)
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    qkv, a, b = rnd(total, c), rnd(total, hv, scale=3.0), rnd(total, hv)
    z, w, a_log, dtb, nw = rnd(total, hv * dv), rnd(c, kk, scale=0.5), rnd(hv, scale=0.5), rnd(hv), 1 + rnd(dv, scale=0.2)

    def books():
        return [tuple(rnd(*sh, scale=0.3, dtype=torch.float32) for sh in (
            (n_l, hv, dk, dv), (n_l, kk - 1, c), (n_l, t, hv, dk), (n_l, t, hv, dv), (n_l, t, hv), (n_l, kk - 1 + t, c)))
            for t in rows]

    ends = [sum(rows[:i + 1]) for i in range(len(rows))]
    spans = [(e - r, e) for r, e in zip(rows, ends)]
    packed_bk = books()
    alone_bk = [tuple(x.clone() for x in bk) for bk in packed_bk]
    packed_tab = gf.seq_table(spans, packed_bk, qkv.device)
    alone_tabs = [gf.seq_table([(0, j - i)], [bk], qkv.device) for (i, j), bk in zip(spans, alone_bk)]
    args = (w, a_log, dtb, hk, dk, dv)

    def packed(layer=0):
        return gf.gdn_rows_triton(qkv, a, b, *args, packed_tab, layer, z, nw, 1e-6)

    def alone(layer=0):
        return torch.cat([gf.gdn_rows_triton(qkv[i:j], a[i:j], b[i:j], *args, tab, layer, z[i:j], nw, 1e-6)
                          for (i, j), tab in zip(spans, alone_tabs)])

    exact = all(torch.equal(packed(m), alone(m)) for m in range(n_l)) and all(
        torch.equal(x, y) for bp, ba in zip(packed_bk, alone_bk) for x, y in zip(bp, ba))
    t_packed = graph_time([lambda: [packed(m) for m in range(n_l)]], iters=5)
    t_alone = graph_time([lambda: [alone(m) for m in range(n_l)]], iters=5)
    return {"rows": rows, "gdn_layers": n_l, "exact": exact, "packed_ms": t_packed * 1e3, "alone_ms": t_alone * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27B", help="bench/common.py SHAPES")
    ap.add_argument("--rows", action="append", help="each sequence's verify rows, comma-separated (repeatable)")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gdn_packed: needs a CUDA GPU")
    cfg = model_config(ns.shape)
    out = [_case(cfg, [int(r) for r in spec.split(",")], "cuda") for spec in (ns.rows or ["1,1,1,1,1,1,1,1"])]
    print(f"{'rows':>24} {'exact':>6} {'one launch ms':>14} {'per sequence ms':>16}")
    for r in out:
        print(f"{','.join(map(str, r['rows'])):>24} {str(r['exact']):>6} {r['packed_ms']:>14.3f} {r['alone_ms']:>16.3f}")
    print(json.dumps({"bench": "gdn_packed", "shape": ns.shape, "results": out}))


if __name__ == "__main__":
    main()
