"""Teacher-forced evaluation of a trunk + MTP head on a token stream, and the packing of a
checkpoint into transfer-sized tar parts.

The held-out loss/perplexity and the MTP agreement figures of the model card come from here; so
does `bench/bundled_ppl.py`, which scores several checkpoints (any tokenizer) on the same text
(`total_nll`, also the unlikelihood phase's snapshot guard).
"""
from __future__ import annotations

import io
import math
import os
import tarfile

import torch

PART_BYTES = 15_000_000


def windows(data: torch.Tensor, seq_len: int, n: int, spread: bool = False) -> torch.Tensor:
    """[n, seq_len] non-overlapping windows of a 1-D stream: the first n, or n spread evenly over it."""
    total = (data.numel() - 1) // seq_len
    n = min(n, total)
    if n == 0:
        raise ValueError(f"stream has {data.numel()} tokens, fewer than one window of {seq_len}")
    idx = torch.linspace(0, total - 1, n).round().long() if spread else torch.arange(n)
    return data[: total * seq_len].view(total, seq_len)[idx]


@torch.no_grad()
def evaluate(trunk, head, wins: torch.Tensor, mtp_steps: int, device, autocast: bool, batch: int = 32) -> dict:
    """Mean LM loss, perplexity, trunk top-1 accuracy and MTP per-step accuracy / agreement with the
    trunk / chained agreement (the acceptance proxy) over the windows."""
    from .losses import compute_losses

    sums: dict[str, float] = {}
    n = wins.shape[0]
    for i in range(0, n, batch):
        ids = wins[i:i + batch].to(device)
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            lm, _, met = compute_losses(trunk, head, ids, mtp_steps, 0.0, want_metrics=True)
        met["lm_loss"] = lm.item()
        for k, v in met.items():
            sums[k] = sums.get(k, 0.0) + v * ids.shape[0]
    out = {k: v / n for k, v in sums.items()}
    out["ppl"] = math.exp(out["lm_loss"])
    chain = [out.get(f"mtp_chain{s}", 0.0) for s in range(1, mtp_steps + 1)]
    out["expected_accept_len"] = 1.0 + sum(chain)
    out["windows"] = n
    out["tokens"] = n * wins.shape[1]
    return out


def token_stream(tok, eot: int, docs: list[tuple[str, str]]) -> torch.Tensor:
    """The documents' ids, each followed by the end-of-text id, as one 1-D stream."""
    ids: list[int] = []
    for enc in getattr(tok, "encode_batch_fast", tok.encode_batch)([t for _, t in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def total_nll(trunk, ids: torch.Tensor, seq_len: int, device, batch: int, every: int = 1) -> tuple[float, int]:
    """(sum of -log p(token), tokens scored) over windows of seq_len overlapping by one token, so
    every token after the first is scored once (`bench/bundled_ppl.py`'s perplexity); every > 1
    scores only every such window (and no tail): a cheaper estimate on the same windows each time."""
    from . import model as tm

    step = seq_len - 1
    starts = list(range(0, ids.numel() - 1, step))
    full = [s for s in starts if s + seq_len <= ids.numel()][::every]
    tail = [s for s in starts if s + seq_len > ids.numel()] if every == 1 else []
    autocast = torch.device(device).type == "cuda"
    nll, count = 0.0, 0
    groups = [torch.stack([ids[s:s + seq_len] for s in full[i:i + batch]]) for i in range(0, len(full), batch)]
    groups += [ids[s:].unsqueeze(0) for s in tail]
    for g in groups:
        g = g.to(device)
        with torch.autocast(device_type=g.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = tm.lm_logits(trunk, tm.trunk_hidden(trunk, g)).float()
        nll += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 g[:, 1:].reshape(-1), reduction="sum").item()
        count += g[:, 1:].numel()
    return nll, count


def pack(src_dir: str, dest_dir: str, name: str = "model.tar", part_bytes: int = PART_BYTES) -> list[str]:
    """Tar `src_dir` (its files, flat) into `dest_dir` as `name.partNN` pieces of at most part_bytes
    (a transfer channel that takes files of limited size); rejoin with `cat name.part* > name`."""
    os.makedirs(dest_dir, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for f in sorted(os.listdir(src_dir)):
            p = os.path.join(src_dir, f)
            if os.path.isfile(p):
                tf.add(p, arcname=f)
    data = buf.getvalue()
    for f in os.listdir(dest_dir):
        if f.startswith(name + ".part"):
            os.remove(os.path.join(dest_dir, f))
    parts = []
    for i in range(0, len(data), part_bytes):
        fn = os.path.join(dest_dir, f"{name}.part{i // part_bytes:02d}")
        with open(fn + ".tmp", "wb") as fh:
            fh.write(data[i:i + part_bytes])
        os.replace(fn + ".tmp", fn)
        parts.append(fn)
    return parts
