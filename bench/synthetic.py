"""SYNTHETIC ACCEPTANCE, for benchmarks only: MTP at a chosen acceptance profile on real shapes.

No trained MTP head exists for the real Qwen3.5 shapes here, so speed at realistic acceptance is
measured on a random-weight checkpoint whose trunk and head final norms are -1: their outputs are
0, every logit ties, and greedy always picks token 0 (ties go to the lowest id). `ProfileDrafter`
runs the model's own MTP drafter in full (the head's cost is paid, CUDA graph and all), then
replaces its k drafts with token 0 (what the trunk will pick: accepted) for the first n* and
token 1 (rejected) after, n* drawn on the device with P(n* > i) = profile[i]. So the accepted
count per cycle follows the profile exactly, in the convention of `SpecStats.accept_per_pos`
(the fraction of cycles whose draft i was accepted), and the output stays AR's (all zeros).
"""
from __future__ import annotations

import contextlib

import torch

from specfire.runtime.drafters import HostDrafter, MtpDrafter

PROFILES = {"code": (0.90, 0.80, 0.70), "prose": (0.60, 0.40, 0.25)}


def random_head(cfg, device: str, dtype: torch.dtype):
    """An MTP head with seeded random weights (norm gains 0.1, matrices scaled by 1/sqrt(fan-in)),
    built on `device` without a CPU copy: the benches' stand-in for a trained head."""
    from specfire.model.qwen35 import MtpHead
    with torch.device("meta"):
        head = MtpHead(cfg)
    head = head.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for _, p in head.named_parameters():
            scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=dtype) * scale)
    return head


def write_tied_checkpoint(cfg, path: str, device: str, dtype: torch.dtype = torch.bfloat16,
                          max_shard_bytes: int = 4 << 30) -> str:
    """Random weights of `cfg` built on `device` with an MTP head, final norms -1, written to `path`."""
    from decode import build

    from specfire.train.export import export_checkpoint

    trunk = build(cfg, device, dtype)
    head = random_head(cfg, device, dtype)
    with torch.no_grad():
        trunk.norm.weight.fill_(-1.0)
        head.norm.weight.fill_(-1.0)
    with shard_by_shard():
        export_checkpoint(trunk, head, path, eos_ids=[cfg.vocab_size - 1], dtype=dtype, max_shard_bytes=max_shard_bytes)
    del trunk, head
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


@contextlib.contextmanager
def shard_by_shard():
    """Make `export_checkpoint` copy weights to host memory one shard at a time (it copies them
    all first): a 27B-shape checkpoint in /dev/shm plus a whole host copy would not fit in the
    1-GPU machine's 128 GB."""
    from specfire.train import export

    ct, sf = export.checkpoint_tensors, export.save_file

    def tensors(trunk, head, dtype):
        out = {(n if n == "lm_head.weight" else "model." + n): p.detach().to(dtype) for n, p in trunk.named_parameters()}
        out.update({"mtp." + n: p.detach().to(dtype) for n, p in head.named_parameters()})
        return out

    def save(shard, fn, metadata=None):
        sf({k: v.to("cpu").contiguous() for k, v in shard.items()}, fn, metadata=metadata)
    export.checkpoint_tensors, export.save_file = tensors, save
    try:
        yield
    finally:
        export.checkpoint_tensors, export.save_file = ct, sf


class ProfileDrafter(HostDrafter):
    """The MTP drafter's full cost, synthetic acceptance (see the module docstring). Needs the
    tied-norm checkpoint: the trunk's greedy token must be `right`."""

    name = "mtp"

    def __init__(self, inner: MtpDrafter, profile: tuple[float, ...], seed: int = 0, right: int = 0, wrong: int = 1):
        if any(b > a for a, b in zip(profile, profile[1:])) or not all(0.0 <= a <= 1.0 for a in profile):
            raise ValueError(f"profile must be non-increasing probabilities, got {profile}")
        self.inner, self.profile = inner, tuple(profile)
        dev = inner.head.fc.weight.device
        self.prof = torch.tensor(list(profile) + [0.0] * 16, device=dev)
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(seed)
        self.right, self.wrong = right, wrong

    def begin(self, prompt, hidden) -> None:
        self.inner.begin(prompt, hidden)

    def commit(self, out, hidden, out_dev) -> None:
        self.inner.commit(out, hidden, out_dev)

    def propose(self, last, pos, k, sp, gen, pen=None):
        drafts, _ = self.inner.propose(last, pos, k, sp, gen)       # the real head, fully paid
        kk = drafts.shape[0]
        u = torch.rand(1, generator=self.gen, device=drafts.device)
        keep = u < self.prof[:kk]                                  # a prefix: the profile does not increase
        return torch.where(keep, torch.full_like(drafts, self.right), torch.full_like(drafts, self.wrong)), None
