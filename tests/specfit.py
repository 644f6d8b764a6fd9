"""A tiny model fitted so that speculation really gets accepted, for the speculative-decoding tests.

A random tiny trunk is unpredictable, so drafts are almost always rejected and only the rejection
path would be tested. Here the trunk is fitted (transformers, autograd) on a synthetic second-order
corpus: over an alphabet of A tokens, x[t] = RULE[x[t-2], x[t-1]], with a little noise. Its greedy
output then follows the rule and cycles, which n-gram lookup predicts. The MTP head is then fitted
on its own (our MtpHead module with autograd, trunk frozen) to predict the trunk's argmax at p+1
from the trunk's post-norm hidden at p and the token at p+1, exactly the input it gets at decode
time. Step 1 of the chain ends up almost always right; later steps (fed the head's own output,
which it was never trained on) only sometimes, so cycles mix full and partial accepts.

Also: a one-character-per-token tokenizer, so stop strings can be tested on tiny checkpoints.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from tinymodels import BASE, load_hf, make_checkpoint, mtp_tensors

ALPHABET = 12          # tokens the corpus uses
NOISE = 0.1            # chance that a corpus token is random instead of following the rule
TRUNK_STEPS = 60
MTP_STEPS = 200
_SEED = 1

_cache: dict[str, str] = {}


def _rule(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(_SEED)
    alpha = torch.randperm(vocab - 1, generator=g)[:ALPHABET]      # never the EOS id (vocab - 1)
    rule = torch.randint(0, ALPHABET, (ALPHABET, ALPHABET), generator=g)
    return alpha, rule


def corpus(n: int, length: int, seed: int, vocab: int = BASE["vocab_size"], noise: float = NOISE) -> torch.Tensor:
    """n sequences [n, length] of token ids following the rule (with `noise`)."""
    alpha, rule = _rule(vocab)
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, length, dtype=torch.long)
    x[:, :2] = torch.randint(0, ALPHABET, (n, 2), generator=g)
    for t in range(2, length):
        x[:, t] = rule[x[:, t - 2], x[:, t - 1]]
        flip = torch.rand(n, generator=g) < noise
        x[flip, t] = torch.randint(0, ALPHABET, (int(flip.sum()),), generator=g)
    return alpha[x]


def prompts(n: int, length: int = 8, seed: int = 100) -> list[list[int]]:
    """Prompts from the corpus distribution (noise-free)."""
    return corpus(n, length, seed, noise=0.0).tolist()


def _fit_trunk(path: str) -> None:
    torch.manual_seed(_SEED)
    m = load_hf(path)
    m.train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(TRUNK_STEPS):
        x = corpus(8, 32, seed=10_000 + step)
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    m.save_pretrained(path, safe_serialization=True)


def fit_mtp_head(path: str, steps: int = MTP_STEPS) -> dict[str, torch.Tensor]:
    """Fit the MTP head of the checkpoint at `path` to its (frozen) trunk; return the mtp.* tensors."""
    from specfire import LLM

    llm = LLM(path, device="cpu", spec="mtp", progress=False)
    trunk, head = llm.engine.trunk, llm.engine.drafters["mtp"].head
    data = []
    with torch.inference_mode():
        for s in corpus(48, 40, seed=20_000):
            trunk.begin()
            rows = trunk.prefill(s, logits="all")
            data.append((s, rows.hidden, rows.logits.argmax(-1)))
    data = [(s.clone(), h.clone(), t.clone()) for s, h, t in data]   # out of inference mode
    emb, lmw = trunk.model.embed_tokens.weight, trunk.model.lm_weight
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.zeros(())
        for j in range(4):
            ids, hid, tgt = data[(4 * step + j) % len(data)]
            st = head.new_state(len(ids), torch.float32)
            _, post = head(emb[ids[1:]], hid[:-1], 0, st, rows=False)   # row p: (h_p, x_{p+1}) -> argmax at p+1
            loss = loss + torch.nn.functional.cross_entropy(post @ lmw.t(), tgt[1:])
        loss.backward()
        opt.step()
    out = {"mtp." + n: p.detach().clone().contiguous() for n, p in head.named_parameters()}
    llm.close()
    return out


def fitted_checkpoint(root: str) -> str:
    """The fitted tiny model (base config, MTP head in model.safetensors), built once under `root`:
    processes sharing `root` (the xdist workers of a run) take turns on a lock, and the first
    builds it in a folder of its own that it renames into place, so no one reads a half-made one."""
    if "fitted" in _cache and os.path.exists(_cache["fitted"]):
        return _cache["fitted"]
    path = os.path.join(str(root), "fitted")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}"
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            _build_fitted(tmp)
            os.rename(tmp, path)
    _cache["fitted"] = path
    return path


def _build_fitted(path: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny tensors: one thread is as fast and does not fight the others
    try:
        make_checkpoint(path, "base")
        _fit_trunk(path)
        st = os.path.join(path, "model.safetensors")
        tensors = load_file(st)
        tensors.update(mtp_tensors(BASE["hidden_size"], BASE, 0))      # start from a random head
        save_file(tensors, st, metadata={"format": "pt"})
        tensors.update(fit_mtp_head(path))
        save_file(tensors, st, metadata={"format": "pt"})
    finally:
        torch.set_num_threads(threads)


def char_vocab(n: int) -> list[str]:
    """n distinct one-character tokens."""
    out = []
    for base, count in ((0x41, 26), (0x61, 26), (0x3B1, 25), (0x430, 32), (0x5D0, 27), (0x4E00, 10_000)):
        out.extend(chr(base + i) for i in range(count))
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"char_vocab supports up to {len(out)} tokens")


def add_char_tokenizer(path: str, vocab_size: int) -> None:
    """Write a tokenizer.json where token i is one character, so text = concatenated characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = char_vocab(vocab_size)
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(path, "tokenizer.json"))


def variant(src: str, dst: str, eos: int | None = None, tokenizer: bool = False, mtp_sidecar: bool = False) -> str:
    """A copy of checkpoint `src` (weights symlinked) with another EOS id, a char tokenizer, or the
    MTP tensors moved to mtp.safetensors beside the trunk."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f in ("model.safetensors",) and mtp_sidecar:
            continue
        s, d = os.path.join(src, f), os.path.join(dst, f)
        if not os.path.exists(d):
            os.symlink(s, d)
    if mtp_sidecar:
        t = load_file(os.path.join(src, "model.safetensors"))
        save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, os.path.join(dst, "model.safetensors"),
                  metadata={"format": "pt"})
        save_file({k: v for k, v in t.items() if k.startswith("mtp.")}, os.path.join(dst, "mtp.safetensors"),
                  metadata={"format": "pt"})
    if eos is not None:
        g = os.path.join(dst, "generation_config.json")
        if os.path.islink(g):
            os.unlink(g)
        with open(g, "w") as f:
            json.dump({"eos_token_id": [eos]}, f)
        c = os.path.join(dst, "config.json")
        with open(os.path.realpath(c)) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        os.unlink(c)
        with open(c, "w") as f:
            json.dump(cfg, f)
    if tokenizer:
        from specfire.config import ModelConfig
        add_char_tokenizer(dst, ModelConfig.from_dir(dst).vocab_size)
    return dst


def spy_drafts(llm) -> tuple[object, list[list[int]]]:
    """Record every draft the MTP drafter proposes: (the drafter, the log: one list of draft ids per
    propose). Undo with `del drafter.propose` (the spy is an instance attribute over the method)."""
    d = llm.engine.drafters["mtp"]
    log, real = [], d.propose

    def wrapped(*a):
        out, q = real(*a)
        log.append(out.tolist())
        return out, q
    d.propose = wrapped
    return d, log
