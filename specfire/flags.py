"""The flags that load a model and set default sampling (`specfire run`, `serve`), vLLM's
spellings beside specfire's, and the error wording that names a flag instead of a field."""
from __future__ import annotations

import argparse
import json
import sys

from .config import GENERATION_CONFIG_MODES
from .errors import SpecfireError
from .params import DTYPE_NAMES, MAX_SPEC_K, SPEC_MODES, SpecPolicy


def add_model_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    """The flags that load a model (run, serve): the checkpoint positionally or with --model."""
    if positional:
        p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--model", "-m", dest="model_flag", default=None, metavar="PATH",
                   help="the checkpoint, as a flag" + (" (same as the positional MODEL)" if positional else ""))
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree")
    p.add_argument("--tp-invariant", action="store_true",
                   help="compute the bits every --tp degree computes, one device included (slower decode on "
                        "one device; a mesh's trunk always does, this also makes its MTP drafts agree)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, metavar="DTYPE", help=f"{_dtype_help()} (default: auto)")
    p.add_argument("--kv-dtype", default="auto", help="auto | bf16 | fp32 | q8")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=None, metavar="N",
                   help="context in tokens (default: the model's, at most 32768 on GPU and 8192 on CPU)")
    p.add_argument("--spec", default=None, choices=SPEC_MODES, help="speculation mode (default: auto)")
    p.add_argument("--spec-k", type=int, default=None, help=f"draft length k, 1..{MAX_SPEC_K} (default: 3)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form of --spec / --spec-k / --ngram-n: '{\"method\": \"mtp\", "
                        "\"num_speculative_tokens\": 3}'; method mtp (or a model's *_mtp name), ngram (with "
                        "prompt_lookup_min / prompt_lookup_max), auto or off")
    p.add_argument("--mtp-path", default=None, help="MTP head sidecar safetensors (default: in or beside the checkpoint)")
    p.add_argument("--eager", action="store_true", help="launch kernels eagerly (no CUDA graphs)")
    p.add_argument("--ngram-n", default=None, metavar="MIN:MAX",
                   help="suffix lengths the n-gram drafter looks up (default: 1:4)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the MTP drafter scores token ids 0..N-1 only (a cheaper draft lm_head; output is "
                        "unchanged, acceptance may drop); default: the whole vocabulary")
    add_generation_config_arg(p)


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """How many requests run at once (serve): vLLM's --max-num-seqs and a KV memory budget."""
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="requests that run at once, each in its own sequence slot; more wait in arrival order "
                        "(default: 8 on a GPU, 4 on a CPU)")
    p.add_argument("--kv-cache-memory-bytes", default=None, metavar="BYTES",
                   help="memory of the KV cache, e.g. 17179869184 or 16G: on one device a pool of 64-position "
                        "blocks the requests take as they grow (a request waits until the pool can promise the "
                        "blocks its prompt and max_tokens may reach); on a tensor-parallel mesh per rank, each "
                        "rank's pool of its KV heads' shard (default: --max-num-seqs whole sequences, on a GPU "
                        "no more than leave 10%% of its memory free)")


def check_batch_flags(args: argparse.Namespace) -> None:
    """--max-num-seqs and --kv-cache-memory-bytes, checked before the model loads."""
    from .params import check_max_num_seqs, parse_bytes

    try:
        check_max_num_seqs(getattr(args, "max_num_seqs", None))
        parse_bytes(getattr(args, "kv_cache_memory_bytes", None))
    except ValueError as e:
        raise flagged(e) from None


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                   help="auto: the checkpoint's generation_config.json sets the sampling (temperature, top_p, "
                        "top_k, min_p, the penalties, max_new_tokens) that a request or flag leaves unset; none: "
                        "specfire's built-in values (what vLLM's 'vllm' setting does)")


def add_penalty_args(p: argparse.ArgumentParser, what: str = "") -> None:
    """--repetition-penalty / --presence-penalty / --frequency-penalty (vLLM's meanings). Unset,
    each takes the model's generation_config.json value, else its neutral value; `what` says
    whose default that is (" for requests that leave the field out")."""
    def default(neutral: str) -> str:
        return f" (default{what}: the model's generation_config.json value, else {neutral})"

    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide the positive logits of the token ids already in the prompt or the output by R "
                        "and multiply the negative ones by R; 1 is off" + default("1"))
    p.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help="subtract P (-2..2) from the logit of every token id already generated; 0 is off"
                        + default("0"))
    p.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="subtract F (-2..2) times its count so far from the logit of every token id already "
                        "generated; 0 is off" + default("0"))


def penalty_kw(args: argparse.Namespace) -> dict[str, float]:
    """The penalty flags given (a flag left out is not in the dict)."""
    kw = {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
          "frequency_penalty": args.frequency_penalty}
    return {k: v for k, v in kw.items() if v is not None}


def model_defaults_line(llm, fields: list[str], off: str = "--generation-config none") -> str:
    """The startup line that says which defaults the model's generation_config.json set (as vLLM
    logs that the model's generation config overrode its default sampling parameters)."""
    gd = llm.generation_defaults
    notes = "".join(f"; {n}" for n in gd.notes if "temperature" in fields)
    return (f"[specfire] default sampling from the model's generation_config.json: {gd.text(fields)}{notes} "
            f"({off} for the built-in defaults)")


# the flag behind each field a ValueError names first, so CLI errors speak of flags
FLAGS = {"max_tokens": "-n/--max-tokens", "temperature": "-t/--temperature", "top_p": "--top-p",
         "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed", "stop": "--stop", "spec.k": "--spec-k",
         "spec.mode": "--spec", "tp": "--tp", "device": "--device", "dtype": "--dtype", "kv_dtype": "--kv-dtype",
         "max_seq_len": "--max-seq-len", "ngram": "--ngram-n", "draft_vocab": "--draft-vocab",
         "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "max_num_seqs": "--max-num-seqs",
         "kv_cache_memory_bytes": "--kv-cache-memory-bytes", "tp_invariant": "--tp-invariant"}


def flagged(e: ValueError) -> ValueError:
    """The same error with its leading field name replaced by the flag that sets it."""
    msg = str(e)
    field, sep, rest = msg.partition(" ")
    return ValueError(f"{FLAGS[field]} {rest}") if sep and field in FLAGS else e


def model_path(args: argparse.Namespace) -> str | None:
    pos, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if pos is not None and flag is not None and pos != flag:
        raise ValueError(f"two models given ({pos!r} and --model {flag!r}); give one")
    return pos if pos is not None else flag


def _dtype_help() -> str:
    """What --dtype accepts, from the names LLM(dtype=...) takes (params.DTYPE_NAMES)."""
    by: dict[str, list[str]] = {}
    for name, target in DTYPE_NAMES.items():
        if target is not None and name != target:
            by.setdefault(target, []).append(name)
    return ", ".join(f"{t} ({', '.join(a)})" for t, a in by.items()) + " or auto: bfloat16 on a GPU, float32 on a CPU"


def load_model(args: argparse.Namespace):
    if args.dtype is not None and args.dtype not in DTYPE_NAMES:     # before torch loads
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {args.dtype!r}")
    spec, ngram = spec_flags(args)
    from .api import LLM

    try:
        return LLM(model_path(args), tp=args.tp, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                   max_seq_len=args.max_seq_len, spec=spec, mtp_path=args.mtp_path, progress=sys.stderr.isatty(),
                   cuda_graphs=False if args.eager else None, ngram=ngram, draft_vocab=args.draft_vocab,
                   generation_config=getattr(args, "generation_config", "auto"),
                   max_num_seqs=getattr(args, "max_num_seqs", None),
                   kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None),
                   tp_invariant=args.tp_invariant)
    except SpecfireError:
        raise
    except ValueError as e:
        raise flagged(e) from None


def spec_flags(args: argparse.Namespace) -> tuple[SpecPolicy, tuple[int, int]]:
    """The load-time speculation policy and n-gram sizes: from --spec / --spec-k / --ngram-n, or
    from vLLM's --speculative-config (not both)."""
    if getattr(args, "speculative_config", None) is None:
        try:
            spec = SpecPolicy(mode=args.spec or "auto", k=3 if args.spec_k is None else args.spec_k)
        except ValueError as e:
            raise flagged(e) from None
        return spec, _ngram_range(args.ngram_n or "1:4")
    for flag, v in (("--spec", args.spec), ("--spec-k", args.spec_k), ("--ngram-n", args.ngram_n)):
        if v is not None:
            raise ValueError(f"--speculative-config and {flag} both set the speculation; give one")
    return speculative_config(args.speculative_config)


SPEC_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_config(text: str) -> tuple[SpecPolicy, tuple[int, int]]:
    """vLLM's --speculative-config JSON as (SpecPolicy, n-gram sizes): method mtp (or a model's
    `*_mtp` name, as vLLM maps them), ngram, auto or off; num_speculative_tokens is k; the n-gram
    drafter looks up suffixes of prompt_lookup_min..prompt_lookup_max tokens (one given: both)."""
    flag = "--speculative-config"
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{flag} must be a JSON object like '{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}', "
                         f"got {text!r}")
    unknown = sorted(set(d) - set(SPEC_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{flag} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SPEC_CONFIG_KEYS)}")
    method = d.get("method")
    mode = "mtp" if isinstance(method, str) and method.endswith("_mtp") else method
    if mode not in SPEC_MODES:
        raise ValueError(f"{flag} method must be mtp (or a model's *_mtp name), ngram, auto or off, got {method!r}")
    ints = {}
    for key in SPEC_CONFIG_KEYS[1:]:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{flag} {key} must be a positive integer, got {v!r}")
        ints[key] = v
    k = ints["num_speculative_tokens"]
    if k is not None and k > MAX_SPEC_K:
        raise ValueError(f"{flag} num_speculative_tokens must be <= {MAX_SPEC_K}, got {k}")
    lo, hi = ints["prompt_lookup_min"], ints["prompt_lookup_max"]
    if (lo is not None or hi is not None) and mode not in ("ngram", "auto"):
        raise ValueError(f"{flag} prompt_lookup_min / prompt_lookup_max apply to method ngram or auto, not {method!r}")
    lo, hi = (lo or hi, hi or lo) if lo is not None or hi is not None else (1, 4)
    if lo > hi:
        raise ValueError(f"{flag} prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
    return SpecPolicy(mode=mode, k=3 if k is None else k), (lo, hi)


def _ngram_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecfireError(f"--ngram-n must be MIN:MAX (two integers), got {text!r}") from None
    return lo, hi
