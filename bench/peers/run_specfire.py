"""specfire through `LLM(...).generate` (CUDA graphs on a GPU): AR on the normal checkpoint (its
tokens feed the output check), MTP k=1 and k=3 on the tied one (every draft accepted: best case).

    python -m bench.peers.run_specfire --normal DIR --tied DIR --prompts P.json --tokens 128 --out R.json
"""
from __future__ import annotations

import gc
import time

from bench.peers import common
from bench.peers.common import Result, load_prompts, peak_gb, reset_peak, runner_args

MODES = {"ar": ("normal", "off", 0), "mtp1": ("tied", "mtp", 1), "mtp3": ("tied", "mtp", 3)}


def timed(llm, prompt: list[int], sp, spec) -> tuple[float, object]:
    """(seconds from the call to the first token on the host, the GenerationResult)."""
    t0 = time.perf_counter()
    ttft, res = None, None
    for chunk in llm.stream(prompt, sp, spec):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - t0
        res = chunk.result or res
    return ttft, res


def run_mode(llm, name: str, spec, prompts: dict, tokens: int, res: Result, ckpt: str) -> None:
    from specfire import SamplingParams
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    reset_peak()
    timed(llm, prompts["warmup"], sp, spec)             # graphs captured, kernels compiled
    n_tok, dec_s, ttfts, ids, acc = 0, 0.0, [], [], []
    for p in prompts["prompts"]:
        ttft, r = timed(llm, p, sp, spec)
        n_tok += r.stats["generated_tokens"] - 1
        dec_s += r.stats["decode_s"]
        ttfts.append(ttft)
        ids.append(r.token_ids)
        acc.append(r.stats.get("mean_accept_len"))
    res.mode(name, {"tok_s": n_tok / dec_s, "ttft_s": sum(ttfts) / len(ttfts), "ttfts_s": ttfts,
                    "peak_gb": peak_gb(), "checkpoint": ckpt, "tokens": tokens,
                    "mean_accept_len": acc[-1], "route": r.stats["route"], "k": r.stats["k"],
                    "graphs": llm.engine.trunk.graphs_enabled, "token_ids": ids})


def main() -> None:
    args = runner_args(__doc__.split("\n")[0]).parse_args()
    import specfire
    from specfire import LLM, SpecPolicy
    res = Result(args.out, "specfire", getattr(specfire, "__version__", None), device=common.device())
    prompts = load_prompts(args.prompts)
    modes = [m for m in (args.modes.split(",") if args.modes else MODES) if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        res.fail(f"unknown modes {bad}; known: {', '.join(MODES)}")
    need = max(len(p) for p in [prompts["warmup"], *prompts["prompts"]]) + args.tokens + 64
    for ckpt in ("normal", "tied"):
        todo = [m for m in modes if MODES[m][0] == ckpt]
        if not todo:
            continue
        path = args.normal if ckpt == "normal" else args.tied
        if path is None:
            for m in todo:
                res.mode(m, {"error": "no --tied checkpoint given"})
            continue
        t0 = time.perf_counter()
        reset_peak()
        with LLM(path, device=common.device(), progress=False, max_seq_len=need) as llm:
            res.put(f"load_{ckpt}_s", time.perf_counter() - t0)
            res.put(f"load_{ckpt}_peak_gb", peak_gb())
            for m in todo:
                _, route, k = MODES[m]
                spec = "off" if route == "off" else SpecPolicy(route, k)
                run_mode(llm, m, spec, prompts, args.tokens, res, ckpt)
        gc.collect()
        if common.device() == "cuda":
            import torch
            torch.cuda.empty_cache()
    res.put("finished", time.time())


if __name__ == "__main__":
    main()
