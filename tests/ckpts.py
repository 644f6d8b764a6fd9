"""Session-cached tiny checkpoints for the tests: the transformers-built models of tinymodels.py,
optionally with a small byte-level BPE tokenizer (Qwen-style special tokens, ChatML template)."""
from __future__ import annotations

import json
import os
import shutil

from tinymodels import make_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "for i in range(10):\n    print(i * i)\n",
    "中文文本测试，中文分词。日本語のテキスト。한국어 문장.",
    "emoji 🙂🚀🎉 café naïve résumé",
] * 4


def build_tokenizer(n_merges: int = 40):
    """A byte-level BPE tokenizer: 256 byte tokens, a few merges, then the three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tokenizer(path: str, tok, eos_token: str = "<|endoftext|>") -> None:
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": eos_token, "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def tiny(cache: dict, name: str = "base", multimodal: bool = False, mtp: bool = True,
         tokenizer: bool = False, seed: int = 0) -> str:
    """The directory of a tiny checkpoint, built once per test session. With `tokenizer`, the
    model's vocabulary is the tokenizer's (eos in generation_config.json is <|im_end|>, the last id)."""
    key = (name, multimodal, mtp, tokenizer, seed)
    if key not in cache["made"]:
        path = str(cache["root"] / "_".join(map(str, key)))
        os.makedirs(path, exist_ok=True)
        if tokenizer:
            tok = build_tokenizer()
            make_checkpoint(path, name, multimodal=multimodal, mtp=mtp, seed=seed,
                            vocab_size=tok.get_vocab_size(with_added_tokens=True))
            save_tokenizer(path, tok)
        else:
            make_checkpoint(path, name, multimodal=multimodal, mtp=mtp, seed=seed)
        cache["made"][key] = path
    return cache["made"][key]


def copy_checkpoint(src: str, dst: str) -> str:
    """A private copy of a cached checkpoint that a test may damage."""
    shutil.copytree(src, dst)
    return dst
