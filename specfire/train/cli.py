"""`specfire train`: train the bundled model from this interpreter's Python sources (needs a GPU for
the full preset; `--preset tiny --device cpu` runs the whole pipeline in seconds)."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from .config import PRESETS, TrainConfig

_OVERRIDABLE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_head_dim", "steps", "batch_size", "seq_len", "lr", "min_lr_frac", "warmup",
                "weight_decay", "mtp_steps", "mtp_weight", "mtp_distill", "seed", "eval_windows",
                "time_limit_s", "stop_after_steps", "max_files", "deadline_s", "reserve_s", "probe_steps",
                "checkpoint_every_s", "tokenizer_sample_bytes", "max_train_bytes",
                "ul_steps", "ul_time_s", "ul_lr", "ul_warmup", "ul_token_weight", "ul_seq_weight", "ul_ngram",
                "ul_prompt_min", "ul_prompt_max", "ul_new_tokens", "ul_pool", "ul_batch", "ul_data_batch",
                "ul_snapshots", "ul_eval_prompts", "ul_kl_weight", "ul_select", "ul_ppl_budget", "ul_ppl_every",
                "ul_select_tokens", "ul_probe_steps", "ul_word_bans", "ul_min_lr_frac", "ul_val_permille",
                "ul_val_prompts", "ul_line_ngram", "ul_select_phrase", "ul_anneal_s", "ul_anneal_steps", "ul_anneal_lr", "ul_anneal_snapshots",
                "snip_steps", "snip_time_s", "snip_lr", "snip_warmup", "snip_min_lr_frac", "snip_probe_steps",
                "snip_rows", "snip_data_rows", "snip_nested", "snip_blank_frac", "snip_snapshots",
                "snip_import_frac", "snip_rows2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--preset", default="bundled", choices=sorted(PRESETS), help="shape and schedule preset")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--corpus-root", default=None, help="directory of .py sources (default: this Python's stdlib)")
    p.add_argument("--extra-corpus-root", action="append", default=[],
                   help="another stdlib tree (e.g. a CPython Lib/ with its test suite); adds the files whose "
                        "relative path the main root lacks (repeatable)")
    p.add_argument("--corpus", default=None, choices=("stdlib", "site"),
                   help="stdlib: the standard library; site: it plus every permissively licensed package "
                        "of site-packages (default: the preset's)")
    p.add_argument("--held-out-packages", default=None,
                   help="comma-separated distributions held out of a site corpus (default: corpus.HELD_OUT_PACKAGES)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from this checkpoint (its weights and tokenizer) and run only the unlikelihood "
                        "phase (preset bundled-ul) or the definition-snippet phase (preset bundled-snip); e.g. "
                        "--init specfire/bundled")
    p.add_argument("--pack-dir", default=None,
                   help="also write every exported checkpoint here as model.tar.partNN pieces of 15 MB")
    types = {f.name: f.type for f in fields(TrainConfig)}
    for name in _OVERRIDABLE:
        kind = float if "float" in str(types[name]) else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"override the preset's {name}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import torch

    kw = dict(PRESETS[args.preset])
    for name in _OVERRIDABLE:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if args.corpus:
        kw["corpus"] = args.corpus
    if args.held_out_packages is not None:
        kw["held_out_packages"] = tuple(x.strip() for x in args.held_out_packages.split(",") if x.strip())
    if args.init is not None:
        if not os.path.isfile(os.path.join(args.init, "config.json")):
            raise ValueError(f"--init {args.init!r} is not a checkpoint directory (no config.json)")
        if not (kw.get("ul_steps") or kw.get("snip_steps")):
            raise ValueError(f"--init needs a preset with a fine-tune phase (bundled-ul, bundled-snip) or "
                             f"--ul-steps / --snip-steps N; preset {args.preset!r} has none")
        kw["init"] = args.init
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {dev} requested but CUDA is not available")
    return TrainConfig(out=args.out, preset=args.preset, device=dev, corpus_root=args.corpus_root,
                       extra_corpus_roots=tuple(args.extra_corpus_root), pack_dir=args.pack_dir, **kw)


def main(args: argparse.Namespace) -> int:
    from .train import run

    run(config_from_args(args))
    return 0
