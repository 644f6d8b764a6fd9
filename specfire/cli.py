"""`specfire run | info | serve | daemon | bench | quantize | train`.

Errors caused by the user's input print one line to stderr and exit non-zero, no traceback. The
parser imports only the module of the subcommand it is given, and no torch: `--help` and a flag
error answer at once; torch loads when the command runs."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from typing import Callable, NoReturn

from .errors import SpecfireError
# the model and sampling flags, also used by serve/http.py (imported from here)
from .flags import add_model_args, add_penalty_args, flagged, load_model, model_defaults_line, penalty_kw  # noqa: F401
from .params import SamplingParams


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
            prompt = llm.chat_ids([{"role": "user", "content": prompt}])     # typed control tokens stay text
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

class MissingPackage(SpecfireError):
    """A subcommand needs a package this environment lacks."""


# pip names for a missing module where they differ from it, or where its siblings go with it
INSTALL = {"fastapi": "fastapi uvicorn", "uvicorn": "fastapi uvicorn", "starlette": "fastapi"}


def missing_package(command: str, e: ImportError) -> SpecfireError:
    """The error for a module `specfire COMMAND` failed to import: a package to install, or a part
    of specfire this build lacks."""
    name = (e.name or "").split(".")[0]
    if not name or name == __package__:
        return SpecfireError(f"'{command}' is not available in this build ({_one_line(e)})")
    return MissingPackage(f"'specfire {command}' needs the Python package {name}, which is not installed: "
                          f"pip install {INSTALL.get(name, name)}")


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


def add_global_args(p: argparse.ArgumentParser, after_command: bool = False) -> None:
    """-v and --threads, before the subcommand or (`after_command`) after it; there they set
    nothing when left out, so they cannot undo the same flag given before."""
    unset = {"default": argparse.SUPPRESS} if after_command else {}
    p.add_argument("-v", "--verbose", action="store_true", help="log to stderr; tracebacks on errors", **unset)
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: one for a model on a CPU, unless "
                                               "$OMP_NUM_THREADS is set)", **unset)


def command_of(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word that is neither a global flag nor --threads' value."""
    value = False
    for a in argv:
        if value:
            value = False
        elif a.startswith("-"):
            value = a.startswith("--t") and "--threads".startswith(a)     # argparse takes --thr for --threads
        else:
            return a
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given `argv`, only the subcommand it names gets its flags, so no
    other subcommand's module is imported (raises MissingPackage when that module cannot be)."""
    ap = _Parser(prog="specfire", description="Qwen3.5 inference with lossless MTP speculation", formatter_class=_Help)
    add_global_args(ap)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else command_of(argv)
    for name, (help_, add, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, formatter_class=_Help)
        add_global_args(p, after_command=True)
        if argv is not None and name != chosen:
            continue
        try:
            add(p)
        except ImportError as e:
            err = missing_package(name, e)
            if argv is not None:
                raise err from None
            p.set_defaults(_unavailable=str(err))
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def apply_threads(n: int | None) -> None:
    """--threads N: the process's intra-op threads (threads.set_threads); left out, a model on a CPU
    gets the API's default (threads.default_threads)."""
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    from .threads import set_threads

    set_threads(n)


def log_to_stderr(verbose: bool) -> None:
    """specfire's log lines on stderr: INFO and up with -v, else warnings; the same in the server's
    engine process (serve/engine.py), which gets -v with the serve flags."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="[specfire] %(message)s",
                        stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except SpecfireError as e:
        print(f"specfire: error: {_one_line(e)}", file=sys.stderr)
        return 2
    log_to_stderr(args.verbose)
    if getattr(args, "_unavailable", None):
        print(f"specfire: error: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        apply_threads(args.threads)
        return COMMANDS[args.command][2](args)
    except (SpecfireError, ValueError, OSError, ModuleNotFoundError) as e:
        if isinstance(e, BrokenPipeError):  # `specfire run ... | head`: the reader left, not an error
            sys.stderr.close()
            return 0
        if isinstance(e, ModuleNotFoundError):
            e = missing_package(args.command, e)
        if args.verbose:
            traceback.print_exc()
        print(f"specfire: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
