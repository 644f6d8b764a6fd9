"""`specfire quantize SRC DST`: an HF Qwen3.5 checkpoint -> a specfire 4-bit checkpoint.

Projection weights (attention, Gated DeltaNet's in_proj_qkv / in_proj_z / out_proj, MLP, the MTP
head's, and the untied lm_head unless --keep-lm-head) become the 4-bit format of kernels/q4;
embeddings, norms, the conv1d taps, the per-head gate projections (in_proj_a / in_proj_b) and
anything whose K no group divides stay in bf16. The MTP head is included, from the checkpoint or
its mtp.safetensors sidecar. Tensor names keep the source's spelling, so the loader reads the
result like any checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import TYPE_CHECKING

from .config import Q4_DEFAULT_GROUP as DEFAULT_GROUP
from .errors import CheckpointError, SpecfireError

if TYPE_CHECKING:                 # torch loads with the work, not for `specfire quantize --help`
    from .model import loader

KEEP_DENSE = ("in_proj_a.weight", "in_proj_b.weight")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF checkpoint directory (safetensors)")
    p.add_argument("dst", help="output directory (created; must be empty if it exists)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP, help="inputs per scale/zero group (32..1024, "
                   "a power of two; smaller K fall back to the largest power of two >= 32 dividing K)")
    p.add_argument("--hadamard", action="store_true", help="rotate weights by a block Hadamard before rounding")
    p.add_argument("--keep-lm-head", action="store_true", help="leave the untied lm_head in bf16")
    p.add_argument("--device", default=None, help="device for the rounding work (default: cuda if available)")
    p.add_argument("--shard-size", type=float, default=4.0, help="GiB per output file")
    p.add_argument("--mtp-path", default=None, help="MTP head sidecar (default: in or beside SRC)")
    p.add_argument("--gates", action="store_true", help="also quantize the GDN gate projections in_proj_a / "
                   "in_proj_b (kept bf16 by default; 4-bit they join the layer's 4-bit input launch: 27B on an "
                   "H200 138.9 -> 142.8 tok/s, bundled-model perplexity +2.62%% instead of +2.49%%)")


def _quantizable(name: str, shape: tuple[int, ...], keep_lm_head: bool, gates: bool = False) -> bool:
    """A projection matrix: `*_proj`, the GDN input projections `in_proj_qkv` / `in_proj_z` (the
    largest of a GDN layer; they were missed while only `*_proj` names counted), the MTP `fc`, the
    untied lm_head; the per-head gate projections of KEEP_DENSE only with `gates`."""
    if len(shape) != 2 or (name.endswith(KEEP_DENSE) and not gates):
        return False
    if name == "lm_head.weight":
        return not keep_lm_head
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return module.endswith("_proj") or module.startswith("in_proj_") or module == "fc"


def _plan(srcs: list[tuple[loader.TensorSource, list[str]]], group: int, keep_lm_head: bool, gates: bool = False):
    """[(source, normalised name, raw name, group or None, output bytes)] in source order."""
    from .kernels.q4 import pick_group

    out = []
    for src, names in srcs:
        for n in names:
            shape = src.shape(n)
            g = pick_group(shape[1], group) if _quantizable(n, shape, keep_lm_head, gates) else None
            if g is not None:
                size = shape[0] * shape[1] // 2 + 4 * shape[0] * (shape[1] // g)
            else:
                size = 2 * math.prod(shape)
            out.append((src, n, src._raw[n], g, size))
    return out


def quantize_checkpoint(src_dir: str, dst_dir: str, group: int = DEFAULT_GROUP, hadamard: bool = False,
                        keep_lm_head: bool = False, device: str | None = None, shard_gib: float = 4.0,
                        mtp_path: str | None = None, log=None, gates: bool = False) -> dict:
    """Write the 4-bit checkpoint; returns a summary (tensors, bytes, mean weight error)."""
    import torch
    from safetensors.torch import save_file

    from .model import loader
    from .kernels.q4 import QuantWeight, quant_config, quantize_tensor

    if group < 32 or group > 1024 or group & (group - 1):
        raise ValueError(f"group_size must be a power of two in 32..1024, got {group}")
    if shard_gib <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_gib}")
    if os.path.abspath(src_dir) == os.path.abspath(dst_dir):
        raise SpecfireError("DST must differ from SRC")
    if os.path.exists(dst_dir) and os.listdir(dst_dir):
        raise SpecfireError(f"output directory {dst_dir} exists and is not empty")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg_path = os.path.join(src_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"no config.json in {src_dir}")
    with open(cfg_path, encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise CheckpointError(f"{src_dir} is already quantized ({config['quantization_config']})")
    src = loader.open_checkpoint(src_dir)
    srcs = [(src, [n for n in src.names()])]
    msrc = loader.mtp_source(src_dir, src, mtp_path)
    if msrc is not None and msrc is not src:
        srcs.append((msrc, [n for n in msrc.names() if n.startswith("mtp.")]))
    plan = _plan(srcs, group, keep_lm_head, gates)

    limit = int(shard_gib * 2 ** 30)
    shards: list[list[tuple]] = [[]]
    used = 0
    for item in plan:
        if shards[-1] and used + item[4] > limit:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += item[4]

    qcfg = quant_config(group, hadamard)
    meta = {"format": "pt", "quantization_config": json.dumps(qcfg)}
    os.makedirs(dst_dir, exist_ok=True)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    n_quant = 0
    bytes_in = bytes_out = 0
    err_sum = 0.0
    for fname, shard in zip(files, shards):
        tensors: dict[str, torch.Tensor] = {}
        for s, n, raw, g, size in shard:
            t = s.get(n)
            bytes_in += t.numel() * t.element_size()
            if g is None:
                out = {raw: t.to(torch.bfloat16) if t.is_floating_point() else t}
            else:
                w = t.to(dev, torch.float32)
                q, sc, z = quantize_tensor(w, g, hadamard)
                eff = QuantWeight.from_stored(q, sc, z, hadamard, device=dev).effective()
                err_sum += float((eff - w).norm() / w.norm().clamp_min(1e-30))
                n_quant += 1
                base = raw[:-len("weight")]
                out = {base + "qweight": q.cpu(), base + "scales": sc.cpu(), base + "zeros": z.cpu()}
            for k, v in out.items():
                tensors[k] = v.contiguous()
                weight_map[k] = fname
                bytes_out += v.numel() * v.element_size()
        save_file(tensors, os.path.join(dst_dir, fname), metadata=meta)
        if log:
            log(f"wrote {fname} ({len(tensors)} tensors)")
    if len(files) > 1:
        with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": bytes_out}, "weight_map": weight_map}, f, indent=1)

    config["quantization_config"] = qcfg
    with open(os.path.join(dst_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for entry in os.listdir(src_dir):  # tokenizer, generation config, chat template ...
        p = os.path.join(src_dir, entry)
        if (os.path.isfile(p) and not entry.endswith(".safetensors") and entry != "config.json"
                and entry != "model.safetensors.index.json"):
            shutil.copy2(p, os.path.join(dst_dir, entry))
    return {"tensors_quantized": n_quant, "tensors_total": len(plan), "bytes_in": bytes_in, "bytes_out": bytes_out,
            "mean_weight_rel_error": err_sum / max(n_quant, 1), "files": files, "quantization_config": qcfg}


def main(args: argparse.Namespace) -> int:
    s = quantize_checkpoint(args.src, args.dst, args.group_size, args.hadamard, args.keep_lm_head, args.device,
                            args.shard_size, args.mtp_path, log=lambda m: print(m, file=sys.stderr), gates=args.gates)
    gib = 2 ** 30
    print(f"quantized {s['tensors_quantized']} of {s['tensors_total']} tensors: {s['bytes_in'] / gib:.2f} GiB -> "
          f"{s['bytes_out'] / gib:.2f} GiB, mean weight relative error {s['mean_weight_rel_error']:.4f}; "
          f"wrote {args.dst}")
    return 0
