"""config.json parsing in both shapes, against the configs transformers itself writes, and a clear
ConfigError naming the field for every malformed one."""
from __future__ import annotations

import copy
import json

import pytest

from ckpts import tiny
from tinymodels import CONFIGS
from specfire.config import FULL, LINEAR, ModelConfig
from specfire.errors import CheckpointError, ConfigError

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim")

# The text part of a published Qwen3.5 config.json (the shape of the real files: mrope, interleaved
# sections, layer_types listed, rope fields under rope_parameters).
QWEN_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "eos_token_id": 248044,
}
QWEN_MM = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "tie_word_embeddings": False, "text_config": QWEN_TEXT, "vision_config": {"depth": 27}}


@pytest.mark.parametrize("mm", [False, True], ids=["text", "mm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parses_what_transformers_writes(ckpt_cache, name, mm):
    from transformers import AutoConfig

    path = tiny(ckpt_cache, name, multimodal=mm)
    cfg = ModelConfig.from_dir(path)
    hf = AutoConfig.from_pretrained(path)
    text = hf.text_config if mm else hf
    assert cfg.model_type == ("qwen3_5" if mm else "qwen3_5_text")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
              "max_position_embeddings"):
        assert getattr(cfg, f) == getattr(text, f), f
    assert list(cfg.layer_types) == list(text.layer_types)
    assert cfg.rope_theta == text.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == text.rope_parameters["partial_rotary_factor"]
    assert cfg.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
    assert cfg.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert cfg.vocab_size - 1 in cfg.eos_token_ids        # from generation_config.json


@pytest.mark.parametrize("raw", [QWEN_TEXT, QWEN_MM], ids=["text", "mm"])
def test_real_shapes(raw):
    cfg = ModelConfig.from_dict(copy.deepcopy(raw))
    assert cfg.n_linear == 6 and cfg.n_full == 2 and cfg.layer_types[3] == FULL
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 64
    assert cfg.linear_key_dim == 2048 and cfg.linear_value_dim == 4096 and cfg.conv_dim == 8192
    assert cfg.mtp_num_hidden_layers == 1 and cfg.eos_token_ids == (248044,)
    assert not cfg.tie_word_embeddings


def test_defaults_and_legacy_fields():
    raw = copy.deepcopy(QWEN_TEXT)
    del raw["layer_types"], raw["rope_parameters"], raw["head_dim"]
    raw.update(full_attention_interval=2, rope_theta=5e5, partial_rotary_factor=0.5, hidden_size=1024)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types == (LINEAR, FULL) * 4
    assert cfg.rope_theta == 5e5 and cfg.head_dim == 1024 // 16 and cfg.rotary_dim == 32


def test_eos_merged_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_MM))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    assert ModelConfig.from_dir(str(tmp_path)).eos_token_ids == (248044, 248046)


def _mut(raw: dict, path: str, value) -> dict:
    raw = copy.deepcopy(raw)
    d = raw["text_config"] if "text_config" in raw and path != "model_type" and path != "text_config" else raw
    if value is KeyError:
        d.pop(path)
    else:
        d[path] = value
    return raw


BAD = [
    ("model_type", "llama", r"unsupported model_type 'llama'"),
    ("model_type", KeyError, r"unsupported model_type None"),
    ("text_config", KeyError, r"no 'text_config'"),
    ("hidden_size", -4, r"'hidden_size' must be a positive integer, got -4"),
    ("vocab_size", "big", r"'vocab_size' must be a positive integer, got 'big'"),
    ("num_hidden_layers", 5, r"'layer_types' has 8 entries but num_hidden_layers is 5"),
    ("layer_types", ["linear_attention"] * 7 + ["sliding"], r"'layer_types\[7\]' is 'sliding'"),
    ("layer_types", 3, r"'(text_config\.)?layer_types' must be a list"),
    ("num_key_value_heads", 3, r"num_attention_heads \(16\) is not a multiple of num_key_value_heads \(3\)"),
    ("linear_num_value_heads", 24, r"linear_num_value_heads \(24\) is not a multiple of linear_num_key_heads"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, r"unsupported rope_type 'yarn'"),
    ("rope_parameters", {"rope_theta": "x"}, r"'(text_config\.)?rope_theta' must be a number, got 'x'"),
    ("rope_parameters", {"partial_rotary_factor": 0.27}, r"partial_rotary_factor 0\.27 gives rotary dim 69"),
    ("rope_parameters", {"partial_rotary_factor": 1.5}, r"partial_rotary_factor 1\.5 gives rotary dim 384"),
    ("rope_parameters", [1, 2], r"'(text_config\.)?rope_parameters' must be an object"),
    ("rms_norm_eps", "tiny", r"'(text_config\.)?rms_norm_eps' must be a number, got 'tiny'"),
    ("rms_norm_eps", 0, r"'rms_norm_eps' must be > 0"),
    ("max_position_embeddings", 0, r"'max_position_embeddings' must be a positive integer"),
    ("eos_token_id", "eos", r"'eos_token_id' must be an integer or a list of integers"),
] + [(f, KeyError, rf"missing required field '(text_config\.)?{f}'") for f in REQUIRED]


BAD_CASES = [(mm, *b) for mm in (False, True) for b in BAD if mm or b[0] != "text_config"]


@pytest.mark.parametrize("mm,field,value,pattern", BAD_CASES,
                         ids=[f"{'mm' if c[0] else 'text'}-{c[1]}={c[2]!r}"[:44] for c in BAD_CASES])
def test_bad_config_is_one_clear_error(mm, field, value, pattern):
    raw = _mut(QWEN_MM if mm else QWEN_TEXT, field, value)
    with pytest.raises(ConfigError, match=pattern) as ei:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(ei.value)
    assert isinstance(ei.value, CheckpointError)           # the CLI's one-line error path


def test_missing_field_names_text_config_in_multimodal_shape():
    with pytest.raises(ConfigError, match=r"'text_config\.hidden_size'"):
        ModelConfig.from_dict(_mut(QWEN_MM, "hidden_size", KeyError))


def test_bad_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_TEXT))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": {"a": 1}}))
    with pytest.raises(ConfigError, match="generation_config.json: 'eos_token_id'"):
        ModelConfig.from_dir(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_dir(str(tmp_path))
