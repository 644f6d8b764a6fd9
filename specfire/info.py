"""`specfire info`: what a checkpoint is, without loading its weights."""
from __future__ import annotations

import os
from typing import Any

from .config import FULL, GenerationDefaults, ModelConfig
from .parallel.shard import valid_tp_degrees
from .errors import CheckpointError
from .model import loader


def describe(path: str | None) -> dict[str, Any]:
    from .api import BUNDLED_MODEL

    path = os.path.abspath(path) if path else BUNDLED_MODEL
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path} is not a directory" if path != BUNDLED_MODEL else
                              f"the bundled model is missing from {path}; pass a checkpoint path")
    cfg = ModelConfig.from_dir(path)
    gen = GenerationDefaults.from_dir(path)
    src = loader.open_checkpoint(path)
    trunk = [n for n in src.names() if not n.startswith("mtp.")]
    n_params = 0
    for n in trunk:
        s = 1
        for d in src.shape(n):
            s *= d
        n_params += s
    msrc = loader.mtp_source(path, src)
    mtp_params = 0
    if msrc is not None:
        for n in msrc.names():
            if n.startswith("mtp."):
                s = 1
                for d in msrc.shape(n):
                    s *= d
                mtp_params += s
    memory = {"float32": 4 * (n_params + mtp_params), "bfloat16": 2 * (n_params + mtp_params)}
    if os.path.exists(os.path.join(path, "config.json")) and _quantized(path):
        # a 4-bit checkpoint loads as stored: packed codes, scales and zeros, bf16 for the rest
        memory = {"as stored (4-bit)": src.stored_bytes() + (msrc.stored_bytes() if msrc not in (None, src) else 0)}
        quant = _quant_summary(path, src, msrc, memory["as stored (4-bit)"], n_params + mtp_params)
    else:
        quant = None
    kv_per_token = cfg.n_full * 2 * cfg.num_key_value_heads * cfg.head_dim   # elements, K and V
    # the engine refuses tp > 1 for a checkpoint with any 4-bit tensor (the mesh loads dense weights)
    packed = any(src.is_quantized(n) for n in src.names())
    degrees = [1] if packed else valid_tp_degrees(cfg)
    return {
        "path": path, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
        "gated_deltanet_layers": cfg.n_linear, "full_attention_layers": cfg.n_full,
        "layer_types": ["A" if t == FULL else "L" for t in cfg.layer_types],
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "attention": {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                      "head_dim": cfg.head_dim, "rotary_dim": cfg.rotary_dim},
        "gated_deltanet": {"key_heads": cfg.linear_num_key_heads, "value_heads": cfg.linear_num_value_heads,
                           "key_dim": cfg.linear_key_head_dim, "value_dim": cfg.linear_value_head_dim,
                           "conv_kernel": cfg.linear_conv_kernel_dim},
        "tied_embeddings": "lm_head.weight" not in src,
        "parameters": n_params, "mtp_head": msrc is not None, "mtp_parameters": mtp_params,
        "memory_bytes": memory,
        "quantization": quant,
        # per sequence: attention KV rows grow with the context, the GDN state does not
        "kv_bytes_per_token": {"float32": 4 * kv_per_token, "bfloat16": 2 * kv_per_token},
        "recurrent_state_bytes": 4 * cfg.n_linear * (
            cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim),
        "tp_degrees": degrees, "tp_note": "4-bit checkpoints load with tp=1 only" if packed else None,
        # the default sampling the checkpoint's generation_config.json sets (--generation-config auto)
        "sampling_defaults": gen.as_dict(), "sampling_notes": list(gen.notes),
    }


def _quantized(path: str) -> bool:
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return "quantization_config" in json.load(f)


def _quant_summary(path: str, src, msrc, stored: int, params: int) -> dict[str, Any]:
    """Bits per weight of a 4-bit checkpoint: over its quantized tensors (4-bit codes plus a bf16
    scale and zero per group) and over every parameter as stored; the MTP head's share apart."""
    import json

    from .kernels.q4 import pick_group

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f)["quantization_config"]
    tot = {"trunk": [0, 0], "mtp": [0, 0]}  # weights, bits
    for s in {id(x): x for x in (src, msrc) if x is not None}.values():
        for n in s.names():
            if not s.is_quantized(n):
                continue
            rows, k = s.shape(n)
            g = pick_group(k, qc["group_size"]) or k
            part = tot["mtp" if n.startswith("mtp.") else "trunk"]
            part[0] += rows * k
            part[1] += rows * k * 4 + rows * (k // g) * 32
    w = tot["trunk"][0] + tot["mtp"][0]
    return {"method": qc.get("quant_method"), "group_size": qc["group_size"], "hadamard": qc.get("hadamard", False),
            "quantized_weights": w, "bits_per_weight": (tot["trunk"][1] + tot["mtp"][1]) / max(w, 1),
            "mtp_quantized_weights": tot["mtp"][0],
            "mtp_bits_per_weight": tot["mtp"][1] / tot["mtp"][0] if tot["mtp"][0] else None,
            "bits_per_parameter": 8 * stored / max(params, 1)}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_info(d: dict[str, Any]) -> str:
    a, g = d["attention"], d["gated_deltanet"]
    lines = [
        f"model        {d['path']} ({d['model_type']})",
        f"layers       {d['layers']}: {d['gated_deltanet_layers']} Gated DeltaNet + {d['full_attention_layers']} "
        f"full attention  [{''.join(d['layer_types'])}]",
        f"hidden       {d['hidden_size']}, MLP {d['intermediate_size']}, vocab {d['vocab_size']}, "
        f"{'tied' if d['tied_embeddings'] else 'untied'} lm_head",
        f"attention    {a['heads']} q heads / {a['kv_heads']} kv heads x {a['head_dim']} (rotary {a['rotary_dim']})",
        f"deltanet     {g['key_heads']} key heads x {g['key_dim']}, {g['value_heads']} value heads x {g['value_dim']}, "
        f"conv {g['conv_kernel']}",
        f"parameters   {d['parameters'] / 1e6:.2f} M trunk" +
        (f" + {d['mtp_parameters'] / 1e6:.2f} M MTP head" if d["mtp_head"] else " (no MTP head)"),
        "weights      " + ", ".join(f"{k} {_size(v)}" for k, v in d["memory_bytes"].items()),
    ]
    q = d.get("quantization")
    if q:  # 4-bit checkpoints: bits per weight (quantized tensors) and per parameter (everything stored)
        lines.append(f"quantized    {q['method']} group {q['group_size']}{' + Hadamard' if q['hadamard'] else ''}: "
                     f"{q['bits_per_weight']:.3f} bits/weight on {q['quantized_weights'] / 1e6:.2f} M weights"
                     + (f" (MTP head {q['mtp_bits_per_weight']:.3f})" if q["mtp_bits_per_weight"] else " (MTP head dense)")
                     + f"; {q['bits_per_parameter']:.2f} bits/parameter as stored")
    lines += [
        "kv cache     " + ", ".join(f"{k} {_size(v)}" for k, v in d["kv_bytes_per_token"].items()) +
        f" per token; Gated DeltaNet state {_size(d['recurrent_state_bytes'])} per sequence (float32)",
        f"tp degrees   {', '.join(map(str, d['tp_degrees']))}" + (f" ({d['tp_note']})" if d.get("tp_note") else ""),
        "sampling     " + (("defaults from generation_config.json: " + ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in d["sampling_defaults"].items())
            + "".join(f"; {n}" for n in d["sampling_notes"])
            + " (--generation-config none: built-in defaults)")
            if d.get("sampling_defaults") else "built-in defaults (generation_config.json sets none)"),
    ]
    return "\n".join(lines)
