"""Hugging Face transformers `generate`, greedy, on the normal checkpoint: the reference
implementation as its users run it, with flash-linear-attention's kernels for the Gated DeltaNet
layers when `fla` is importable. Modes:
  eager           the default dynamic cache
  static_compile  `cache_implementation="static"`: generate then compiles the decode step with
                  torch.compile (mode reduce-overhead: CUDA graphs) on a GPU; on a CPU it does not
                  compile (transformers compiles on accelerators only), the row says so
TTFT is a 1-token generate; decode tok/s = (N - 1) / (time of an N-token generate - TTFT). The
warm-up and the N-token generates carry a counting streamer (`Progress`: generate copies each
step's token to the host for it) so a run cut by its time limit says how far it got.

    python -m bench.peers.run_transformers --normal DIR --prompts P.json --tokens 64 --out R.json
"""
from __future__ import annotations

import importlib.util
import inspect
import time

from bench.peers import common
from bench.peers.common import Result, load_prompts, peak_gb, reset_peak, runner_args, sync

MODES = ("eager", "static_compile")


def gdn_kernel() -> str:
    """Where transformers' chunked Gated DeltaNet resolves to: fla's kernel or the torch fallback."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq
    fn = getattr(mq, "torch_chunk_gated_delta_rule", None)
    impl = None
    while fn is not None and impl is None:
        try:
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            break
        fn = getattr(fn, "__wrapped__", None) if impl is None else None
    if impl is None:
        return "unknown"
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"


class Progress:
    """A `generate` streamer that only counts tokens and, at most every 5 s, writes how far the
    call got into the result's `progress` (a run cut by its time limit then says where it was).
    It keeps no tokens: generate hands it each step's token already on the host."""

    def __init__(self, res: Result, t_mode: float):
        self.res, self.t_mode, self.label, self.n, self.count, self.t_write = res, t_mode, "", 0, -1, 0.0

    def start(self, label: str, n: int) -> "Progress":
        self.label, self.n, self.count, self.t_call = label, n, -1, time.perf_counter()
        self.write(force=True)
        return self

    def put(self, value) -> None:          # first call: the prompt; then one call per new token
        self.count += 1
        if self.count == 1:
            self.t_first = time.perf_counter() - self.t_call
        self.write(force=self.count == 1)

    def end(self) -> None:
        self.write(force=True)

    def write(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.t_write < 5:
            return
        self.t_write = now
        first = f", first token after {self.t_first:.1f} s" if self.count >= 1 else ""
        self.res.put("progress", f"{self.label}: {max(self.count, 0)} of {self.n} tokens after "
                                 f"{now - self.t_call:.0f} s{first} ({now - self.t_mode:.0f} s into the mode)")


def gen(model, ids, n: int, static: bool, progress: Progress | None = None):
    import torch
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
              pad_token_id=model.generation_config.pad_token_id, eos_token_id=None)
    if static:
        kw.update(cache_implementation="static")
    if progress is not None:
        kw.update(streamer=progress)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=model.device), attention_mask=None, **kw)
    toks = out[0, len(ids):].tolist()       # the host read waits for the device
    return time.perf_counter() - t0, toks


def main() -> None:
    args = runner_args(__doc__.split("\n")[0]).parse_args()
    import torch
    import transformers
    fla = importlib.util.find_spec("fla")
    res = Result(args.out, "transformers", transformers.__version__, device=common.device(),
                 fla=None if fla is None else _version("flash-linear-attention"))
    prompts = load_prompts(args.prompts)
    modes = [m for m in (args.modes.split(",") if args.modes else MODES) if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        res.fail(f"unknown modes {bad}; known: {', '.join(MODES)}")
    from transformers import AutoModelForCausalLM
    dev = common.device()
    t0 = time.perf_counter()
    reset_peak()
    cfg_dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    # on a GPU the weights go straight to the device (device_map needs accelerate, which the GPU
    # machine has); on a CPU a plain load
    kw = {"device_map": dev} if dev == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(args.normal, dtype=cfg_dtype, **kw)
    model.eval()
    res.put("load_s", time.perf_counter() - t0)
    res.put("load_peak_gb", peak_gb())
    res.put("gdn_kernel", gdn_kernel())
    res.put("model_class", type(model).__name__)
    res.put("progress", f"loaded in {time.perf_counter() - t0:.0f} s")
    n = args.tokens
    for m in modes:
        static = m == "static_compile"
        reset_peak()
        t_warm = time.perf_counter()
        prog = Progress(res, t_warm)
        # compiles (static) / autotunes; static: the full length first, so the static cache is sized
        # once and the timed calls reuse it (a new cache would mean a new compiled graph mid-timing);
        # the dynamic cache needs no full-length warm-up: its prefill and step shapes are the same
        nw = n if static else min(n, 8)
        gen(model, prompts["warmup"], nw, static, prog.start(f"{m}: warm-up generate ({nw} tokens)", nw))
        gen(model, prompts["warmup"], 1, static, prog.start(f"{m}: warm-up generate (1 token)", 1))
        warm_s = time.perf_counter() - t_warm
        res.put("progress", f"{m}: warm-up ({nw} + 1 tokens) done in {warm_s:.0f} s")
        ttfts, dec_s, n_tok, ids = [], 0.0, 0, []
        compiled = static and dev == "cuda" and not model.generation_config.disable_compile
        for i, p in enumerate(prompts["prompts"]):
            t1, _ = gen(model, p, 1, static)
            tn, toks = gen(model, p, n, static, prog.start(f"{m}: timed prompt {i + 1} ({n} tokens)", n))
            ttfts.append(t1)
            dec_s += max(tn - t1, 1e-9)
            n_tok += len(toks) - 1
            ids.append(toks)
            # saved after every prompt: a run cut by its time limit keeps the prompts it finished
            res.mode(m, {"tok_s": n_tok / dec_s, "ttft_s": sum(ttfts) / len(ttfts), "ttfts_s": ttfts,
                         "peak_gb": peak_gb(), "checkpoint": "normal", "tokens": n, "warmup_s": warm_s,
                         "static_cache": static, "compiled": compiled, "token_ids": ids, "warmup_tokens": nw,
                         "prompts_done": len(ids), "prompts_total": len(prompts["prompts"])})
    res.put("finished", time.time())


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "installed (version unknown)"


if __name__ == "__main__":
    main()
