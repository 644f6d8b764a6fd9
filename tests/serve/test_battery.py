"""The serving battery: quality flags on crafted texts, md5 definitions, and an in-process run."""
import json
import random

import pytest

from specfire.serve import battery

PROSE = ("The lighthouse keeper climbed the spiral stairs every evening, counting each step as his father had "
         "taught him. Tonight the sea was calm, and the lamp threw its long beam across water that looked like "
         "hammered silver. He noticed a green bottle bobbing near the rocks, caught in the slow pull of the "
         "tide. Inside was a letter written in careful blue ink, addressed to nobody in particular, asking "
         "whoever found it to describe the view from where they stood. He sat down at his desk, sharpened a "
         "pencil, and began to write about the gulls, the fog that rolled in before dawn, and the small boats "
         "that returned each morning heavy with fish. When he finished, he sealed the page inside the bottle "
         "and carried it down to the shore, where the outgoing tide took it gently away.")

CODE = ('def is_prime(n):\n    """Return True when n is prime."""\n    if n < 2:\n        return False\n'
        '    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n'
        '    return True\n')


def test_normal_texts_are_not_attractors():
    assert not battery.attractor(PROSE)
    assert not battery.attractor(CODE)
    tips = "\n".join(f"{i}. {t}" for i, t in enumerate(["Keep a regular schedule.", "Avoid caffeine late.",
                                                         "Keep the room dark and cool.", "Limit screens before bed.",
                                                         "Get daylight in the morning."], 1))
    assert not battery.attractor(tips)
    assert not battery.attractor("42")          # a one-word answer is too short to call
    assert not battery.attractor("")


def test_degenerate_repetition_is_an_attractor():
    rng = random.Random(0)
    assert battery.attractor("the " * 200)                                  # one token dominates
    assert battery.attractor(" ".join(rng.choice(["a", "b", "c"]) for _ in range(300)))  # unique ratio
    # prose that falls into a loop: the tail repeats one sentence
    loop = PROSE + " " + "I am a lighthouse and I shine. " * 40
    assert battery.attractor(loop)
    # the second half cycles through a long phrase: every window has many distinct words, but the 3-grams repeat
    phrase = " ".join(f"w{i}" for i in range(45))
    cyc = PROSE + " " + " ".join([phrase] * 6)
    words = cyc.split()
    assert len(set(words[-128:])) / 128 > 0.30  # not caught by the window rules
    assert battery.attractor(cyc)


def test_flags_empty_and_runaway():
    assert battery.flags("", "stop") == {"attractor": False, "empty": True, "runaway": False}
    assert battery.flags("   \n ", "stop")["empty"]
    assert battery.flags("<think>\nlong reasoning here\n</think>\n\n", "stop")["empty"]
    assert battery.flags("<think>still thinking when the budget ran out", "length") == \
        {"attractor": False, "empty": True, "runaway": True}
    assert not battery.flags("<think>ok</think>The answer is 4.", "stop")["empty"]
    assert battery.flags(PROSE, "length") == {"attractor": False, "empty": False, "runaway": True}


def test_md5_definitions():
    a = battery.request_body("hello", 32, {"mode": "off", "k": 3})
    b = battery.request_body("hello", 32, {"mode": "mtp", "k": 2})
    c = battery.request_body("hello", 33, {"mode": "off", "k": 3})
    assert battery.request_md5(a) == battery.request_md5(b)     # speculation is what identity runs vary
    assert battery.request_md5(a) != battery.request_md5(c)
    row = battery.make_row("x", "hello", a, "text", "stop", 1, 2, 0, {"mean_accept_len": 1.5}, True)
    assert row["prompt_md5"] == battery.md5("hello") and row["content_md5"] == battery.md5("text")
    assert row["tau"] == 1.5


def test_identity_report():
    rows = lambda md5s: [{"content_md5": m} for m in md5s]  # noqa: E731
    same = {"off": rows("abcde"), "on": rows("abcde")}
    assert battery.identity_report(same)["identity"] is True
    diff = battery.identity_report({"off": rows("abcde"), "on": rows("abcdX")})
    assert diff["identity"] is False and diff["mismatches"][0]["prompt"] == battery.PROMPTS[4][0]


def test_bench_battery_identity_in_process(tmp_path, capsys):
    from tinytok import make_tok_checkpoint

    from specfire.cli import main

    path = make_tok_checkpoint(str(tmp_path / "ckpt"), seed=1)
    rc = main(["bench", "battery", path, "-n", "6", "--identity", "--spec-k", "2"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0
    rows, report = lines[:-1], lines[-1]
    assert len(rows) == 2 * len(battery.PROMPTS)
    assert report == {"identity": True, "cells": ["tp=1,spec=off", "tp=1,spec=mtp"], "reference": "tp=1,spec=off",
                      "mismatches": []}
    for r in rows:
        for key in ("finish", "gen", "ctx", "cached", "tau", "prefill_tok_s", "decode_tok_s", "attractor", "empty",
                    "runaway", "saw_done", "prompt_md5", "request_md5", "content_md5"):
            assert key in r, key
        assert r["saw_done"] and r["gen"] >= 1 and r["ctx"] > 5
    off = {r["prompt"]: r for r in rows if r["spec"] == "off"}
    on = {r["prompt"]: r for r in rows if r["spec"] == "mtp"}
    assert all(on[p]["tau"] >= 1.0 for p in on)
    assert all(on[p]["request_md5"] == off[p]["request_md5"] for p in off)


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://x"])
def test_bad_url(url):
    with pytest.raises(ValueError, match="url"):
        battery.run_server(url, "x", "hi", 4, None)
