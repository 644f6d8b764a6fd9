"""Tiny random Qwen3.5 checkpoints built and saved by transformers itself (plus mtp.* tensors, which
transformers drops), in the text-only or the multimodal layout."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

BASE = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

CONFIGS = {
    "base": {},
    "tied": dict(tie_word_embeddings=True),
    "gqa4": dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=1, linear_num_value_heads=3),
    "kdim": dict(linear_key_head_dim=6, linear_value_head_dim=10, vocab_size=97),
    "mix": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                   "full_attention", "linear_attention"]),
    "mha": dict(num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=3, linear_num_value_heads=3,
                vocab_size=257, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.5}),
    # tensor parallelism: tp = 4 with KV heads replicated (2 < 4), an odd vocabulary, an MLP whose
    # rows do not split evenly; and a single KV head with tied embeddings
    "tp4": dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8,
                intermediate_size=98, vocab_size=151),
    "kv1": dict(num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=4, linear_num_value_heads=4,
                vocab_size=127, tie_word_embeddings=True),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Give every tensor non-trivial values: zero-centred norms get non-zero weights so a wrong
    `1 + w` shows, A_log and dt_bias vary per head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5 * 2))


def mtp_tensors(hidden: int, cfgd: dict, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    h = hidden
    hd, nq, nkv, inter = cfgd["head_dim"], cfgd["num_attention_heads"], cfgd["num_key_value_heads"], cfgd["intermediate_size"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,), "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nq * hd, h), "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h), "mtp.layers.0.self_attn.o_proj.weight": (h, nq * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate_proj.weight": (inter, h), "mtp.layers.0.mlp.up_proj.weight": (inter, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, inter),
    }
    out = {}
    for n, s in shapes.items():
        if len(s) == 1:
            out[n] = torch.randn(s, generator=g) * 0.3
        else:
            out[n] = torch.randn(s, generator=g) * (scale / s[1] ** 0.5)
    return out


def make_checkpoint(path: str, name: str = "base", multimodal: bool = False, mtp: bool = True, seed: int = 0,
                    **overrides) -> str:
    """Build a tiny model with transformers, save it, add mtp.* tensors. Returns the directory."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    cfgd = {**BASE, **CONFIGS[name], **overrides}
    torch.manual_seed(seed)
    text_cfg = Qwen3_5TextConfig(**cfgd)
    if multimodal:
        cfg = Qwen3_5Config(text_config=text_cfg.to_dict(),
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                               out_hidden_size=cfgd["hidden_size"], patch_size=4,
                                               temporal_patch_size=1, spatial_merge_size=1),
                            tie_word_embeddings=cfgd["tie_word_embeddings"])
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = Qwen3_5ForCausalLM(text_cfg)
    _randomise(model, seed)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [cfgd["vocab_size"] - 1]}, f)
    if mtp:
        st = os.path.join(path, "model.safetensors")
        tensors = load_file(st)
        tensors.update(mtp_tensors(cfgd["hidden_size"], cfgd, seed))
        save_file(tensors, st, metadata={"format": "pt"})
    return path


def load_hf(path: str, multimodal: bool = False):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if multimodal else Qwen3_5ForCausalLM
    m = cls.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m
