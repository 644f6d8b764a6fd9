"""A tiny checkpoint WITH a tokenizer: a byte-level BPE trained here with `tokenizers`, ChatML
special tokens and chat template, and a tiny random Qwen3.5 model whose vocab matches it.

Text-level paths (chat, stop strings, the servers) need a real tokenizer; this one trains in well
under a second on a fixed corpus, so every test session builds it fresh."""
from __future__ import annotations

import json
import os

from tinymodels import make_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. A small model answers a short question.",
    "Speculative decoding drafts a few tokens and verifies them in one forward pass.",
    "Once upon a time there was a lighthouse keeper who counted the waves every night.",
    "Tip 1: drink water. Tip 2: sleep well. Tip 3: walk daily. Tip 4: read books. Tip 5: rest.",
    "If a train travels 60 miles in 1.5 hours, its average speed is 40 miles per hour.",
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, i * i)\n",
    "Hello, world! How are you today? I am fine, thank you.",
]


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE with exactly `vocab_size` entries (256 bytes + specials + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def make_tok_checkpoint(path: str, vocab_size: int = 320, seed: int = 0, mtp: bool = True, **overrides) -> str:
    """Save tokenizer.json, tokenizer_config.json (ChatML template, eos <|im_end|>) and a tiny random
    model with the tokenizer's vocab size into `path`. Returns `path`."""
    os.makedirs(path, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    v = tok.get_vocab_size(with_added_tokens=True)
    make_checkpoint(path, "base", mtp=mtp, seed=seed, vocab_size=v, **overrides)
    tok.save(os.path.join(path, "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": 4096}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos[0]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path
