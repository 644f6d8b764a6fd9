"""Typed configuration from a checkpoint's files: the model's geometry (config.json) and its default
sampling (generation_config.json).

Every dataclass validates at construction; errors name the field, the value and what is allowed.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import CheckpointError, ConfigError
from .params import SamplingParams

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Qwen3.5 / Qwen3.6 dense text trunk (the vision tower is ignored)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0.0):
                raise ConfigError(f"config field '{name}' must be > 0 and finite, got {v!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config field 'layer_types' has {len(self.layer_types)} entries but "
                              f"num_hidden_layers is {self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in (LINEAR, FULL):
                raise ConfigError(f"config field 'layer_types[{i}]' is {t!r}; allowed: {LINEAR!r}, {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")
        if not (0.0 < self.partial_rotary_factor <= 1.0) or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim "
                              f"{self.rotary_dim}; it must be even and in (0, head_dim]")

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def n_linear(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def n_full(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    # ---- parsing --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse either shape of config.json: multimodal (`qwen3_5`, text under `text_config`) or text-only."""
        mt = raw.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {mt!r}; specfire serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        top, where = raw, ""
        if mt == "qwen3_5":
            if not isinstance(raw.get("text_config"), dict):
                raise ConfigError("config.json with model_type 'qwen3_5' has no 'text_config' object")
            raw, where = raw["text_config"], "text_config."

        def req(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"config.json is missing required field '{where}{name}'")
            return raw[name]

        def num(name: str, default: Any, conv: Any, src: dict[str, Any] | None = None) -> Any:
            v = (raw if src is None else src).get(name, default)
            try:
                if isinstance(v, (bool, list, dict, str)) and conv is not bool:
                    raise TypeError
                return conv(v)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"config field '{where}{name}' must be a number, got {v!r}") from None

        n_layers = req("num_hidden_layers")
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = raw.get("full_attention_interval", 4)
            for name, v in (("full_attention_interval", interval), ("num_hidden_layers", n_layers)):
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"config field '{where}{name}' must be a positive integer, got {v!r}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"config field '{where}layer_types' must be a list, got {layer_types!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field '{where}rope_parameters' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise ConfigError(f"unsupported rope_type {rope_type!r} in 'rope_parameters'; only default rotary")
        theta = num("rope_theta", raw.get("rope_theta", 10_000_000.0), float, rope)
        prf = num("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25), float, rope)
        eos = raw.get("eos_token_id", top.get("eos_token_id"))
        tie = top.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        head_dim = raw.get("head_dim")
        if head_dim is None:
            hs, nh = req("hidden_size"), req("num_attention_heads")
            head_dim = hs // nh if isinstance(hs, int) and isinstance(nh, int) and nh > 0 else None
        try:
            eos_ids = _as_ids(eos)
        except (TypeError, ValueError):
            raise ConfigError(f"config field 'eos_token_id' must be an integer or a list of integers, "
                              f"got {eos!r}") from None
        return cls(
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=req("num_attention_heads"),
            num_key_value_heads=req("num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=req("linear_num_key_heads"),
            linear_num_value_heads=req("linear_num_value_heads"),
            linear_key_head_dim=req("linear_key_head_dim"),
            linear_value_head_dim=req("linear_value_head_dim"),
            linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=num("rms_norm_eps", 1e-6, float),
            rope_theta=theta,
            partial_rotary_factor=prf,
            max_position_embeddings=num("max_position_embeddings", 262144, int),
            tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=num("mtp_num_hidden_layers", 0, lambda v: int(v or 0)),
            eos_token_ids=eos_ids,
            model_type=mt,
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """Read config.json plus eos ids from generation_config.json beside it."""
        cfg_path = os.path.join(path, "config.json")
        raw = _read_json(cfg_path)
        cfg = cls.from_dict(raw)
        gen_path = os.path.join(path, "generation_config.json")
        eos = list(cfg.eos_token_ids)
        if os.path.exists(gen_path):
            gen_eos = _read_json(gen_path).get("eos_token_id")
            try:
                gen_ids = _as_ids(gen_eos)
            except (TypeError, ValueError):
                raise ConfigError(f"{gen_path}: 'eos_token_id' must be an integer or a list of integers, "
                                  f"got {gen_eos!r}") from None
            for i in gen_ids:
                if i not in eos:
                    eos.append(i)
        if tuple(eos) != cfg.eos_token_ids:
            cfg = _replace(cfg, eos_token_ids=tuple(eos))
        return cfg

    def to_hf_text_dict(self) -> dict[str, Any]:
        """A `qwen3_5_text` config.json body (used by the trainer and the quantizer)."""
        return {
            "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "eos_token_id": list(self.eos_token_ids) or None,
        }


def _replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    from dataclasses import replace
    return replace(cfg, **kw)


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def regular_file(path: str) -> bool:
    """Whether there is a file to read at `path` (a symlink counts as its target): False when
    nothing is there; CheckpointError naming it when something is that is not a regular file (a
    FIFO would block the read forever, a device or a folder fail obscurely)."""
    if not os.path.exists(path):
        return False
    if not os.path.isfile(path):
        mode = os.stat(path).st_mode
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a plain file")
        raise CheckpointError(f"{path} is {kind}, not a regular file; a checkpoint's files must be regular files")
    return True


def _read_json(path: str) -> dict[str, Any]:
    if not regular_file(path):
        raise ConfigError(f"{path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


# ---------------------------------------------------------------------------------------------
# The model's default sampling (generation_config.json)
# ---------------------------------------------------------------------------------------------

GENERATION_CONFIG_MODES = ("auto", "none")
# generation_config.json key -> SamplingParams field. The first six are the keys vLLM reads with
# `--generation-config auto` (max_new_tokens is HF's name for max_tokens); presence_penalty and
# frequency_penalty are specfire's own keys (HF's generate has no such fields).
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """The default sampling parameters a checkpoint's generation_config.json sets: `values` maps
    SamplingParams fields to the file's values (only the keys the file sets); `source` is the file
    (None: no file, or defaults turned off); `notes` says how `do_sample` was read.

    A field a request leaves out takes, in order: the front end's setting (a flag), these values,
    the front end's built-in default. `do_sample: false` means greedy (Hugging Face's meaning):
    the default temperature becomes 0 whatever `temperature` says; `do_sample: true` without a
    temperature samples at 1.0 (HF's default temperature). vLLM reads the same keys but ignores
    `do_sample`."""

    values: tuple[tuple[str, Any], ...] = ()
    source: str | None = None
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def __bool__(self) -> bool:
        return bool(self.values)

    def overriding(self, given: Any = (), builtin: dict[str, Any] | None = None) -> list[str]:
        """The fields whose value comes from the model and differs from the front end's built-in
        default (`builtin`, default SamplingParams()'s), leaving out those in `given` (set by the
        request or a flag): what a front end reports as the model's doing."""
        base = {k: getattr(SamplingParams(), k) for k, _ in self.values}
        base.update(builtin or {})
        return [k for k, v in self.values if k not in given and base.get(k) != v]

    def text(self, fields: Sequence[str] | None = None) -> str:
        """'repetition_penalty=1.05, frequency_penalty=0.7' (only `fields`, when given)."""
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in self.values if fields is None or k in fields)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "generation_config.json") -> "GenerationDefaults":
        """Read and check the sampling keys of a generation_config.json body. A malformed value
        raises ConfigError naming the file and the key: a default that is silently dropped would
        change every completion without a word (`--generation-config none` loads the model
        anyway, with the built-in defaults)."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{source}: '{key}' {why}; fix the file, or ignore its sampling defaults with "
                               f"generation_config 'none' (--generation-config none)")

        vals: dict[str, Any] = {}
        for key, fld in GENERATION_KEYS.items():
            v = raw.get(key)
            if v is None:                       # absent or null: not set (as vLLM and HF read it)
                continue
            if fld == "top_k" and v == -1 and not isinstance(v, bool):
                v = 0                           # -1 and 0 both mean no top-k
            try:
                SamplingParams(**{fld: v})      # the same checks as a request's field
            except ValueError as e:
                raise bad(key, str(e).split(" ", 1)[1]) from None
            vals[fld] = v
        notes: list[str] = []
        do_sample = raw.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise bad("do_sample", f"must be true or false, got {do_sample!r}")
        if do_sample is False:
            t = vals.get("temperature")
            if t not in (None, 0, 0.0):
                notes.append(f"do_sample false: greedy (temperature {t:g} is ignored)")
            else:
                notes.append("do_sample false: greedy")
            vals["temperature"] = 0.0
        elif do_sample is True and "temperature" not in vals:
            notes.append("do_sample true without a temperature: temperature 1")
            vals["temperature"] = 1.0
        order = list(GENERATION_KEYS.values())
        return cls(tuple(sorted(vals.items(), key=lambda kv: order.index(kv[0]))), source, tuple(notes))

    @classmethod
    def from_dir(cls, path: str, mode: str = "auto") -> "GenerationDefaults":
        """The defaults of the checkpoint in `path`: mode 'auto' reads its generation_config.json
        (none there: no defaults); 'none' ignores the file's sampling keys (the eos ids still
        come from it)."""
        check_generation_config(mode)
        gen_path = os.path.join(path, "generation_config.json")
        if mode == "none" or not os.path.exists(gen_path):
            return cls()
        return cls.from_dict(_read_json(gen_path), gen_path)


def check_generation_config(mode: Any) -> str:
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    return mode


Q4_DEFAULT_GROUP = 128   # inputs per scale/zero group of the 4-bit format (kernels/q4), `specfire quantize`'s default
