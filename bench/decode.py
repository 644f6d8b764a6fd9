"""End-to-end decode speed of the trunk on real Qwen3.5 shapes with random weights (GPU).

Prints a roofline card (bytes a decode step must move, the bandwidth-bound ceiling), then a table
of AR decode and k+1-row verify times, and one JSON line last.

    python bench/decode.py --shape 0.8B,4B --tokens 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specfire.config import ModelConfig
from specfire.model.qwen35 import Qwen35Trunk
from specfire.runtime.trunk import LocalTrunk

CEILING = 4.17e12  # measured device-to-device copy bandwidth of the H200 (bytes/s)

SHAPES = {
    "0.8B": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True),
    "9B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    "27B": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False),
}


def make_cfg(name: str) -> ModelConfig:
    s = dict(SHAPES[name])
    n = s["num_hidden_layers"]
    return ModelConfig(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                       layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)),
                       **s)


def build(cfg: ModelConfig, device: str, dtype: torch.dtype) -> Qwen35Trunk:
    with torch.device("meta"):
        m = Qwen35Trunk(cfg)
    m = m.to(dtype).to_empty(device=device)   # allocate directly in the target dtype
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dtype) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dtype) * p.shape[-1] ** -0.5)
    return m


def step_bytes(m: Qwen35Trunk, ctx: int, kv_bytes: int) -> int:
    """Bytes one decode step must move: every weight once (one embedding row), KV up to ctx, GDN
    state read and written."""
    cfg = m.cfg
    w = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "embed_tokens.weight")
    if m.lm_head is None:
        w += m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()
    kv = cfg.n_full * 2 * ctx * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    st = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return w + kv + st


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
        cfg = make_cfg(shape)
        m = build(cfg, dev, dtype)
        trunk = LocalTrunk(m, args.prompt + args.tokens + 32, dtype, cuda_graphs=graphs)
        ids = torch.randint(0, cfg.vocab_size, (args.prompt,), device=dev, generator=gen)
        trunk.begin()
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync(); t0 = time.perf_counter()
        rows = trunk.prefill(ids)
        sync(); t_prefill = time.perf_counter() - t0
        last = int(rows.logits[-1].argmax())
        pos = args.prompt
        for _ in range(3):  # warm-up
            r = trunk.verify(torch.tensor([last], device=dev), pos); trunk.commit(0)
            last = int(r.logits[0].argmax()); pos += 1
        sync(); t0 = time.perf_counter()
        for _ in range(args.tokens):
            r = trunk.verify(torch.tensor([last], device=dev), pos); trunk.commit(0)
            last = int(r.logits[0].argmax()); pos += 1
        sync(); dt = (time.perf_counter() - t0) / args.tokens
        nbytes = step_bytes(m, pos, torch.tensor([], dtype=dtype).element_size())
        res = {"shape": shape, "graphs": graphs, "prefill_tok_s": args.prompt / t_prefill, "decode_ms": dt * 1e3,
               "decode_tok_s": 1 / dt, "step_bytes": nbytes, "ceiling_tok_s": CEILING / nbytes,
               "bw_frac": nbytes / dt / CEILING}
        for r_ in [int(x) for x in args.verify_rows.split(",")]:
            ids_r = torch.randint(0, cfg.vocab_size, (r_,), device=dev, generator=gen)
            trunk.verify(ids_r, pos); trunk.commit(0)
            sync(); t0 = time.perf_counter()
            for _ in range(8):
                trunk.verify(ids_r, pos); trunk.commit(0)
            sync(); res[f"verify{r_}_ms"] = (time.perf_counter() - t0) / 8 * 1e3
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
