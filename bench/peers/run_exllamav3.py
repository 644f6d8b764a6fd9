"""ExLlamaV3 (PyPI `exllamav3` 1.6.x) on the unquantized checkpoint, through its own generator:
AR on the normal checkpoint (tokens feed the output check), then MTP k=1 and k=3 (its
`Qwen3_5MTPModel` head as the draft model) with every draft accepted. Its CUDA extension compiles
at first import.

The all-accepting case needs the trunk's and the head's final norms at -1 (the tied checkpoint).
Rather than load the weights a second time (54 GB on the 27B shape), the runner loads the head
after the AR runs and sets those two norm weights to -1 in place (ExLlamaV3 keeps Qwen3.5's norm
weight as stored and adds its constant bias 1 when it applies it, so this equals the tied
checkpoint); if that cannot be done, it loads the tied checkpoint instead. The recorded draft
acceptance shows either way whether every draft was accepted.

ExLlamaV3's text-only Qwen3.5 class reads weights under the multimodal releases' prefix
`model.language_model.` and registers no MTP head; the checkpoint here is the text layout
(`model.`, as transformers' Qwen3_5ForCausalLM reads it), so this runner subclasses its config and
model classes with prefix `model` and its own MTP head attached. The math is ExLlamaV3's.

    python -m bench.peers.run_exllamav3 --normal DIR --tied DIR --prompts P.json --tokens 128 --out R.json
"""
from __future__ import annotations

import gc
import importlib.util
import time

from bench.peers import common
from bench.peers.common import Result, load_prompts, peak_gb, reset_peak, runner_args

MODES = {"ar": ("normal", 0), "mtp1": ("tied", 1), "mtp3": ("tied", 3)}
PAGE = 256


def classes():
    from exllamav3.architecture.qwen3_5 import Qwen3_5BaseModel, Qwen3_5VLBaseConfig
    from exllamav3.architecture.qwen3_5_mtp import Qwen3_5MTPModel

    class TextConfig(Qwen3_5VLBaseConfig):
        arch_string = "Qwen3_5ForCausalLM"

        def __init__(self, directory: str, **kwargs):
            super().__init__(directory, None, TextModel, None, Qwen3_5MTPModel, **kwargs)

    class TextModel(Qwen3_5BaseModel):
        config_class = TextConfig

        def __init__(self, config, **kwargs):
            super().__init__(config=config, key_prefix="model", use_moe=False, **kwargs)

    return TextConfig


def load(path: str, mtp: bool, max_tokens: int):
    """(config, trunk, draft or None, trunk cache, draft cache or None, tokenizer), warmed up."""
    import torch
    from exllamav3 import Cache, Model, Tokenizer
    cfg = classes()(path)
    model = Model.from_config(cfg)
    draft = Model.from_config(cfg, component="mtp") if mtp else None
    cache = Cache(model, max_num_tokens=max_tokens, max_history=4, max_batch_size=1, recurrent_dtype=torch.half)
    dcache = load_draft(draft, max_tokens) if mtp else None
    model.load(progressbar=False, draft_model=draft)
    model.warmup(cache=cache)
    return cfg, model, draft, cache, dcache, Tokenizer.from_config(cfg)


def load_draft(draft, max_tokens: int):
    import torch
    from exllamav3 import Cache
    dcache = Cache(draft, max_num_tokens=max_tokens, max_history=4, max_batch_size=1, recurrent_dtype=torch.half)
    draft.load(progressbar=False)
    return dcache


def tie_in_place(model, draft) -> list[str]:
    """Set the trunk's final norm (the module before lm_head, as ExLlamaV3's MTP head finds it) and
    the head's final norm to -constant_bias: their output is 0, every logit 0, as the tied checkpoint."""
    from exllamav3.modules.rmsnorm import RMSNorm
    norms = [model.modules[model.logit_layer_idx - 1], draft.final_norm]
    for n in norms:
        if not isinstance(n, RMSNorm) or n.constant_bias != 1.0 or n.weight is None:
            raise RuntimeError(f"{getattr(n, 'key', n)}: not a loaded RMSNorm with constant bias 1")
    for n in norms:
        n.weight.data.fill_(-n.constant_bias)
    return [n.key for n in norms]


def run_mode(res: Result, m: str, model, draft, cache, dcache, tok, prompts: dict, tokens: int, ckpt: str) -> None:
    from exllamav3 import Generator
    k = MODES[m][1]
    res.put("progress", f"{m}: running")
    gen = Generator(model=model, cache=cache, tokenizer=tok, max_batch_size=1,
                    draft_model=draft if k else None, draft_cache=dcache if k else None,
                    num_draft_tokens=k or None)
    reset_peak()
    run_job(gen, prompts["warmup"], tokens)
    runs = [run_job(gen, p, tokens) for p in prompts["prompts"]]
    n_tok = sum(len(r["ids"]) - 1 for r in runs)
    dec = sum(r["decode_s"] for r in runs)
    acc = sum(r["accepted"] or 0 for r in runs)
    rej = sum(r["rejected"] or 0 for r in runs)
    res.mode(m, {"tok_s": n_tok / dec, "ttft_s": sum(r["ttft"] for r in runs) / len(runs),
                 "ttfts_s": [r["ttft"] for r in runs], "peak_gb": peak_gb(), "checkpoint": ckpt,
                 "tokens": tokens, "k": k, "draft_accept_rate": acc / (acc + rej) if acc + rej else None,
                 "cached_tokens": [r["cached_tokens"] for r in runs], "token_ids": [r["ids"] for r in runs],
                 "all_tokens_0": all(t == 0 for r in runs for t in r["ids"])})   # tied: every logit 0


def run_job(gen, ids: list[int], tokens: int) -> dict:
    import torch
    from exllamav3 import ArgmaxSampler, Job
    job = Job(input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=tokens, sampler=ArgmaxSampler(),
              stop_conditions=[])
    toks, t_first, t_end, final = [], None, None, {}
    t0 = time.perf_counter()
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") != "streaming":
                continue
            if "token_ids" in r:
                if t_first is None:
                    t_first = time.perf_counter()
                toks += r["token_ids"].flatten().tolist()
            if r.get("eos"):
                t_end, final = time.perf_counter(), r
    return {"ttft": t_first - t0, "decode_s": t_end - t_first, "ids": toks,
            "accepted": final.get("accepted_draft_tokens"), "rejected": final.get("rejected_draft_tokens"),
            "cached_tokens": final.get("cached_tokens")}


def main() -> None:
    args = runner_args(__doc__.split("\n")[0]).parse_args()
    res = Result(args.out, "exllamav3", None, device=common.device())
    prompts = load_prompts(args.prompts)
    modes = [m for m in (args.modes.split(",") if args.modes else MODES) if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        res.fail(f"unknown modes {bad}; known: {', '.join(MODES)}")
    if common.device() != "cuda":
        res.fail("needs CUDA: its kernels are a CUDA extension compiled at import (no GPU here)")
    if importlib.util.find_spec("exllamav3") is None:
        res.fail("the exllamav3 package is not importable (pass run.py --wheels with its wheels)")
    t0 = time.perf_counter()
    import exllamav3                                     # compiles the extension unless built already
    from exllamav3 import Model
    res.put("version", exllamav3.__version__ if hasattr(exllamav3, "__version__") else _version())
    res.put("import_s", time.perf_counter() - t0)
    longest = max(len(p) for p in [prompts["warmup"], *prompts["prompts"]]) + args.tokens + 64
    max_tokens = max(2048, -(-longest // PAGE) * PAGE)
    ar = [m for m in modes if MODES[m][0] == "normal"]
    mtp = [m for m in modes if MODES[m][0] == "tied"]
    loaded = None
    if ar:
        reset_peak()
        t0 = time.perf_counter()
        res.put("progress", "loading the normal checkpoint")
        loaded = load(args.normal, False, max_tokens)
        res.put("load_normal_s", time.perf_counter() - t0)
        res.put("load_normal_peak_gb", peak_gb())
        for m in ar:
            run_mode(res, m, *loaded[1:], prompts, args.tokens, "normal")
    if mtp:
        cfg, model, draft, cache, dcache, tok = loaded or (None,) * 6
        tied = None
        if loaded is not None:          # the head onto the loaded trunk, both final norms -1 in place
            try:
                t0 = time.perf_counter()
                res.put("progress", "loading the MTP head, tying the final norms in place")
                draft = Model.from_config(cfg, component="mtp")
                dcache = load_draft(draft, max_tokens)
                res.put("tied_in_place", tie_in_place(model, draft))
                res.put("load_draft_s", time.perf_counter() - t0)
                tied = "tied (final norms set to -1 in place on the loaded normal weights)"
            except Exception as e:        # noqa: BLE001 - any failure: fall back to the tied checkpoint
                res.put("tie_in_place_error", f"{type(e).__name__}: {e}"[:300])
        if tied is None:
            if loaded is not None:
                unload(model, draft)
            if args.tied is None:
                for m in mtp:
                    res.mode(m, {"error": "no --tied checkpoint given"})
                mtp = []
            else:
                reset_peak()
                t0 = time.perf_counter()
                res.put("progress", "loading the tied checkpoint")
                cfg, model, draft, cache, dcache, tok = load(args.tied, True, max_tokens)
                res.put("load_tied_s", time.perf_counter() - t0)
                tied = "tied"
        for m in mtp:
            run_mode(res, m, model, draft, cache, dcache, tok, prompts, args.tokens, tied)
    res.put("finished", time.time())


def unload(*models) -> None:
    for m in models:
        if m is not None:
            m.unload()
    gc.collect()


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("exllamav3")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
