"""What every bench shares: the real shapes, the bandwidth ceiling, timing, bytes a decode step
moves, JSON records, and random-weight checkpoints written in the HF layout.

Benches run from the repository root as modules (`python -m bench.headline`); this module is the
only one they import from bench/ (bench/README.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from specfire.config import FULL, LINEAR, ModelConfig
from specfire.runtime.drafters import HostDrafter

CEILING = 4.17e12   # the H200's device-to-device copy bandwidth, bytes read + written per second
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3.5 dense text shapes (reference geometry); every shape shares the fields of _COMMON.
_COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128)
SHAPES = {
    "0.8B": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True),
    "9B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    "27B": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False),
    # a CPU-sized model with every layer kind (bench/accuracy.py --shape mid)
    "mid": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=False,
                vocab_size=4096, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64),
    # CPU smoke runs: every layer kind, seconds to write and run
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
                 vocab_size=512, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16),
}


def model_config(shape: str, **override) -> ModelConfig:
    """The ModelConfig of a named shape (fields overridden by keyword): every fourth layer full
    attention, the rest Gated DeltaNet."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    s = {**_COMMON, **SHAPES[shape], **override}
    n = s["num_hidden_layers"]
    s.setdefault("layer_types", tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)))
    return ModelConfig(**s)


def random_trunk(cfg: ModelConfig, dev: str, dtype: torch.dtype, seed: int = 0):
    """A trunk module of cfg with seeded random weights, built on `dev` without a host copy (the
    benches that time the trunk without a checkpoint)."""
    from specfire.model.loader import build_trunk
    return _randomised(build_trunk, cfg, dev, dtype, seed)


def random_head(cfg: ModelConfig, dev: str, dtype: torch.dtype, seed: int = 1):
    """An MTP head of cfg with seeded random weights: the benches' stand-in for a trained head."""
    from specfire.model.loader import build_head
    return _randomised(build_head, cfg, dev, dtype, seed)


def _randomised(build, cfg, dev, dtype, seed):
    """build(cfg, the layers of `dev`) on the meta device, then filled on `dev` (the layers follow
    `dev`, not the meta device the module is built on: a CPU table on a GPU failed its first norm)."""
    from specfire.model.loader import one_device
    target = one_device(torch.device(dev))
    with torch.device("meta"):
        m = build(cfg, target)
    m = m.to(dtype).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=dtype) * scale)
    return m


# ---- devices and timing -----------------------------------------------------------------------

def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(dev: str | torch.device | None = None) -> None:
    if str(dev or device()).startswith("cuda"):
        torch.cuda.synchronize()


def graph_time(fns, iters: int = 20) -> float:
    """Seconds per call of fns[i % len(fns)] (rotate inputs past L2), replayed from one CUDA graph
    after a warm-up of every fn outside the capture; median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fns[i % len(fns)]()
    return replay_time(g, 1, reps=5) / iters


def capture(fn):
    """(graph, fn's output) of fn captured in a CUDA graph after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def replay_time(graph, n: int, reps: int = 1) -> float:
    """Seconds per replay of a captured CUDA graph, n replays back to back (median of reps)."""
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            graph.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / n)
    return sorted(ts)[len(ts) // 2]


def peak_gb() -> float | None:
    """Peak memory torch's CUDA allocator gave this process since reset_peak (GB)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 1e9


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


# ---- bytes a decode step moves -------------------------------------------------------------------

def state_bytes(cfg: ModelConfig, ctx: int, kv_bytes: int = 2) -> int:
    """The per-sequence state a decode step reads: KV to ctx, the GDN recurrent state (fp32) read and written."""
    kv = cfg.n_full * 2 * ctx * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    gdn = cfg.n_linear * 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return kv + gdn


def checkpoint_step_bytes(path: str, ctx: int, kv_bytes: int = 2) -> int:
    """Bytes one AR step moves for a checkpoint, from its safetensors headers: every trunk tensor once
    (the embedding: one row, or all of it as a tied lm_head; the MTP head not at all), plus state_bytes."""
    sizes: dict[str, int] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                head = json.loads(fh.read(n))
            sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__"})
    cfg = ModelConfig.from_dir(path)
    embed = sum(v for k, v in sizes.items() if k.startswith("model.embed_tokens."))
    trunk = sum(v for k, v in sizes.items() if not k.startswith(("mtp.", "model.embed_tokens.")))
    emb = embed // cfg.vocab_size if any(k.startswith("lm_head.") for k in sizes) else embed
    return trunk + emb + state_bytes(cfg, ctx, kv_bytes)


def config_step_bytes(cfg: ModelConfig, ctx: int, elem: int = 2) -> int:
    """The same from the config alone, every tensor `elem` bytes an element (bf16: 2)."""
    sizes = {n: elem * int(torch.Size(s).numel()) for n, s in checkpoint_layout(cfg, mtp=False)}
    embed = sizes.pop("model.embed_tokens.weight")
    return sum(sizes.values()) + (embed if cfg.tie_word_embeddings else embed // cfg.vocab_size) + state_bytes(cfg, ctx, elem)


def model_step_bytes(model: torch.nn.Module, cfg: ModelConfig, ctx: int, kv_bytes: int = 2) -> int:
    """The same for a trunk module in memory (its parameters but the embedding table, unless tied)."""
    w = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        w += sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" in n)
    return w + state_bytes(cfg, ctx, kv_bytes)


# ---- random-weight checkpoints ---------------------------------------------------------------------

def checkpoint_layout(cfg: ModelConfig, mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of an HF Qwen3.5 text checkpoint of cfg, the MTP head under mtp."""
    h, hd, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = 2 * hk * dk + hv * dv

    def attn(p: str) -> list:
        return [(p + "self_attn.q_proj.weight", (2 * cfg.num_attention_heads * hd, h)),
                (p + "self_attn.k_proj.weight", (kvh * hd, h)), (p + "self_attn.v_proj.weight", (kvh * hd, h)),
                (p + "self_attn.o_proj.weight", (h, cfg.num_attention_heads * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]

    def block(p: str) -> list:
        return [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                (p + "mlp.up_proj.weight", (cfg.intermediate_size, h)),
                (p + "mlp.down_proj.weight", (h, cfg.intermediate_size))]

    out = [("model.embed_tokens.weight", (cfg.vocab_size, h)), ("model.norm.weight", (h,))]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        out += block(p)
        if kind == FULL:
            out += attn(p)
        else:
            a = p + "linear_attn."
            out += [(a + "in_proj_qkv.weight", (qkv, h)), (a + "in_proj_z.weight", (hv * dv, h)),
                    (a + "in_proj_b.weight", (hv, h)), (a + "in_proj_a.weight", (hv, h)),
                    (a + "conv1d.weight", (qkv, 1, cfg.linear_conv_kernel_dim)), (a + "dt_bias", (hv,)),
                    (a + "A_log", (hv,)), (a + "norm.weight", (dv,)), (a + "out_proj.weight", (h, hv * dv))]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, h)))
    if mtp:
        out += [("mtp.fc.weight", (h, 2 * h)), ("mtp.pre_fc_norm_embedding.weight", (h,)),
                ("mtp.pre_fc_norm_hidden.weight", (h,)), ("mtp.norm.weight", (h,))]
        out += block("mtp.layers.0.") + attn("mtp.layers.0.")
    return out


FINAL_NORMS = ("model.norm.weight", "mtp.norm.weight")
NORMS_FILE = "model-norms.safetensors"    # the final norms' own shard: a tied copy links every other one
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_checkpoint(path: str, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, dev: str | None = None,
                     tied: bool = False, seed: int = 0, shard_bytes: int = 2 << 30) -> str:
    """Seeded random weights of cfg (with an MTP head) as an HF checkpoint in `path`, each tensor drawn
    on `dev` and written straight to its shard, shards in parallel. Norm gains and 1-D tensors are
    0.1 N(0,1), matrices N(0,1)/sqrt(fan-in). tied: both final norms -1; Qwen3.5's norms are
    zero-centred, so their output is 0, every logit ties and greedy picks token 0 after every row,
    the trunk's and the head's alike: every MTP draft is accepted (the best case of speculation)."""
    dev = dev or device()
    os.makedirs(path, exist_ok=True)
    layout = checkpoint_layout(cfg)
    elem = torch.tensor([], dtype=dtype).element_size()
    shards: list[list] = [[]]
    size = 0
    for name, shape in layout:
        if name in FINAL_NORMS:
            continue
        nb = elem * int(torch.Size(shape).numel())
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nb
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    files.append(NORMS_FILE)
    shards.append([(n, s) for n, s in layout if n in FINAL_NORMS])

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        if tied and name in FINAL_NORMS:
            return torch.full(shape, -1.0, dtype=dtype)
        g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        scale = 0.1 if len(shape) == 1 else shape[-1] ** -0.5
        return (torch.randn(shape, generator=g, device=dev, dtype=dtype) * scale).cpu()

    def write(fn: str, items: list) -> None:
        header, off = {}, 0
        for name, shape in items:
            nb = elem * int(torch.Size(shape).numel())
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        header["__metadata__"] = {"format": "pt"}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(path, fn), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for name, shape in items:
                f.write(tensor(name, shape).contiguous().reshape(-1).view(torch.uint8).numpy().data)

    with ThreadPoolExecutor(8) as pool:
        for fut in [pool.submit(write, fn, sh) for fn, sh in zip(files, shards)]:
            fut.result()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fn for fn, sh in zip(files, shards) for n, _ in sh}}, f)
    eos = cfg.vocab_size - 1
    body = dataclasses.replace(cfg, mtp_num_hidden_layers=1, eos_token_ids=(eos,)).to_hf_text_dict()
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    body.update(dtype={torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype],
                full_attention_interval=full[0] + 1 if full else 1, attn_output_gate=True, pad_token_id=eos)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(body, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos], "pad_token_id": eos, "do_sample": False}, f)
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer.json with one token `<i>` per id, for engines and servers that need a
    tokenizer beside random weights (prompts stay token ids; streamed text is the ids' names)."""
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>")).save(
        os.path.join(path, "tokenizer.json"))


def tied_copy(src: str, dst: str) -> str:
    """dst: the checkpoint src with both final norms -1 (every draft accepted, see write_checkpoint),
    its shards symbolic links to src's but the norms' own, so a second 54 GB copy is not needed."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f == NORMS_FILE:
            norms = load_file(os.path.join(src, f))
            save_file({k: torch.full_like(v, -1.0) for k, v in norms.items()}, os.path.join(dst, f),
                      metadata={"format": "pt"})
        elif f.endswith(".safetensors"):
            os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(dst, f))
        elif os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst


def quantize(src: str, dst: str, *args: str) -> float:
    """`specfire quantize src dst [args]` (the command users run); returns its seconds."""
    from specfire.cli import main as specfire_main

    t = time.perf_counter()
    if specfire_main(["quantize", src, dst, *args]) != 0:
        raise SystemExit(f"specfire quantize {src} {dst} failed")
    return time.perf_counter() - t


def scratch_dir() -> str:
    """Where a large checkpoint goes: /dev/shm (RAM) when there is one, the 1-GPU machine's disk being small."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """n random token ids, avoiding 0, 1 and the last id (eos of the random checkpoints)."""
    return torch.randint(2, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- results -----------------------------------------------------------------------------------

class Log:
    """One JSON line per record, on stdout and appended to OUT/<name> when an output folder is given,
    so a run cut short keeps what it measured."""

    def __init__(self, out: str | None, name: str):
        self.path = os.path.join(out, name) if out else None
        if out:
            os.makedirs(out, exist_ok=True)

    def __call__(self, stage: str, **kw) -> dict:
        row = {"stage": stage, **kw}
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def md5(ids: list[int]) -> str:
    return hashlib.md5(json.dumps(ids).encode()).hexdigest()


def machine() -> dict:
    """The device, torch and the commit measured (git's short hash when this is a checkout)."""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
            "python": sys.version.split()[0]}


# ---- prompts and acceptance -------------------------------------------------------------------------

def held_out_prompts(n: int, lines: int, source: str = "packages") -> list[tuple[str, str]]:
    """Up to n code prompts the bundled model never trained on (specfire/train/corpus.py): in each
    held-out file (one package after another, largest files first), the `lines` lines ending at the
    first `def` line past the file's middle."""
    from specfire.train.corpus import held_out_sources

    docs = held_out_sources()[source]
    if source == "packages":
        by: dict[str, list] = {}
        for rel, text in sorted(docs, key=lambda d: -len(d[1])):
            by.setdefault(rel.split("/")[0], []).append((rel, text))
        queues, docs = [by[k] for k in sorted(by)], []
        while any(queues):
            docs += [q.pop(0) for q in queues if q]
    out = []
    for rel, text in docs:
        ls = text.splitlines(keepends=True)
        for i in range(len(ls) // 2, len(ls)):
            if ls[i].lstrip().startswith("def ") and ls[i].rstrip().endswith(":"):
                out.append((rel, "".join(ls[max(0, i - lines + 1):i + 1])))
                break
        if len(out) == n:
            break
    return out


PROFILES = {"code": (0.90, 0.80, 0.70), "prose": (0.60, 0.40, 0.25)}   # P(draft i accepted), i = 1..3


class ProfileDrafter(HostDrafter):
    """SYNTHETIC acceptance, for benchmarks only: the model's own MTP drafter runs in full (its cost
    is paid), then its drafts become token 0 (what a tied checkpoint's trunk picks: accepted) for
    the first n* and token 1 (rejected) after, n* drawn on the device with P(n* > i) = profile[i].
    Needs a write_checkpoint(tied=True) model; the output stays AR's."""

    name = "mtp"

    def __init__(self, inner, profile: tuple[float, ...], seed: int = 0, right: int = 0, wrong: int = 1):
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
        u = torch.rand(1, generator=self.gen, device=drafts.device)
        keep = u < self.prof[:drafts.shape[0]]                      # a prefix: the profile does not increase
        return torch.where(keep, torch.full_like(drafts, self.right), torch.full_like(drafts, self.wrong)), None
