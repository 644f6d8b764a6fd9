"""What the peer benchmark's runners and its driver share beyond bench/common.py: the warm-up
shape, prompts, result files. Each runner is a separate process, so this module imports no engine."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from bench.common import CEILING, FINAL_NORMS, NORMS_FILE, SHAPES, config_step_bytes, model_config  # noqa: F401  (re-exported: run.py, table.py, tests)

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_VOCAB = SHAPES["tiny"]["vocab_size"]
NORM_KEYS = FINAL_NORMS                              # -1 ties every logit (bench/common.py write_checkpoint)


WARM = "-warm"        # suffix: the shape's widths, 2 layers, vocabulary 4096 (run.py --prewarm)
WARM_LAYERS, WARM_VOCAB = ("linear_attention", "full_attention"), 4096


def cfg_for(shape: str):
    """ModelConfig of a shape of bench/common.py, or `<shape>-warm`: the same widths in 2 layers
    (1 GDN + 1 attention) and a 4096-token vocabulary, whose runs compile the same kernels (Triton
    caches) from a few GB of weights."""
    if shape.endswith(WARM):
        base = cfg_for(shape[:-len(WARM)])
        return dataclasses.replace(base, num_hidden_layers=len(WARM_LAYERS), layer_types=WARM_LAYERS,
                                   vocab_size=WARM_VOCAB)
    return model_config(shape)


def step_bytes_cfg(cfg, ctx: int, elem: int = 2) -> int:
    """Bytes one AR decode step must move at context `ctx` (bench/common.py config_step_bytes)."""
    return config_step_bytes(cfg, ctx, elem)


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
