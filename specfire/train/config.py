"""The trainer's settings: TrainConfig (one typed record of every option) and the named presets.

`bundled` is the pretraining recipe of the shipped weights; `bundled-ul` adds the unlikelihood
fine-tune phase (finetune.py) and, with `init`, runs that phase alone on an existing checkpoint.
`bundled-snip` runs the definition-snippet fine-tune (snippet_phase.run_snippet_phase) from `init`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import FULL, LINEAR, ModelConfig
from .corpus import HELD_OUT_PACKAGES

PRESETS: dict[str, dict] = {
    # the shipped model: 12 layers in the real 3:1 pattern on a 4096-token vocabulary, trained on the
    # `site` corpus (the stdlib + permissive site-packages) for a wall-clock budget: the cosine
    # schedule's length is fixed from the step time measured after `probe_steps` steps so it ends
    # when the budget does (`steps` caps it; the run's metrics record the length it chose).
    "bundled": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=12,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                    steps=20000, batch_size=128, seq_len=512, lr=2.5e-3, min_lr_frac=0.05, warmup=100,
                    corpus="site", deadline_s=520.0, reserve_s=40.0, checkpoint_every_s=150.0),
    # `bundled` then the unlikelihood phase; with --init DIR only the phase, from DIR's weights. The
    # shipped weights: `--init` from the `bundled` run's weights (finetune.py; MODEL_CARD.md).
    "bundled-ul": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=12,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                       steps=20000, batch_size=128, seq_len=512, lr=2.5e-3, min_lr_frac=0.05, warmup=100,
                       corpus="site", deadline_s=520.0, reserve_s=40.0, checkpoint_every_s=150.0,
                       ul_steps=5000, ul_time_s=150.0),
    # the first bundled model (stdlib only, 8 layers, vocab 8192): planned for 2200 steps, stopped by
    # a 360 s limit after step 2107; stop_after_steps replays that schedule.
    "stdlib-v1": dict(vocab_size=8192, hidden_size=256, intermediate_size=640, num_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                      steps=2200, stop_after_steps=2107, batch_size=64, seq_len=512, lr=2e-3, warmup=150),
    # the definition-snippet fine-tune (snippet_phase.run_snippet_phase) alone from --init: corpus rows (LM +
    # MTP) mixed with rows of definition blocks each ended by end-of-text (snippets.py), the snapshot
    # the validation rule picks (select.py, on top-level definition prompts of files set aside) exported.
    "bundled-snip": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=64,
                         steps=20000, batch_size=128, seq_len=512, lr=2.5e-3, min_lr_frac=0.05, warmup=100,
                         corpus="site", max_train_bytes=64_000_000, snip_steps=20000, snip_time_s=180.0,
                         ul_select=1, ul_ppl_budget=0.03, ul_ppl_every=1, ul_select_phrase=2.0,
                         ul_val_permille=30, ul_val_prompts=64, ul_eval_prompts=32),
    # a CPU smoke test of the whole pipeline
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=1, linear_num_value_heads=2, linear_head_dim=32,
                 steps=8, batch_size=4, seq_len=128, lr=3e-3, warmup=2, eval_windows=8, max_files=60),
}


@dataclass
class TrainConfig:
    out: str
    preset: str = "bundled"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 12
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 64
    rope_theta: float = 10_000_000.0
    steps: int = 2200
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_steps: int = 3
    mtp_weight: float = 0.3
    mtp_distill: float = 0.5
    seed: int = 0
    device: str = "cuda"
    eval_windows: int = 256
    time_limit_s: float = 0.0           # 0: none; otherwise stop training early (recorded in metrics)
    stop_after_steps: int = 0           # 0: none; otherwise stop after this many steps of the `steps` schedule
    corpus: str = "stdlib"              # stdlib | site (stdlib + permissive site-packages, corpus.py)
    held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES
    deadline_s: float = 0.0             # 0: none; else the whole run ends by this many seconds after start:
    reserve_s: float = 75.0             #   training stops reserve_s before it (eval + export), and the
    probe_steps: int = 30               #   schedule length is fitted to the budget after probe_steps steps
    checkpoint_every_s: float = 0.0     # 0: none; else export (and pack) an interim checkpoint this often
    pack_dir: str | None = None         # also pack every export into tar parts here (pack())
    tokenizer_sample_bytes: int = 48_000_000
    max_train_bytes: int = 320_000_000  # a larger corpus is subsampled by file (corpus.subsample)
    corpus_root: str | None = None
    extra_corpus_roots: tuple[str, ...] = ()
    max_files: int | None = None
    extra: dict = field(default_factory=dict)
    # ---- unlikelihood fine-tune phase (finetune.py), after pretraining or from `init` -----------------
    init: str | None = None             # start from this checkpoint (weights + tokenizer): no pretraining
    ul_steps: int = 0                   # 0: no UL phase; else its step count (a cap when ul_time_s is set)
    ul_time_s: float = 0.0              # wall-clock budget of the UL phase (0: none)
    ul_lr: float = 5e-4
    ul_warmup: int = 10
    ul_probe_steps: int = 8
    ul_token_weight: float = 0.25       # token-level UL on corpus batches
    ul_seq_weight: float = 1.0          # sequence-level UL on the model's greedy continuations
    ul_seq_anchor: bool = True          # anchored to the phase's starting model (unlikelihood.py); False:
                                        #   the plain -log(1 - p) loss, which degenerated (MODEL_CARD.md)
    ul_seq_ban: bool = True             # anchored target without EVERY token that would complete a repeated
                                        #   n-gram (unlikelihood.banned_anchored_unlikelihood); False: only
                                        #   the written token at repeated positions (the target then pulls a
                                        #   model that stopped repeating back towards the repeat)
    ul_ngram: int = 6                   # a continuation token inside a repeated n-gram is penalised (code
                                        #   BPE: 6 tokens ~ half a line; real code has 9% of tokens in repeated
                                        #   6-grams within 160 tokens, 15% in 4-grams)
    ul_prompt_min: int = 16             # rollout prompts: tokens from a `def` / `class` line of the corpus,
    ul_prompt_max: int = 48             #   one length per pool drawn from [min, max]
    ul_new_tokens: int = 160
    ul_pool: int = 512                  # rollouts per pool (regenerated when used up)
    ul_batch: int = 128                 # rollouts per step
    ul_data_batch: int = 64             # corpus windows per step
    ul_snapshots: int = 2               # interim exports (packed as ul-N.tar) at even fractions of the phase
    ul_eval_prompts: int = 128          # held-out prompts for the repetition log (0: no log)
    ul_eval_prompt_tokens: int = 24
    ul_kl_weight: float = 0.0           # KL(starting model || model) on the corpus batches (perplexity guard)
    ul_select: int = 0                  # 1: score each snapshot (select.py) and end on the rule's pick,
                                        #   exporting only it (and the last weights as last.tar if they differ)
    ul_ppl_budget: float = 0.05         # the rule's held-out perplexity budget over the starting model
    ul_ppl_every: int = 4               # the snapshot perplexity scores every Nth window of the held-out text
    ul_select_tokens: int = 160         # greedy tokens per prompt when scoring a snapshot (the benchmark's)
    ul_word_bans: int = 0               # 1: never ban a token that continues a word (unlikelihood.word_edges):
                                        #   repeats are refused where a new word or symbol starts
    ul_line_ngram: int = 0              # > 0: also ban what would repeat an n-gram of this length within the
                                        #   same line (unlikelihood.line_repeat_continuations: phrase loops)
    ul_select_phrase: float = 0.0       # the rule's figure adds this x the validation phrase-loop line share
    ul_min_lr_frac: float = 0.1         # the UL phase's cosine ends at this fraction of ul_lr
    ul_val_permille: int = 30           # ul_select: training files (a salted path hash) set aside as the
    ul_val_prompts: int = 64            #   validation set the rule scores (its prompts and its perplexity):
                                        #   never trained on in the phase, never the benchmark's or held-out text
    ul_anneal_s: float = 0.0            # a second phase after UL (0: none): LM + MTP + KL on corpus batches only,
    ul_anneal_steps: int = 0            #   lr linear from ul_anneal_lr to 0 over ul_anneal_s seconds (or
    ul_anneal_lr: float = 2e-4          #   ul_anneal_steps steps when no time is set), scored (ul_select) at
    ul_anneal_snapshots: int = 2        #   ul_anneal_snapshots even fractions of it (the last at its end)

    # ---- definition-snippet fine-tune phase (snippet_phase.run_snippet_phase, snippets.py), from `init`
    snip_steps: int = 0                 # 0: no snippet phase; else its step count (a cap when snip_time_s is set)
    snip_time_s: float = 0.0            # wall-clock budget of the phase (0: none)
    snip_lr: float = 3e-4               # peak lr (linear warmup, cosine to snip_min_lr_frac x it)
    snip_warmup: int = 20
    snip_min_lr_frac: float = 0.1
    snip_probe_steps: int = 10          # timed steps before the schedule is fitted to snip_time_s
    snip_rows: int = 16                 # snippet rows per step (definition blocks + end-of-text from position 0)
    snip_data_rows: int = 48            # whole-file corpus rows per step (the pretraining packing)
    snip_nested: int = 1                # 1: also methods / nested defs, dedented to column 0; 0: top level only
    snip_blank_frac: float = 0.25       # share of blocks that end with two blank lines before end-of-text
    snip_import_frac: float = 0.1       # share of top-level blocks shown after their file's imports (snippets.corpus_blocks)
    snip_rows2: int = 0                 # > 0: a second arm, the same phase again from the start weights with this many
                                        #   snippet rows (and as many fewer corpus rows); the rule picks over both arms
    snip_snapshots: int = 6             # scored snapshots (ul_select) at even fractions of the phase
    snip_val_kind: str = "top"          # the rule's validation prompts: "top" = the first 1-4 lines of top-level
                                        #   def / class blocks of the validation files; "any" = ul_val_prompts'
                                        #   token cuts at any def / class line (the UL phase's)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "steps", "batch_size",
                     "seq_len", "mtp_steps", "eval_windows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"train option {name} must be a positive integer, got {v!r}")
        if self.num_layers % 4:
            raise ValueError(f"train option num_layers must be a multiple of 4 (3:1 GDN:attention), got {self.num_layers}")
        if self.seq_len < self.mtp_steps + 3:
            raise ValueError(f"train option seq_len must be at least mtp_steps + 3, got {self.seq_len}")
        if self.corpus not in ("stdlib", "site"):
            raise ValueError(f"train option corpus must be 'stdlib' or 'site', got {self.corpus!r}")
        if not 0.0 <= self.mtp_distill <= 1.0:
            raise ValueError(f"train option mtp_distill must be in [0, 1], got {self.mtp_distill}")
        for name in ("snip_steps", "snip_warmup", "snip_rows", "snip_data_rows", "snip_nested", "snip_snapshots",
                     "snip_probe_steps", "snip_rows2"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train option {name} must be a non-negative integer, got {v!r}")
        if self.snip_steps:
            if self.ul_steps:
                raise ValueError("train options snip_steps and ul_steps: run one fine-tune phase at a time")
            if self.init is None:
                raise ValueError("train option snip_steps (the definition-snippet phase) needs init: a checkpoint to "
                                 "start from (e.g. --init specfire/bundled)")
            if not self.snip_rows or not self.snip_data_rows:
                raise ValueError(f"train options snip_rows and snip_data_rows must be > 0, got {self.snip_rows}, "
                                 f"{self.snip_data_rows}")
            if self.snip_lr <= 0 or self.snip_time_s < 0 or not 0 <= self.snip_min_lr_frac <= 1 \
                    or not 0 <= self.snip_blank_frac <= 1 or not 0 <= self.snip_import_frac <= 1:
                raise ValueError(f"train options: snip_lr must be > 0, snip_time_s >= 0, snip_min_lr_frac, "
                                 f"snip_blank_frac and snip_import_frac in [0, 1]; got {self.snip_lr}, {self.snip_time_s}, "
                                 f"{self.snip_min_lr_frac}, {self.snip_blank_frac}")
            if self.snip_rows2 >= self.snip_rows + self.snip_data_rows:
                raise ValueError(f"train option snip_rows2 ({self.snip_rows2}) must leave corpus rows: < snip_rows + "
                                 f"snip_data_rows ({self.snip_rows + self.snip_data_rows})")
            if self.snip_val_kind not in ("top", "any"):
                raise ValueError(f"train option snip_val_kind must be 'top' or 'any', got {self.snip_val_kind!r}")
        for name in ("ul_steps", "ul_warmup", "ul_snapshots", "ul_eval_prompts", "ul_select", "ul_word_bans",
                     "ul_val_permille", "ul_val_prompts", "ul_anneal_steps", "ul_anneal_snapshots", "ul_line_ngram"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train option {name} must be a non-negative integer, got {v!r}")
        if self.ul_steps or self.snip_steps:
            for name in ("ul_ngram", "ul_prompt_min", "ul_new_tokens", "ul_pool", "ul_batch", "ul_data_batch",
                         "ul_eval_prompt_tokens", "ul_probe_steps", "ul_ppl_every", "ul_select_tokens"):
                v = getattr(self, name)
                if not isinstance(v, int) or v <= 0:
                    raise ValueError(f"train option {name} must be a positive integer, got {v!r}")
            if self.ul_prompt_max < self.ul_prompt_min:
                raise ValueError(f"train option ul_prompt_max ({self.ul_prompt_max}) must be >= ul_prompt_min "
                                 f"({self.ul_prompt_min})")
            if self.ul_kl_weight < 0 or self.ul_ppl_budget < 0:
                raise ValueError(f"train options ul_kl_weight and ul_ppl_budget must be >= 0, got "
                                 f"{self.ul_kl_weight}, {self.ul_ppl_budget}")
            if self.ul_select_phrase < 0:
                raise ValueError(f"train option ul_select_phrase must be >= 0, got {self.ul_select_phrase}")
            if self.ul_anneal_s < 0 or self.ul_anneal_lr < 0 or not 0 <= self.ul_min_lr_frac <= 1:
                raise ValueError(f"train options ul_anneal_s, ul_anneal_lr must be >= 0 and ul_min_lr_frac in [0, 1], "
                                 f"got {self.ul_anneal_s}, {self.ul_anneal_lr}, {self.ul_min_lr_frac}")
            if self.ul_select and not (self.ul_val_permille and self.ul_val_prompts):
                raise ValueError("train option ul_select needs a validation set: ul_val_permille and ul_val_prompts > 0")
            if self.ul_batch > self.ul_pool:
                raise ValueError(f"train option ul_batch ({self.ul_batch}) must be <= ul_pool ({self.ul_pool})")
        if self.init is not None and not (self.ul_steps or self.snip_steps):
            raise ValueError("train option init (start from a checkpoint) needs a fine-tune phase: set ul_steps or "
                             "snip_steps > 0")

    def model_config(self, eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        types = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_layers))
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, layer_types=types, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            rope_theta=self.rope_theta, partial_rotary_factor=0.25, max_position_embeddings=32768,
            tie_word_embeddings=True, mtp_num_hidden_layers=1, eos_token_ids=eos_ids)
