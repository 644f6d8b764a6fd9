"""End-to-end decode speed of the trunk on real Qwen3.5 shapes with random weights (GPU).

Prints a roofline card (bytes a decode step must move, the bandwidth-bound ceiling), then a table
of AR decode and k+1-row verify times, and one JSON line last.

    python -m bench.decode --shape 0.8B,4B,27B --graphs 1 --tokens 64
    python -m bench.decode --shape tiny --tokens 4      # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import CEILING, model_config, model_step_bytes, random_trunk, sync
from specfire.runtime.trunk import LocalTrunk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.8B")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--verify-rows", default="1,2,4")
    ap.add_argument("--graphs", default="0,1", help="eager (0) and/or CUDA graphs (1)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    rows_out = []
    gen = torch.Generator(device=dev).manual_seed(1)     # the same prompt and verify rows every run
    for shape, graphs in [(s, g) for s in args.shape.split(",") for g in args.graphs.split(",")]:
        graphs = graphs == "1" and dev == "cuda"
        cfg = model_config(shape)
        m = random_trunk(cfg, dev, dtype)
        trunk = LocalTrunk(m, args.prompt + args.tokens + 32, dtype, cuda_graphs=graphs)
        ids = torch.randint(0, cfg.vocab_size, (args.prompt,), device=dev, generator=gen)
        trunk.begin()
        sync(dev); t0 = time.perf_counter()
        rows = trunk.prefill(ids)
        sync(dev); t_prefill = time.perf_counter() - t0
        last = int(rows.logits[-1].argmax())
        pos = args.prompt
        for _ in range(3):  # warm-up
            r = trunk.verify(torch.tensor([last], device=dev), pos); trunk.commit(0)
            last = int(r.logits[0].argmax()); pos += 1
        sync(dev); t0 = time.perf_counter()
        for _ in range(args.tokens):
            r = trunk.verify(torch.tensor([last], device=dev), pos); trunk.commit(0)
            last = int(r.logits[0].argmax()); pos += 1
        sync(dev); dt = (time.perf_counter() - t0) / args.tokens
        nbytes = model_step_bytes(m, cfg, pos, dtype.itemsize)
        res = {"shape": shape, "graphs": graphs, "prefill_tok_s": args.prompt / t_prefill, "decode_ms": dt * 1e3,
               "decode_tok_s": 1 / dt, "step_bytes": nbytes, "ceiling_tok_s": CEILING / nbytes,
               "bw_frac": nbytes / dt / CEILING}
        for r_ in [int(x) for x in args.verify_rows.split(",")]:
            ids_r = torch.randint(0, cfg.vocab_size, (r_,), device=dev, generator=gen)
            trunk.verify(ids_r, pos); trunk.commit(0)
            sync(dev); t0 = time.perf_counter()
            for _ in range(8):
                trunk.verify(ids_r, pos); trunk.commit(0)
            sync(dev); res[f"verify{r_}_ms"] = (time.perf_counter() - t0) / 8 * 1e3
        rows_out.append(res)
        del trunk, m
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, dtype {dtype}, ceiling 4.17 TB/s")
    print(f"{'shape':>6} {'graph':>5} {'step MB':>9} {'ceil tok/s':>10} {'prefill tok/s':>13} {'decode ms':>9} {'tok/s':>7} {'BW %':>6}  verify ms by rows")
    for r in rows_out:
        vs = " ".join(f"{k[6:-3]}:{v:.2f}" for k, v in r.items() if k.startswith("verify"))
        print(f"{r['shape']:>6} {str(r['graphs']):>5} {r['step_bytes'] / 1e6:9.1f} {r['ceiling_tok_s']:10.1f} {r['prefill_tok_s']:13.1f} "
              f"{r['decode_ms']:9.2f} {r['decode_tok_s']:7.1f} {100 * r['bw_frac']:6.1f}  {vs}")
    print(json.dumps({"bench": "decode", "results": rows_out}))


if __name__ == "__main__":
    main()
