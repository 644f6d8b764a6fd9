"""Shared by the peer benchmark's runners and its driver: shapes, prompts, bytes a step moves,
result files. Each runner is a separate process, so this module imports no engine."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import torch  # noqa: E402

from decode import CEILING, SHAPES, make_cfg  # noqa: E402  (bench/decode.py: the real shapes)

TINY = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False)
TINY_VOCAB = 1024
NORM_KEYS = ("model.norm.weight", "mtp.norm.weight")   # zeroing these (-1) ties every logit
NORMS_FILE = "model-norms.safetensors"


WARM = "-warm"        # suffix: the shape's widths, 2 layers, vocabulary 4096 (run.py --prewarm)
WARM_LAYERS, WARM_VOCAB = ("linear_attention", "full_attention"), 4096


def cfg_for(shape: str):
    """ModelConfig of a real shape (bench/decode.py), of `tiny` (CPU checks, vocabulary 1024), or
    `<shape>-warm`: the same widths in 2 layers (1 GDN + 1 attention) and a 4096-token vocabulary,
    whose runs compile the same kernels (Triton caches) from a few GB of weights."""
    if shape.endswith(WARM):
        base = cfg_for(shape[:-len(WARM)])
        return dataclasses.replace(base, num_hidden_layers=len(WARM_LAYERS), layer_types=WARM_LAYERS,
                                   vocab_size=WARM_VOCAB)
    if shape == "tiny":
        SHAPES.setdefault("tiny", TINY)
        return dataclasses.replace(make_cfg("tiny"), vocab_size=TINY_VOCAB)
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: tiny, {', '.join(SHAPES)}")
    return make_cfg(shape)


def step_bytes_cfg(cfg, ctx: int, elem: int = 2) -> int:
    """Bytes one AR decode step must move at context `ctx` (bench/decode.py `step_bytes`: every
    weight once, KV to ctx, GDN state read + written), from the config alone (meta tensors)."""
    from decode import step_bytes

    from specfire.model.qwen35 import Qwen35Trunk
    dt = {2: torch.bfloat16, 4: torch.float32}[elem]
    with torch.device("meta"):
        m = Qwen35Trunk(cfg).to(dt)
    return step_bytes(m, ctx, elem)


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> dict:
    """The fixed prompt set: one warm-up prompt and `n` timed prompts of random token ids (the
    weights are random, so text means nothing); ids avoid 0, 1 and the last id (eos)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab - 1, (n + 1, length), generator=g).tolist()
    return {"warmup": ids[0], "prompts": ids[1:], "seed": seed, "length": length}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float | None:
    """Peak memory this process allocated through torch's CUDA allocator since reset_peak (GB)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 1e9


def equal_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Result:
    """A runner's JSON result, rewritten after every mode so a runner killed by its timeout still
    leaves what it measured."""

    def __init__(self, path: str | None, engine: str, version: str | None = None, **kw):
        self.path = path
        self.data: dict = {"engine": engine, "version": version, "modes": {}, "started": time.time(), **kw}
        self.save()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def mode(self, name: str, value: dict) -> None:
        self.data["modes"][name] = value
        self.save()
        short = {k: v for k, v in value.items() if k != "token_ids"}
        print(f"[{time.strftime('%H:%M:%S')}] {self.data['engine']} {name}: {json.dumps(short)}", flush=True)

    def save(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)

    def fail(self, reason: str) -> None:
        """One line on stderr and in the result, exit status 2 (the driver reports the line)."""
        self.put("error", reason)
        print(f"{self.data['engine']}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def runner_args(description: str):
    import argparse
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--normal", required=True, help="checkpoint with normal random weights (AR, output check)")
    ap.add_argument("--tied", help="the same weights with final norms -1: every MTP draft accepted")
    ap.add_argument("--prompts", required=True, help="JSON from common.make_prompts")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--modes", default="", help="comma-separated modes (runner-specific; default all)")
    ap.add_argument("--out", help="result JSON path")
    return ap


def load_prompts(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
