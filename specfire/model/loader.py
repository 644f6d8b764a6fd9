"""Reading HF safetensors checkpoints (single file or sharded), memory-mapped.

Names are normalised to the trunk's own (`model.language_model.` / `model.` stripped), the vision
tower is skipped, `mtp.*` is kept apart for the MTP head. A 4-bit weight (`<name>.qweight`,
`.scales`, `.zeros`, kernels/q4) appears under its logical `<name>.weight` and loads as a
QuantWeight. Every problem is one CheckpointError
line naming the file, the tensor and what was expected.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from ..config import ModelConfig, regular_file
from ..errors import CheckpointError
from ..layers import Linear, Target, target_for
from .cpu import CpuMtpHead, CpuQwen35Trunk
from .cuda import FusedMtpHead
from .qwen35 import MtpHead, Qwen35Trunk

log = logging.getLogger("specfire")

_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
USABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SKIP_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
MTP_SIDECAR = "mtp.safetensors"
QUANT_PARTS = ("qweight", "scales", "zeros")


def normalise_name(name: str) -> str | None:
    """HF name -> trunk-relative name, `mtp.`-prefixed for the head, None to skip."""
    if name.startswith(SKIP_PREFIXES):
        return None
    if name.startswith("mtp."):
        return name
    for p in ("model.language_model.", "model."):
        if name.startswith(p):
            return name[len(p):]
    if name in ("lm_head.weight", "lm_head.qweight", "lm_head.scales", "lm_head.zeros"):
        return name
    return "?" + name  # unknown: reported by the caller


class TensorSource:
    """Lazy, memory-mapped access to every tensor of one or more safetensors files."""

    def __init__(self, files: Iterable[str]):
        self._where: dict[str, str] = {}     # normalised name -> file
        self._raw: dict[str, str] = {}       # normalised name -> name in file
        self._handles: dict[str, object] = {}
        self._quant: dict[str, tuple[str, bool]] = {}  # logical `.weight` name -> (base name, hadamard)
        for f in files:
            h = self._open(f)
            hadamard = _file_hadamard(h, f)
            for raw in h.keys():
                n = normalise_name(raw)
                if n is None:
                    continue
                self._where[n] = f
                self._raw[n] = raw
                if n.endswith(".qweight"):
                    self._quant[n[:-len("qweight")] + "weight"] = (n[:-len(".qweight")], hadamard)
        for logical, (base, _) in self._quant.items():
            for part in QUANT_PARTS:
                if base + "." + part not in self._where:
                    raise CheckpointError(f"4-bit weight '{base}' has no '{part}' tensor")
            self._where[logical] = self._where[base + ".qweight"]
            self._raw[logical] = self._raw[base + ".qweight"]
            for part in QUANT_PARTS:
                del self._where[base + "." + part]

    def _open(self, f: str):
        if f not in self._handles:
            if not regular_file(f):
                raise CheckpointError(f"weight file {f} not found")
            try:
                self._handles[f] = safe_open(f, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {f}: it is truncated or not a safetensors file ({e})") from None
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        return self._where[name]

    def is_quantized(self, name: str) -> bool:
        return name in self._quant

    def stored_bytes(self) -> int:
        """Bytes of every tensor this source holds, as stored on disk (quantized ones packed)."""
        total = 0
        files = sorted(set(self._where.values()))
        stored = [(f, raw) for f in files for raw in self._open(f).keys() if normalise_name(raw) is not None]
        for f, raw in stored:  # every stored tensor once (packed codes, scales and zeros included)
            sl = self._open(f).get_slice(raw)
            n = 1
            for d in sl.get_shape():
                n *= d
            total += n * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        return total

    def shape(self, name: str) -> tuple[int, ...]:
        s = tuple(self._open(self._where[name]).get_slice(self._raw[name]).get_shape())
        return (s[0], 2 * s[1]) if name in self._quant else s

    def _get_quant(self, name: str, index: tuple[slice, ...] | None):
        from ..kernels.q4 import QuantWeight

        base, hadamard = self._quant[name]
        f = self._where[name]
        raw = self._raw[name][:-len("qweight")]
        parts = self._quant_index(name, index)
        try:
            if parts is None:
                q, s, z = (self._open(f).get_tensor(raw + p) for p in QUANT_PARTS)
            else:
                q, s, z = (self._open(f).get_slice(raw + p)[ix] for p, ix in zip(QUANT_PARTS, parts))
            return QuantWeight.from_stored(q, s, z, hadamard)
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"4-bit weight '{raw[:-1]}' in {f} is malformed: {e}") from None
        except Exception as e:
            raise CheckpointError(f"cannot read 4-bit weight '{raw[:-1]}' from {f}: the file is truncated "
                                  f"or corrupt ({e})") from None

    def quant_group(self, name: str) -> int:
        """Input columns per quantization group of 4-bit tensor `name` (from the stored shapes)."""
        scales = self._open(self._where[name]).get_slice(self._raw[name][:-len("qweight")] + "scales")
        return self.shape(name)[1] // scales.get_shape()[1]

    def _quant_index(self, name: str, index: tuple[slice, ...] | None):
        """Slices of (qweight, scales, zeros) for output rows `(rows,)` or input columns
        `(slice(None), cols)` of a 4-bit weight (tensor parallelism); columns must fall on group
        bounds. None = the whole tensor."""
        if index is None:
            return None
        if len(index) == 1:
            return index, index, index
        k = self.shape(name)[1]
        g = self.quant_group(name)
        c = index[1]
        lo, hi = c.start or 0, k if c.stop is None else c.stop
        if lo % g or hi % g:
            raise CheckpointError(f"tensor '{name}' is 4-bit with groups of {g} input columns; a shard of "
                                  f"columns [{lo}, {hi}) does not fall on group bounds")
        return (slice(None), slice(lo // 2, hi // 2)), (slice(None), slice(lo // g, hi // g)), \
            (slice(None), slice(lo // g, hi // g))

    def get(self, name: str, index: tuple[slice, ...] | None = None):
        """The tensor (or a slice of it, reading only those bytes); a QuantWeight (CPU) for a
        4-bit weight."""
        if name in self._quant:
            return self._get_quant(name, index)
        f = self._where[name]
        try:
            if index is None:
                t = self._open(f).get_tensor(self._raw[name])
            else:
                t = self._open(f).get_slice(self._raw[name])[index]
        except Exception as e:
            raise CheckpointError(f"cannot read tensor '{self._raw[name]}' from {f}: the file is truncated "
                                  f"or corrupt ({e})") from None
        if t.dtype not in USABLE_DTYPES:
            raise CheckpointError(f"tensor '{self._raw[name]}' in {f} has dtype {t.dtype}; specfire reads "
                                  f"float32, bfloat16 or float16")
        return t


def _file_hadamard(handle, f: str) -> bool:
    """Whether the 4-bit weights of one file are Hadamard-rotated (its metadata says)."""
    meta = handle.metadata() or {}
    q = meta.get("quantization_config")
    if q is None:
        return False
    try:
        cfg = json.loads(q)
    except json.JSONDecodeError:
        raise CheckpointError(f"{f} has malformed quantization_config metadata") from None
    from ..kernels.q4 import FORMAT, FORMAT_VERSION
    if cfg.get("quant_method") != FORMAT or cfg.get("version", 0) > FORMAT_VERSION or cfg.get("bits") != 4:
        raise CheckpointError(f"{f} uses quantization {cfg}; specfire reads {FORMAT} version <= {FORMAT_VERSION}")
    return bool(cfg.get("hadamard", False))


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (single file or sharded with an index)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path} is not a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if regular_file(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            names = set(wm.values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        for v in sorted(names, key=repr):
            if not isinstance(v, str) or not v:
                raise CheckpointError(f"{index} is malformed: a weight_map value is {v!r}, not a file name")
            if os.path.isabs(v) or os.path.normpath(v).split(os.sep)[0] == "..":
                raise CheckpointError(f"{index} names shard {v!r}, outside the checkpoint folder; shards must "
                                      f"be files inside it")
        files = sorted(os.path.join(path, v) for v in names)
        for f in files:
            if not regular_file(f):
                raise CheckpointError(f"shard {os.path.relpath(f, path)} listed in {index} is missing")
        return files
    single = os.path.join(path, "model.safetensors")
    if regular_file(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def open_checkpoint(path: str) -> TensorSource:
    files = checkpoint_files(path)
    src = TensorSource(files)
    scaled = [n for n in src.names() if n.endswith("weight_scale_inv")]
    if scaled:
        raise CheckpointError(f"{path} is an FP8-quantized checkpoint (tensor '{scaled[0]}'); specfire reads "
                              f"float32, bfloat16 or float16 checkpoints")
    unknown = sorted(n[1:] for n in src.names() if n.startswith("?"))
    if unknown:
        raise CheckpointError(f"unexpected tensor '{unknown[0]}' in {path} (not a Qwen3.5 trunk, MTP or vision "
                              f"tensor){' and ' + str(len(unknown) - 1) + ' more' if len(unknown) > 1 else ''}")
    return src


def mtp_source(path: str, src: TensorSource, sidecar: str | None = None) -> TensorSource | None:
    """Where the MTP head's tensors are: an explicit sidecar path, the checkpoint itself, or
    `mtp.safetensors` beside it. None when there is no head."""
    if sidecar is not None:
        return TensorSource([sidecar])
    if any(n.startswith("mtp.") for n in src.names()):
        return src
    side = os.path.join(path, MTP_SIDECAR)
    if regular_file(side):
        return TensorSource([side])
    return None


Fetch = Callable[[TensorSource, str, torch.nn.Parameter], torch.Tensor]


def full_fetch(src: TensorSource, name: str, param: torch.nn.Parameter) -> torch.Tensor:
    """Read a whole tensor; the default (one device). A mesh passes its own slicing fetch."""
    return src.get(name)


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse a floating tensor holding NaN or inf: it would load and then print garbage."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"tensor '{name}' has {bad} NaN or infinite value(s); the checkpoint is corrupt")


def load_module(module: torch.nn.Module, src: TensorSource, prefix: str, *, dtype: torch.dtype,
                device: torch.device, fetch: Fetch = full_fetch, strict_unexpected: bool = True,
                progress: bool = False, what: str = "weights") -> None:
    """Fill every parameter of `module` from `src` (names `prefix + param_name`), checking
    presence, shape and dtype; with `strict_unexpected`, tensors under `prefix` that the module
    does not have are an error."""
    params = dict(module.named_parameters())
    want = {prefix + k: p for k, p in params.items()}
    if strict_unexpected:
        for n in src.names():
            if n.startswith("?") or n.startswith("mtp.") != prefix.startswith("mtp."):
                continue
            if n.startswith(prefix) and n not in want:
                raise CheckpointError(f"unexpected tensor '{n}' in checkpoint (the {what} has no such parameter)")
    for n in want:
        if n not in src:
            raise CheckpointError(f"missing tensor '{n}' for the {what}")
    items = list(want.items())
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc=f"loading {what}", unit="tensor", leave=False)
        except ImportError:
            bar = None
    for n, p in items:
        t = fetch(src, n, p)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor '{n}' has shape {list(t.shape)}, expected {list(p.shape)} "
                                  f"(file {os.path.basename(src.file_of(n))})")
        owner, _, attr = (n[len(prefix):]).rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if not isinstance(t, torch.Tensor):  # a 4-bit QuantWeight takes the Linear's weight slot
            if attr != "weight" or not isinstance(sub, Linear):
                raise CheckpointError(f"tensor '{n}' is stored 4-bit, but the {what} needs it dense "
                                      f"(only projection weights may be quantized)")
            delattr(sub, attr)
            setattr(sub, attr, t.to(device=device, dtype=dtype))
        else:
            t = aligned(t.to(device=device, dtype=dtype).contiguous())
            check_finite(n, t)
            setattr(sub, attr, torch.nn.Parameter(t, requires_grad=False))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def aligned(t):
    """t, copied where it is a CPU tensor whose data does not start on a 64-byte boundary (a
    safetensors file maps tensors at any 8-byte offset): on CPUs where MKL peels a misaligned start,
    a product's bits depend on the weight's alignment, so a mesh shard would round unlike the
    same rows of the whole matrix. A 4-bit QuantWeight passes as it is."""
    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.data_ptr() % 64:
        return t.clone()
    return t


# ---- building the model from a checkpoint (one path for every topology) ------------------------

def follow_tied(src: TensorSource, cfg: ModelConfig) -> ModelConfig:
    """The checkpoint, not config.json, decides whether lm_head is tied to the embedding."""
    tied = "lm_head.weight" not in src
    if tied == cfg.tie_word_embeddings:
        return cfg
    log.info("config says tie_word_embeddings=%s but the checkpoint %s lm_head.weight; following the "
             "checkpoint", cfg.tie_word_embeddings, "lacks" if tied else "has")
    return replace(cfg, tie_word_embeddings=tied)


def one_device(device: torch.device, canonical: bool = False) -> Target:
    """The layers of one device: its kind's, or with `canonical` the math a mesh computes
    (LLM(tp_invariant=True): one device gives a mesh's bits)."""
    return target_for(torch.device(device).type, canonical)


def build_trunk(cfg: ModelConfig, target: Target) -> Qwen35Trunk:
    """The trunk class of the target (one CPU device: its packed rows forward, model/cpu.py)."""
    return (CpuQwen35Trunk if target.packed_rows else Qwen35Trunk)(cfg, target)


def build_head(cfg: ModelConfig, target: Target) -> MtpHead:
    """The MTP head class of the target (one GPU: the fused step, model/cuda.py; one CPU device:
    the packed rows, model/cpu.py)."""
    cls = FusedMtpHead if target.fused_head else CpuMtpHead if target.packed_rows else MtpHead
    return cls(cfg, target)


def load_trunk(src: TensorSource, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device,
               build: Callable[[ModelConfig], torch.nn.Module] | None = None, fetch: Fetch = full_fetch,
               progress: bool = False, what: str = "trunk", canonical: bool = False) -> torch.nn.Module:
    """`build(cfg)` on the meta device, then filled from `src`. A mesh rank passes its sharded
    model as `build` and its slicing `fetch`; one device takes the defaults (`build_trunk` for
    the device's layers, the canonical ones with `canonical`)."""
    with torch.device("meta"):
        model = build(cfg) if build is not None else build_trunk(cfg, one_device(device, canonical))
    load_module(model, src, "", dtype=dtype, device=device, fetch=fetch, progress=progress, what=what)
    return model


def load_mtp_head(path: str, src: TensorSource, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  want_mtp: str, mtp_path: str | None = None, canonical: bool = False) -> MtpHead | None:
    """The MTP head by `want_mtp`: 'never' | 'must' | 'if_present' (whole, on one device; with
    `canonical`, in the math every tp degree shares, so drafts agree across degrees too)."""
    if want_mtp == "never":
        return None
    msrc = mtp_source(path, src, mtp_path)
    if msrc is None:
        if want_mtp == "must":
            raise CheckpointError(f"spec mode 'mtp' needs an MTP head, but {path} has no mtp.* tensors "
                                  f"and no {MTP_SIDECAR} beside it")
        return None
    with torch.device("meta"):
        head = build_head(cfg, one_device(device, canonical))
    load_module(head, msrc, "mtp.", dtype=dtype, device=device, what="MTP head")
    log.info("MTP head loaded from %s", msrc.file_of("mtp.fc.weight"))
    return head
