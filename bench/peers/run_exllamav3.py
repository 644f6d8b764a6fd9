"""ExLlamaV3 (PyPI `exllamav3` 1.6.x) on the unquantized checkpoint, through its own generator:
AR on the normal checkpoint (tokens feed the output check), MTP k=1 and k=3 (its `Qwen3_5MTPModel`
head as the draft model) on the tied one. Its CUDA extension compiles at first import.

ExLlamaV3's text-only Qwen3.5 class reads weights under the multimodal releases' prefix
`model.language_model.` and registers no MTP head; the checkpoint here is the text layout
(`model.`, as transformers' Qwen3_5ForCausalLM reads it), so this runner subclasses its config and
model classes with prefix `model` and its own MTP head attached. The math is ExLlamaV3's.

    python bench/peers/run_exllamav3.py --normal DIR --tied DIR --prompts P.json --tokens 128 --out R.json
"""
from __future__ import annotations

import gc
import importlib.util
import time

import common
from common import Result, load_prompts, peak_gb, reset_peak, runner_args

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
    import torch
    from exllamav3 import Cache, Model, Tokenizer
    cfg = classes()(path)
    model = Model.from_config(cfg)
    draft = Model.from_config(cfg, component="mtp") if mtp else None
    cache = Cache(model, max_num_tokens=max_tokens, max_history=4, max_batch_size=1, recurrent_dtype=torch.half)
    dcache = Cache(draft, max_num_tokens=max_tokens, max_history=4, max_batch_size=1,
                   recurrent_dtype=torch.half) if mtp else None
    if draft is not None:
        draft.load(progressbar=False)
    model.load(progressbar=False, draft_model=draft)
    model.warmup(cache=cache)
    return cfg, model, draft, cache, dcache, Tokenizer.from_config(cfg)


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
    from exllamav3 import Generator
    res.put("version", exllamav3.__version__ if hasattr(exllamav3, "__version__") else _version())
    res.put("import_s", time.perf_counter() - t0)
    longest = max(len(p) for p in [prompts["warmup"], *prompts["prompts"]]) + args.tokens + 64
    max_tokens = max(2048, -(-longest // PAGE) * PAGE)
    for ckpt in ("normal", "tied"):
        todo = [m for m in modes if MODES[m][0] == ckpt]
        if not todo:
            continue
        path = args.normal if ckpt == "normal" else args.tied
        if path is None:
            for m in todo:
                res.mode(m, {"error": "no --tied checkpoint given"})
            continue
        reset_peak()
        t0 = time.perf_counter()
        cfg, model, draft, cache, dcache, tok = load(path, ckpt == "tied", max_tokens)
        res.put(f"load_{ckpt}_s", time.perf_counter() - t0)
        res.put(f"load_{ckpt}_peak_gb", peak_gb())
        for m in todo:
            k = MODES[m][1]
            gen = Generator(model=model, cache=cache, tokenizer=tok, max_batch_size=1,
                            draft_model=draft if k else None, draft_cache=dcache if k else None,
                            num_draft_tokens=k or None)
            reset_peak()
            run_job(gen, prompts["warmup"], args.tokens)
            runs = [run_job(gen, p, args.tokens) for p in prompts["prompts"]]
            n_tok = sum(len(r["ids"]) - 1 for r in runs)
            dec = sum(r["decode_s"] for r in runs)
            acc = sum(r["accepted"] or 0 for r in runs)
            rej = sum(r["rejected"] or 0 for r in runs)
            res.mode(m, {"tok_s": n_tok / dec, "ttft_s": sum(r["ttft"] for r in runs) / len(runs),
                         "ttfts_s": [r["ttft"] for r in runs], "peak_gb": peak_gb(), "checkpoint": ckpt,
                         "tokens": args.tokens, "k": k, "draft_accept_rate": acc / (acc + rej) if acc + rej else None,
                         "cached_tokens": [r["cached_tokens"] for r in runs], "token_ids": [r["ids"] for r in runs]})
            del gen
        for m_ in (model, draft):
            if m_ is not None:
                m_.unload()
        del cfg, model, draft, cache, dcache, tok
        gc.collect()
    res.put("finished", time.time())


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("exllamav3")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
