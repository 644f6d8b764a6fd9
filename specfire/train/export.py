"""Write a trained trunk + MTP head as an HF-layout Qwen3.5 text checkpoint (and read one back for
further training or evaluation: `load_checkpoint`).

config.json (qwen3_5_text, mtp_num_hidden_layers=1), model.safetensors with the trunk under
`model.` and the head under `mtp.` (sharded with model.safetensors.index.json when larger than
`max_shard_bytes`), generation_config.json; the tokenizer files are written by tok.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..model.qwen35 import MtpHead, Qwen35Trunk


def checkpoint_tensors(trunk: Qwen35Trunk, head: MtpHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trunk.named_parameters():
        key = name if name == "lm_head.weight" else "model." + name
        out[key] = p.detach().to("cpu", dtype).contiguous()
    for name, p in head.named_parameters():
        out["mtp." + name] = p.detach().to("cpu", dtype).contiguous()
    return out


def export_checkpoint(trunk: Qwen35Trunk, head: MtpHead, out_dir: str, eos_ids: list[int],
                      dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 15 << 20,
                      extra_config: dict | None = None) -> list[str]:
    """Save weights + config.json + generation_config.json; returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    cfg: ModelConfig = replace(trunk.cfg, mtp_num_hidden_layers=1, eos_token_ids=tuple(eos_ids))
    tensors = checkpoint_tensors(trunk, head, dtype)
    written = []
    # ---- weights (shards fill in name order; mtp.* sorts last) --------------------------------
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=lambda n: (n.startswith("mtp."), n)):
        nb = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nb
    for f in os.listdir(out_dir):
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(out_dir, f))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        written.append("model.safetensors")
    else:
        weight_map = {}
        for i, sh in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, os.path.join(out_dir, fn), metadata={"format": "pt"})
            written.append(fn)
            weight_map.update({n: fn for n in sh})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        written.append("model.safetensors.index.json")
    # ---- configs ---------------------------------------------------------------------------------
    body = cfg.to_hf_text_dict()
    body["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
    body["full_attention_interval"] = _interval(cfg)
    body["attn_output_gate"] = True
    body["pad_token_id"] = eos_ids[0] if eos_ids else None
    body.update(extra_config or {})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(body, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(eos_ids), "pad_token_id": eos_ids[0] if eos_ids else None,
                   "do_sample": False}, f, indent=2)
    return written + ["config.json", "generation_config.json"]


def load_checkpoint(path: str, device: torch.device | str, trainable: bool = False):
    """(ModelConfig, trunk, MTP head) of a checkpoint in float32, through the inference loader."""
    from ..model import loader

    device = torch.device(device)
    src = loader.open_checkpoint(path)
    cfg = loader.follow_tied(src, ModelConfig.from_dir(path))
    trunk = loader.load_trunk(src, cfg, dtype=torch.float32, device=device)
    head = loader.load_mtp_head(path, src, cfg, torch.float32, device, "must")
    for m in (trunk, head):
        for p in m.parameters():
            p.requires_grad_(trainable)
    return cfg, trunk, head


def _interval(cfg: ModelConfig) -> int:
    from ..config import FULL

    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    return full[0] + 1 if full else cfg.num_hidden_layers


def write_attribution(packages, out_dir: str) -> str:
    """ATTRIBUTION.md beside the weights: every distribution the corpus was drawn from (name, version,
    licence as its metadata states it, files and bytes used), the ones held out, and the ones refused."""
    rows = {"train": [], "held_out": [], "refused": []}
    for p in packages:
        rows[p.role].append(p)
    lines = ["# Attribution: the sources this model was trained on", "",
             "The bundled model was trained on Python source files of the packages below, each used under",
             "its own permissive licence (as stated by the package's metadata: PEP 639 License-Expression,",
             "License field, classifiers or licence file). The copyright in those files stays with their",
             "authors; see each package's licence for its terms. Files in vendored third-party directories,",
             "generated or data-like files and near-duplicate copies were left out.", "",
             "| package | version | licence (from metadata) | files used | MB used |", "|---|---|---|---|---|"]
    for p in rows["train"]:
        if p.files:
            lines.append(f"| {p.name} | {p.version} | {p.licence} | {p.files} | {p.bytes / 1e6:.2f} |")
    lines += ["", "Held out of training (whole packages, used only to measure the model):", "",
              "| package | version | licence | files | MB |", "|---|---|---|---|---|"]
    lines += [f"| {p.name} | {p.version} | {p.licence} | {p.files} | {p.bytes / 1e6:.2f} |" for p in rows["held_out"]]
    lines += ["", "Refused (licence not recognised as permissive): "
              + (", ".join(f"{p.name} {p.version} ({p.licence})" for p in rows["refused"]) or "none"), ""]
    path = os.path.join(out_dir, "ATTRIBUTION.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path
