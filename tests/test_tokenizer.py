"""Tokenizer: a small byte-level BPE built here with `tokenizers`; incremental UTF-8 detokenization
(never half a character, never a dropped one) and chat-template rendering."""
from __future__ import annotations

import json
import os
import random

import pytest

from ckpts import CHATML_TEMPLATE, SPECIALS, copy_checkpoint, tiny
from specfire import LLM, SamplingParams, SpecfireError
from specfire.tokenizer import Detokenizer, Tokenizer

MULTI = "naïve café 中文文本测试，中文分词 🙂🚀🎉 日本語のテキスト 한국어 x"


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells byte b as one printable character; invert that table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tok: Tokenizer, i: int, table: dict[str, int]) -> bytes:
    piece = tok.tok.id_to_token(i)
    if piece in SPECIALS:
        return piece.encode()
    return bytes(table[c] for c in piece)


def complete_prefix(b: bytes) -> str:
    """The text of the longest prefix of valid UTF-8 bytes `b` that ends on a character boundary."""
    for cut in range(0, 4):
        try:
            return b[:len(b) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise AssertionError("not a prefix of valid UTF-8")


def test_multibyte_characters_are_split_across_tokens(tok):
    """Precondition of the streaming tests: this tokenizer does split characters between tokens."""
    ids = tok.encode(MULTI)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.decode(ids) == MULTI


@pytest.mark.parametrize("text", [MULTI, "🙂", "中", "é🙂x", "plain ascii only", "🎉🎉🎉中文中文",
                                  "a\u00e9\u0301b"])
def test_streaming_never_emits_half_a_character(tok, text):
    """After each token exactly the complete characters so far are out: no U+FFFD, no delay."""
    table = byte_decoder()
    ids = tok.encode(text)
    d = Detokenizer(tok)
    out, raw = "", b""
    for i in ids:
        delta = d.push(i)
        raw += token_bytes(tok, i, table)
        assert "\ufffd" not in delta
        out += delta
        assert out == complete_prefix(raw)
    assert d.flush() == ""
    assert out == text == d.text


def test_random_token_streams_drop_nothing(tok):
    """Arbitrary ids (often invalid UTF-8): pushes plus the final flush give exactly decode(ids)."""
    rnd = random.Random(1234)
    table = byte_decoder()
    high = [i for i in range(tok.vocab_size) if tok.tok.id_to_token(i) not in SPECIALS
            and token_bytes(tok, i, table)[0] >= 0x80]
    for _ in range(300):
        ids = [rnd.choice(high) if rnd.random() < 0.7 else rnd.randrange(tok.vocab_size)
               for _ in range(rnd.randint(1, 25))]
        d = Detokenizer(tok)
        deltas = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(deltas) == tok.decode(ids) == d.text


def test_encode_specials_and_roundtrip(tok):
    ids = tok.encode("<|im_start|>user\nhi 🙂<|im_end|>")
    assert ids[0] == tok.tok.token_to_id("<|im_start|>") and ids[-1] == tok.tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi 🙂<|im_end|>"
    assert tok.vocab_size == 256 + 40 + 3


def test_eos_ids_from_tokenizer_and_generation_config(tok_path):
    with LLM(tok_path, device="cpu", spec="off", progress=False) as llm:
        t = llm.tokenizer.tok
        assert llm.eos_ids == {t.token_to_id("<|endoftext|>"), t.token_to_id("<|im_end|>")}


# ---- chat template -------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🙂"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "中文?"}]


def test_render_chat_matches_transformers(tok_path, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_path)
    for msgs in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            ours = tok.render_chat(msgs, add_generation_prompt=gen)
            assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.render_chat(MESSAGES[1:2]) == "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"


def test_llm_chat_uses_template(tok_path):
    with LLM(tok_path, device="cpu", spec="off", progress=False) as llm:
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        rendered = llm.render_chat(MESSAGES)
        res = llm.chat(MESSAGES, sp)
        assert res.prompt_token_ids == llm.tokenizer.encode(rendered)
        assert res.prompt_token_ids[0] == llm.tokenizer.tok.token_to_id("<|im_start|>")
        assert res.token_ids == llm.generate(rendered, sp).token_ids


def test_template_sources(tok_path, tmp_path):
    """chat_template.jinja is used when tokenizer_config.json has none; ChatML when neither."""
    path = copy_checkpoint(tok_path, str(tmp_path / "t"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    del cfg["chat_template"]
    json.dump(cfg, open(cfg_path, "w"))
    assert Tokenizer(path).render_chat(MESSAGES[1:2]) == Tokenizer(tok_path).render_chat(MESSAGES[1:2])
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert Tokenizer(path).render_chat(MESSAGES[:2]) == "[system] You are terse.\n[user] Hi 🙂\n"


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "x"}], [{"role": "user"}], ["user: hi"]])
def test_render_chat_validation(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.render_chat(messages)


def test_template_raise_exception_is_value_error(tok_path, tmp_path):
    path = copy_checkpoint(tok_path, str(tmp_path / "t"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}" \
                           "{% endif %}" + CHATML_TEMPLATE
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="chat template: first must be user"):
        Tokenizer(path).render_chat(MESSAGES)


def test_no_tokenizer_means_ids_only(ckpt_cache):
    with LLM(tiny(ckpt_cache, "base"), device="cpu", spec="off", progress=False) as llm:
        assert llm.tokenizer is None
        with pytest.raises(SpecfireError, match="no tokenizer"):
            llm.generate("text", SamplingParams(max_tokens=2))
        with pytest.raises(SpecfireError, match="no tokenizer"):
            llm.chat(MESSAGES)
        res = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        assert res.text == "" and len(res.token_ids) == 3
