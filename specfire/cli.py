"""`specfire run | info | serve | daemon | bench | quantize | train`.

Errors caused by the user's input print one line to stderr and exit non-zero, no traceback."""
from __future__ import annotations

import argparse
import json
import os
import logging
import sys
import traceback
from typing import Callable, NoReturn

from .config import GENERATION_CONFIG_MODES, SamplingParams, SpecPolicy, SPEC_MODES
from .errors import SpecfireError


def add_model_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    """The flags that load a model (run, serve): the checkpoint positionally or with --model."""
    if positional:
        p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--model", "-m", dest="model_flag", default=None, metavar="PATH",
                   help="the checkpoint, as a flag" + (" (same as the positional MODEL)" if positional else ""))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--kv-dtype", default="auto", help="auto | bf16 | fp32 | q8")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context in tokens (default: the model's, at most 32768 on GPU and 8192 on CPU)")
    p.add_argument("--spec", default="auto", choices=SPEC_MODES, help="speculation mode")
    p.add_argument("--spec-k", type=int, default=3, help="draft length k (1..10)")
    p.add_argument("--mtp-path", default=None, help="MTP head sidecar safetensors (default: in or beside the checkpoint)")
    p.add_argument("--eager", action="store_true", help="launch kernels eagerly (no CUDA graphs)")
    p.add_argument("--ngram-n", default="1:4", metavar="MIN:MAX", help="suffix lengths the n-gram drafter looks up")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the MTP drafter scores token ids 0..N-1 only (a cheaper draft lm_head; output is "
                        "unchanged, acceptance may drop); default: the whole vocabulary")
    add_generation_config_arg(p)


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                   help="auto: the checkpoint's generation_config.json sets the sampling (temperature, top_p, "
                        "top_k, min_p, the penalties, max_new_tokens) that a request or flag leaves unset; none: "
                        "specfire's built-in values (what vLLM's 'vllm' setting does)")


def add_penalty_args(p: argparse.ArgumentParser, what: str = "") -> None:
    """--repetition-penalty / --presence-penalty / --frequency-penalty (vLLM's meanings). Unset,
    each takes the model's generation_config.json value, else its neutral value."""
    model = ", else the model's generation_config.json value, else "
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the positive logits of token ids already in the prompt or output by this "
                        "(multiply negative ones); 1 is off" + what + model + "1")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="subtract this from the logit of every token id already generated (-2..2; 0 is off)"
                        + what + model + "0")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract this times its count from the logit of every token id already generated "
                        "(-2..2; 0 is off)" + what + model + "0")


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
         "frequency_penalty": "--frequency-penalty"}


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


def load_model(args: argparse.Namespace):
    from .api import LLM

    try:
        spec = SpecPolicy(mode=args.spec, k=args.spec_k)
        ngram = _ngram_range(args.ngram_n)
        return LLM(model_path(args), tp=args.tp, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                   max_seq_len=args.max_seq_len, spec=spec, mtp_path=args.mtp_path, progress=sys.stderr.isatty(),
                   cuda_graphs=False if args.eager else None, ngram=ngram, draft_vocab=args.draft_vocab,
                   generation_config=getattr(args, "generation_config", "auto"))
    except SpecfireError:
        raise
    except ValueError as e:
        raise flagged(e) from None


def _ngram_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecfireError(f"--ngram-n must be MIN:MAX (two integers), got {text!r}") from None
    return lo, hi


# ---- run ----------------------------------------------------------------------------------------

def _run_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text (default: read stdin)")
    # unset sampling flags take the model's generation_config.json value, else RUN_DEFAULTS
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="tokens to generate at most (default: the model's max_new_tokens, else 128)")
    p.add_argument("-t", "--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep the k likeliest tokens (0: all; default: the model's, else 0)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min-p times the likeliest (default: the model's, else 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_penalty_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")


# `specfire run`'s built-in sampling: greedy, 128 tokens, no truncation, no penalty
RUN_DEFAULTS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def run_given(args: argparse.Namespace) -> dict:
    """The sampling fields `specfire run`'s flags set (a flag left out is not in the dict)."""
    kw = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "top_k": args.top_k, "min_p": args.min_p, **penalty_kw(args)}
    return {k: v for k, v in kw.items() if v is not None}


def _run(args: argparse.Namespace) -> int:
    given = run_given(args)
    try:
        SamplingParams(**given, seed=args.seed, stop=args.stop)   # bad flags fail before the model loads
    except ValueError as e:
        raise flagged(e) from None
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise SpecfireError("empty prompt: pass --prompt TEXT or pipe text on stdin")
    with load_model(args) as llm:
        gd = llm.generation_defaults
        sp = SamplingParams(**{**RUN_DEFAULTS, **gd.as_dict(), **given}, seed=args.seed, stop=args.stop)
        from_model = gd.overriding(given, RUN_DEFAULTS)
        if from_model:
            print(model_defaults_line(llm, from_model), file=sys.stderr, flush=True)
        if args.chat:
            prompt = llm.render_chat([{"role": "user", "content": prompt}])
        res = None
        for chunk in llm.stream(prompt, sp):
            if not args.json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            res = chunk.result
        assert res is not None
        fig = llm.figures(res, sp)
        if args.json:
            print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                              "context_limited": fig.context_limited, "stats": res.stats}))
        else:
            sys.stdout.write("\n")
        print(fig.summary(), file=sys.stderr)
    return 0


# ---- info ---------------------------------------------------------------------------------------

def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--json", action="store_true")


def _info(args: argparse.Namespace) -> int:
    from .info import describe, format_info

    d = describe(args.model)
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return 0


# ---- dispatch -----------------------------------------------------------------------------------

def _lazy(module: str, fn: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module, __package__), fn)(args)
    return call


def _lazy_args(module: str, fn: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        import importlib

        getattr(importlib.import_module(module, __package__), fn)(p)
    return add


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "run": ("generate text from a prompt", _run_args, _run),
    "info": ("describe a checkpoint", _info_args, _info),
}


def register(name: str, help_: str, module: str) -> None:
    """Subcommands implemented elsewhere: `module` has add_arguments(parser) and main(args) -> int."""
    COMMANDS[name] = (help_, _lazy_args(module, "add_arguments"), _lazy(module, "main"))


register("serve", "OpenAI-compatible HTTP server", ".serve.http")
register("daemon", "JSON-lines daemon on stdin/stdout", ".serve.daemon")
register("bench", "benchmarks (battery)", ".serve.bench")
register("quantize", "turn an HF checkpoint into a specfire 4-bit checkpoint", ".quantize")
register("train", "train the bundled model (needs a GPU)", ".train.cli")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has a meaningful one (not None, not a bare switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or d == [] or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (the default prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="specfire", description="Qwen3.5 inference with lossless MTP speculation", formatter_class=_Help)
    ap.add_argument("-v", "--verbose", action="store_true", help="log to stderr; tracebacks on errors")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: $OMP_NUM_THREADS if set, else 1)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, formatter_class=_Help)
        try:
            add(p)
        except ImportError as e:  # a subcommand whose module this build lacks
            p.set_defaults(_unavailable=f"'{name}' is not available in this build ({e})")
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _set_threads(n: int | None) -> None:
    """One intra-op thread unless told otherwise. Single-stream decode is a chain of small ops.
    `specfire --threads T run --prompt "def fibonacci(n):" --spec off -n 64 --json` on the 2-core
    CPU, bundled model: idle machine, decode 215 tok/s at T = 1 and at T = 2; cores shared with
    other jobs (load ~7.7), 50.4 tok/s at T = 1 and 4.1 at T = 2, where the second thread's
    spin-waits stall every op."""
    if n is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        n = 1
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="[specfire] %(message)s", stream=sys.stderr)
    if getattr(args, "_unavailable", None):
        print(f"specfire: error: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        _set_threads(args.threads)
        return COMMANDS[args.command][2](args)
    except (SpecfireError, ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):  # `specfire run ... | head`: the reader left, not an error
            sys.stderr.close()
            return 0
        if args.verbose:
            traceback.print_exc()
        print(f"specfire: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
