"""`specfire bench battery`: the five-prompt serving battery, one JSON line per prompt on stdout.

With --url it drives a running server; otherwise it loads MODEL itself. --identity runs the
battery with speculation off and on (and at tp 1 and --tp N when N > 1, in process, both
tp-invariant) and ends with one JSON line saying whether every content md5 matched; the exit
status is 1 when one did not."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..params import SPEC_MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    b = sub.add_parser("battery", help="five fixed prompts; quality flags and md5s per prompt")
    b.add_argument("model", nargs="?", default=None, help="checkpoint to load (default: the bundled model); "
                                                          "ignored with --url")
    b.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    b.add_argument("--api-key", default=None)
    b.add_argument("--served-model-name", default=None, help="model id to send to the server")
    b.add_argument("--max-tokens", "-n", type=int, default=256)
    b.add_argument("--spec", default=None, choices=SPEC_MODES,
                   help="speculation mode per request (default: the server's / the loaded model's default)")
    b.add_argument("--spec-k", type=int, default=3)
    b.add_argument("--identity", action="store_true",
                   help="run with speculation off and on (and tp 1 and N) and compare content md5s")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel degree for the in-process model")
    b.add_argument("--tp-invariant", action="store_true",
                   help="load with the bits every tp degree computes (implied by --identity with --tp N > 1, "
                        "whose tp 1 run must compute the mesh's bits)")
    b.add_argument("--device", default=None)
    b.add_argument("--dtype", default=None)
    b.add_argument("--max-seq-len", type=int, default=None)


def _print(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main(args: argparse.Namespace) -> int:
    from . import battery

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not (1 <= args.spec_k <= 10):
        raise ValueError(f"--spec-k must be in 1..10, got {args.spec_k}")
    cells: dict[str, list[dict[str, Any]]] = {}

    def run_cell(label: str, runner: Any, spec: dict[str, Any] | None, extra: dict[str, Any]) -> None:
        rows = battery.run_battery(runner, args.max_tokens, spec)
        for r in rows:
            _print({"cell": label, **extra, **r})
        cells[label] = rows

    if args.url is not None:
        def remote(name: str, prompt: str, n: int, spec: dict[str, Any] | None) -> dict[str, Any]:
            return battery.run_server(args.url, name, prompt, n, spec, args.api_key, args.served_model_name)

        if args.identity:
            for mode in ("off", args.spec or "auto"):
                run_cell(f"spec={mode}", remote, {"mode": mode, "k": args.spec_k}, {"spec": mode})
        else:
            spec = None if args.spec is None else {"mode": args.spec, "k": args.spec_k}
            run_cell("server", remote, spec, {"spec": args.spec})
    else:
        from ..api import LLM

        tps = [1, args.tp] if args.identity and args.tp > 1 else [args.tp]
        invariant = args.tp_invariant or len(tps) > 1
        for tp in tps:
            with LLM(args.model, tp=tp, device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len,
                     spec={"mode": "auto", "k": args.spec_k}, progress=False, tp_invariant=invariant) as llm:
                def local(name: str, prompt: str, n: int, spec: dict[str, Any] | None, llm=llm) -> dict[str, Any]:
                    return battery.run_local(llm, name, prompt, n, spec)

                if args.identity:
                    on = args.spec or ("mtp" if llm.mtp_loaded else "ngram")
                    modes = ["off", on] if on != "off" else ["off"]
                    for mode in modes:
                        run_cell(f"tp={tp},spec={mode}", local, {"mode": mode, "k": args.spec_k},
                                 {"tp": tp, "spec": mode})
                else:
                    spec = None if args.spec is None else {"mode": args.spec, "k": args.spec_k}
                    run_cell(f"tp={tp}", local, spec, {"tp": tp, "spec": args.spec})
    if args.identity:
        rep = battery.identity_report(cells)
        _print(rep)
        return 0 if rep["identity"] else 1
    return 0
