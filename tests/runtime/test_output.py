"""Output: stop strings (single, several, spanning tokens, held back while streaming, text cut),
eos, max_tokens, finish_reason; streamed deltas always concatenate to the final text."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from ckpts import copy_checkpoint
from specfire import LLM, SamplingParams
from specfire.runtime.output import OutputBuilder

TEXT = "Hello, world! The quick brown fox jumps over the lazy dog. for i in range(10): print(i)"


def held_back(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of some stop string."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def feed(tok, ids, sp, eos=frozenset(), max_new=1000):
    """Run tokens through an OutputBuilder the way the engine does; return it and the deltas."""
    out = OutputBuilder(sp, set(eos), tok, max_new)
    deltas = []
    for t in ids:
        if out.done:
            break
        deltas.append(out.add(t))
    return out, deltas


@pytest.mark.parametrize("stops", [["world"], ["quick brown"], ["fox", "quick brown"], ["lazy", "Hello"],
                                   ["o"], ["range(10)"], [" jumps over the"], ["not in the text"]])
def test_stop_strings(tok, stops):
    ids = tok.encode(TEXT)
    sp = SamplingParams(stop=stops)
    out, deltas = feed(tok, ids, sp)
    found = [TEXT.find(s) for s in stops if s in TEXT]
    if found:
        # the first stop string to complete, not merely the first to start
        end = min((TEXT.find(s) + len(s), TEXT.find(s)) for s in stops if s in TEXT)[1]
        assert out.finish_reason == "stop"
        assert out.text == TEXT[:end]
        assert tok.decode(out.token_ids).startswith(out.text)
        assert not any(s in out.text for s in stops)
    else:
        assert out.finish_reason is None and out.text == TEXT
    assert "".join(deltas) == out.text


def test_stop_text_is_held_back_while_streaming(tok):
    """After every token the released text is the decoded text minus exactly the tail that could
    still grow into a stop string."""
    stops = ["fox jumps", "lazy cat", "range(11)"]
    ids = tok.encode(TEXT)
    out = OutputBuilder(SamplingParams(stop=stops), set(), tok, 1000)
    released = ""
    for i, t in enumerate(ids):
        released += out.add(t)
        so_far = tok.decode(ids[:i + 1])
        if out.done:
            break
        if "\ufffd" not in so_far:
            assert released == so_far[:len(so_far) - held_back(so_far, stops)], (i, released, so_far)
    assert out.finish_reason == "stop" and released == out.text == TEXT[:TEXT.index("fox jumps")]


def test_eos_and_ignore_eos(tok):
    ids = tok.encode(TEXT)
    eos = ids[7]
    first = ids.index(eos)
    out, deltas = feed(tok, ids, SamplingParams(), eos={eos})
    assert out.finish_reason == "stop" and out.token_ids == ids[:first + 1]
    assert out.text == tok.decode(ids[:first]) == "".join(deltas)
    out, _ = feed(tok, ids, SamplingParams(ignore_eos=True), eos={eos}, max_new=len(ids))
    assert out.finish_reason == "length" and out.text == TEXT and out.token_ids == ids


def test_max_tokens(tok):
    ids = tok.encode(TEXT)
    for n in (1, 2, len(ids) // 2):
        out, deltas = feed(tok, ids, SamplingParams(stop=["zzz"]), max_new=n)
        assert out.finish_reason == "length" and out.token_ids == ids[:n]
        assert out.text == tok.decode(ids[:n]) == "".join(deltas)


def test_stop_in_last_allowed_token_is_stop(tok):
    ids = tok.encode(TEXT)
    n = next(i for i in range(1, len(ids)) if "world" in tok.decode(ids[:i]))
    out, _ = feed(tok, ids, SamplingParams(stop=["world"]), max_new=n)
    assert out.finish_reason == "stop" and out.text == "Hello, "


def test_eos_releases_held_back_text(tok):
    """Text held back for a possible stop string is released when eos ends the output."""
    ids = tok.encode("Hello, wor")
    out, deltas = feed(tok, ids + [tok.tok.token_to_id("<|im_end|>")], SamplingParams(stop=["world"]),
                       eos={tok.tok.token_to_id("<|im_end|>")})
    assert out.finish_reason == "stop" and out.text == "Hello, wor" == "".join(deltas)


def test_eos_after_partial_character_is_not_dropped(tok):
    """A dangling partial UTF-8 byte before eos is flushed like at max_tokens, never dropped."""
    ids = tok.encode("ab🙂")
    im_end = tok.tok.token_to_id("<|im_end|>")
    cut = ids[:-1] if tok.decode(ids[:-1]).endswith("\ufffd") else ids[:-2]
    out_eos, d_eos = feed(tok, cut + [im_end], SamplingParams(), eos={im_end})
    out_len, d_len = feed(tok, cut, SamplingParams(), max_new=len(cut))
    assert out_eos.text == out_len.text == tok.decode(cut) == "".join(d_eos) == "".join(d_len)


# ---- through the LLM ----------------------------------------------------------------------------

def collect(llm, prompt, sp):
    deltas, ids, res = [], [], None
    for chunk in llm.stream(prompt, sp):
        deltas.append(chunk.text)
        ids += chunk.token_ids
        res = chunk.result
    return deltas, ids, res


def test_streamed_deltas_concatenate_to_final_text(tok_llm):
    rnd = random.Random(0)
    for i in range(6):
        sp = SamplingParams(max_tokens=rnd.randint(1, 40), temperature=rnd.choice([0.0, 0.8, 1.5]), seed=i,
                            ignore_eos=bool(i % 2))
        deltas, ids, res = collect(tok_llm, "def fibonacci(n):", sp)
        assert "".join(deltas) == res.text
        assert ids == res.token_ids
        stopped = res.token_ids[-1] in tok_llm.eos_ids and not sp.ignore_eos
        assert res.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(res.token_ids) == sp.max_tokens
        assert not any(t in tok_llm.eos_ids for t in res.token_ids[:-1]) or sp.ignore_eos
        body = res.token_ids[:-1] if stopped else res.token_ids
        assert res.text == tok_llm.tokenizer.decode(body)
        assert res.stats["generated_tokens"] == len(res.token_ids) <= sp.max_tokens


def test_stop_string_through_llm(tok_llm):
    base = tok_llm.generate("The quick", SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True))
    text = base.text
    start = next(i for i in range(len(text) // 2, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, stop=[stop, "\x00never"])
    deltas, _, res = collect(tok_llm, "The quick", sp)
    assert res.finish_reason == "stop"
    assert res.text == base.text[:base.text.find(stop)] == "".join(deltas)
    assert base.token_ids[:len(res.token_ids)] == res.token_ids
    assert stop in tok_llm.tokenizer.decode(res.token_ids)


def test_eos_through_llm(tok_path, tmp_path):
    """An eos id from generation_config.json ends generation with finish_reason 'stop'."""
    with LLM(tok_path, device="cpu", spec="off", progress=False) as llm:
        ref = llm.generate("Hello", SamplingParams(max_tokens=30, ignore_eos=True))
    eos_tok = ref.token_ids[4]
    first = ref.token_ids.index(eos_tok)
    path = copy_checkpoint(tok_path, str(tmp_path / "eos"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos_tok]}, f)
    with LLM(path, device="cpu", spec="off", progress=False) as llm:
        res = llm.generate("Hello", SamplingParams(max_tokens=30))
        assert res.finish_reason == "stop" and res.token_ids == ref.token_ids[:first + 1]
        assert res.text == llm.tokenizer.decode(ref.token_ids[:first])
        res = llm.generate("Hello", SamplingParams(max_tokens=30, ignore_eos=True))
        assert res.finish_reason == "length" and res.token_ids == ref.token_ids


def test_max_tokens_through_llm(tok_llm):
    for n in (1, 2, 17):
        res = tok_llm.generate([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True))
        assert res.finish_reason == "length" and len(res.token_ids) == n
        assert res.stats["generated_tokens"] == n and res.stats["prompt_tokens"] == 3


def test_generation_stops_at_max_seq_len(tok_path):
    with LLM(tok_path, device="cpu", spec="off", max_seq_len=12, progress=False) as llm:
        res = llm.generate(list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True))
        assert res.finish_reason == "length" and len(res.token_ids) == 2


# ---- bad requests leave the LLM usable --------------------------------------------------------------

def test_failed_requests_leave_llm_usable(tok_llm):
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True)
    before = tok_llm.generate("Hello, world", sp)
    vocab = tok_llm.cfg.vocab_size
    bad = [([1, vocab, 2], rf"token id {vocab} is out of range \[0, {vocab}\)"),
           ([-1], r"token id -1 is out of range"), ([1, 2.0], r"token id 2\.0 is not an integer"),
           ([], r"prompt is empty"),
           ([1] * tok_llm.max_seq_len,
            rf"prompt has {tok_llm.max_seq_len} tokens; max_seq_len is {tok_llm.max_seq_len}"),
           (123, r"prompt must be a string or a list of token ids")]
    for prompt, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            tok_llm.generate(prompt, sp)
        with pytest.raises(ValueError, match=pattern):
            tok_llm.score(prompt)
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        tok_llm.generate([1, 2], {"max_tokens": 3})
    # a stream abandoned half-way
    it = tok_llm.stream("Hello, world", SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True))
    next(it), next(it)
    del it
    after = tok_llm.generate("Hello, world", sp)
    assert after.token_ids == before.token_ids and after.text == before.text


def test_defaults_and_close(tok_path):
    from specfire import SpecfireError

    llm = LLM(tok_path, spec="off", progress=False)            # device and dtype left to their defaults
    if torch.cuda.is_available():
        assert llm.device.type == "cuda" and llm.dtype == llm.kv_dtype == torch.bfloat16
    else:
        assert llm.device.type == "cpu" and llm.dtype == llm.kv_dtype == torch.float32
    res = llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(res.token_ids) == 3
    llm.close()
    llm.close()                                                  # idempotent
    with pytest.raises(SpecfireError, match="closed"):
        llm.generate("Hi")
    with pytest.raises(SpecfireError, match="closed"):
        llm.score([1, 2])


# ---- vLLM's end fields: stop_token_ids, include_stop_str_in_output, min_tokens, skip_special_tokens ---------

def test_stop_token_ids(tok):
    ids = tok.encode(TEXT)
    stop = ids[6]
    first = ids.index(stop)
    out, deltas = feed(tok, ids, SamplingParams(stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.token_ids == ids[:first + 1]
    assert out.text == tok.decode(ids[:first]) == "".join(deltas)            # the stop token's text is not returned
    out, deltas = feed(tok, ids, SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=True))
    assert out.token_ids == ids[:first + 1] and out.text == tok.decode(ids[:first + 1]) == "".join(deltas)
    out, _ = feed(tok, ids, SamplingParams(stop_token_ids=[stop], ignore_eos=True), eos={ids[2]})
    assert out.token_ids == ids[:first + 1]                                  # ignore_eos leaves stop_token_ids alone


@pytest.mark.parametrize("stops", [["world"], ["quick brown"], ["fox", "quick brown"], ["o"], [" jumps over the"]])
def test_include_stop_str_in_output(tok, stops):
    ids = tok.encode(TEXT)
    out, deltas = feed(tok, ids, SamplingParams(stop=stops, include_stop_str_in_output=True))
    start, s = min((TEXT.find(s), s) for s in stops if s in TEXT)
    assert out.finish_reason == "stop" and out.text == TEXT[:start + len(s)] == "".join(deltas)


def test_min_tokens_defers_every_end_but_the_length(tok):
    """Before min_tokens tokens, neither a stop token nor a stop string ends the output (a stop
    string must end in the text of a later token, as vLLM checks only the new text)."""
    ids = tok.encode(TEXT)
    m = 12
    prefix = tok.decode(ids[:m])
    assert "o" in prefix and " " in prefix
    late = next(i for i in range(m, len(ids)) if ids[i] in ids[:m])         # a token seen before min_tokens
    out, deltas = feed(tok, ids, SamplingParams(stop_token_ids=[ids[late]], min_tokens=m))
    assert out.finish_reason == "stop" and out.token_ids == ids[:late + 1] and ids[late] in ids[:m]
    assert out.text == tok.decode(ids[:late]) == "".join(deltas)
    for s in ("o", " "):
        out, deltas = feed(tok, ids, SamplingParams(stop=[s], min_tokens=m))
        j = TEXT.find(s, len(prefix) - len(s) + 1)
        assert out.finish_reason == "stop" and out.text == TEXT[:j] == "".join(deltas) and len(out.token_ids) > m
    out, _ = feed(tok, ids, SamplingParams(min_tokens=m), eos={ids[1]}, max_new=5)
    assert out.finish_reason == "length" and out.token_ids == ids[:5]       # max_tokens still ends it


def test_skip_special_tokens(tok):
    im_start, im_end = tok.tok.token_to_id("<|im_start|>"), tok.tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hello") + [im_start] + tok.encode(" world") + [im_end]
    out, deltas = feed(tok, ids, SamplingParams(), eos={im_end})
    assert out.text == "Hello world" == "".join(deltas) and out.token_ids == ids
    out, deltas = feed(tok, ids, SamplingParams(skip_special_tokens=False), eos={im_end})
    assert out.text == "Hello<|im_start|> world" == "".join(deltas)
    out, _ = feed(tok, ids, SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), eos={im_end})
    assert out.text == "Hello<|im_start|> world<|im_end|>"                   # the stop token's text kept
    out, _ = feed(tok, ids, SamplingParams(include_stop_str_in_output=True), eos={im_end})
    assert out.text == "Hello world"                                         # ... and skipped as special


@pytest.fixture(scope="module")
def fitted_eos(ckpt_cache):
    """The fitted model (it accepts drafts) with a char tokenizer, a greedy reference run, and per
    prompt an end token that some min_tokens in 2..15 makes AR emit right at the bound, with that
    min_tokens (the first such token of the reference run: which one does depends on the fitted
    weights' last bits, so on the CPU the weights were fitted on)."""
    import specfit

    path = specfit.fitted_checkpoint(ckpt_cache["shared"])
    with LLM(path, device="cpu", progress=False) as llm:
        plain = [llm.generate(p, SamplingParams(max_tokens=40, ignore_eos=True), spec="off").token_ids
                 for p in specfit.prompts(3, seed=7)]
        stops = [_stop_at_a_bound(llm, p, ref) for p, ref in zip(specfit.prompts(3, seed=7), plain)]
    return path, plain, stops


def _stop_at_a_bound(llm, prompt, ref: list[int]) -> tuple[int, int]:
    for c in dict.fromkeys(ref[1:]):
        for m in range(2, 16):
            out = llm.generate(prompt, SamplingParams(max_tokens=40, min_tokens=m, stop_token_ids=[c]), spec="off")
            if out.finish_reason == "stop" and len(out.token_ids) == m + 1:
                return c, m
    return ref[1], 2


ROUTES = [("mtp", 1), ("mtp", 3), ("mtp", 5), ("ngram", 3)]
MIN_TOKENS = (2, 3, 4, 8, 15)     # both ends of the range and between; each prompt adds its bound's


def _min_tokens_around(bound: int) -> list[int]:
    """MIN_TOKENS and the neighbours of the value at which AR ends right at the bound, the case a
    verify spanning the bound gets wrong; the other values of 2..15 repeat the masked runs."""
    return sorted({*MIN_TOKENS, *(m for m in (bound - 1, bound, bound + 1) if 2 <= m <= 15)})


@pytest.mark.parametrize("end", ["eos", "stop_token_ids"])
def test_min_tokens_speculation_equals_ar(fitted_eos, tmp_path, end):
    """min_tokens masks the ends out of every row's distribution (the first token, AR steps, each
    verify row by its own position), so greedy speculation still ends exactly where AR does, and no
    route ends early. Over a range of min_tokens some outputs end right at the first position
    allowed, where a verify that spans the bound must mask its rows differently (masking every
    row by the position of row 0 fails here)."""
    import specfit

    path, plain, stops = fitted_eos
    accepted = at_bound = 0
    for p, ref_plain, (stop, bound) in zip(specfit.prompts(3, seed=7), plain, stops):
        first = ref_plain.index(stop)                # emitted early (and, the output cycling, again)
        if end == "eos":
            llm = LLM(specfit.variant(path, str(tmp_path / f"eos{stop}"), eos=stop, tokenizer=True),
                      device="cpu", progress=False)
            kw = {}
        else:
            llm = LLM(path, device="cpu", progress=False)
            kw = dict(stop_token_ids=[stop])
        with llm:
            early = llm.generate(p, SamplingParams(max_tokens=40, **kw), spec="off")
            assert early.finish_reason == "stop" and early.token_ids == ref_plain[:first + 1]
            for m in _min_tokens_around(bound):
                sp = SamplingParams(max_tokens=40, min_tokens=m, **kw)
                ref = llm.generate(p, sp, spec="off")
                assert stop not in ref.token_ids[:m] and len(ref.token_ids) > m
                assert ref.finish_reason == "length" or (ref.token_ids[-1] == stop and stop not in ref.token_ids[:-1])
                assert f"min_tokens={m}" in ref.stats["route_reason"]
                at_bound += ref.finish_reason == "stop" and len(ref.token_ids) == m + 1
                for mode, k in ROUTES:
                    r = llm.generate(p, sp, spec={"mode": mode, "k": k})
                    assert r.stats["route"] == mode and r.token_ids == ref.token_ids and r.text == ref.text, (m, mode, k)
                    assert r.finish_reason == ref.finish_reason
                    accepted += r.stats["accepted"]
            pen = SamplingParams(max_tokens=40, min_tokens=6, repetition_penalty=1.3, **kw)   # with penalties too
            ref = llm.generate(p, pen, spec="off")
            assert stop not in ref.token_ids[:6]
            assert llm.generate(p, pen, spec={"mode": "mtp", "k": 3}).token_ids == ref.token_ids
    assert accepted > 0 and at_bound > 0


def test_sampled_speculation_with_min_tokens_follows_the_masked_distribution(tiny_vocab):
    """Sampled AR, MTP and n-gram never emit a masked stop token, and their tokens follow AR's
    distribution with it masked (the PIT check of test_spec_sampled.py)."""
    from test_spec_sampled import BINS, chi2_critical, pit_chi2

    def masked(raw, prompt, out, sp):
        x = raw.clone()
        x[:, 3] = float("-inf")
        return x

    for mode in ("off", "mtp", "ngram"):
        with LLM(tiny_vocab, device="cpu", progress=False) as llm:
            c, acc = pit_chi2(llm, mode, dict(temperature=1.0, min_tokens=300, stop_token_ids=[3]), target=masked)
        assert acc["outside"] == 0, (mode, "a masked stop token was emitted")
        assert c < chi2_critical(BINS - 1), (mode, c)
        if mode != "off":
            assert acc["accepted"] > 0


def test_stop_token_ids_outside_the_vocabulary(tok_llm):
    v = tok_llm.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids\[1\] is {v}, outside the vocabulary \[0, {v}\)"):
        tok_llm.generate("Hi", SamplingParams(max_tokens=3, stop_token_ids=[1, v]))
    assert len(tok_llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3
