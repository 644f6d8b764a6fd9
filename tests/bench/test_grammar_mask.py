"""bench/grammar_mask.py on a small vocabulary: llguidance alone without xgrammar installed, a
one-line refusal when the xgrammar comparison is asked for and it is missing, both engines when it is there."""
import json
import sys

import pytest

from bench import grammar_mask

QUICK = ["--vocab", "2048", "--passes", "1"]


def run(argv, monkeypatch, capsys) -> dict:
    monkeypatch.setattr(sys, "argv", ["grammar_mask.py", *argv])
    grammar_mask.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_llguidance_alone_needs_no_xgrammar(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xgrammar", None)          # import xgrammar now raises ImportError
    out = run(QUICK + ["--compare", "none"], monkeypatch, capsys)
    assert [n.split()[0] for n in out["engines"]] == ["llguidance"] and out["vocab"] == 2048
    assert out["engines"][next(iter(out["engines"]))]["mask_median_us"] > 0


def test_the_comparison_without_xgrammar_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(sys, "argv", ["grammar_mask.py", *QUICK])
    with pytest.raises(SystemExit) as e:
        grammar_mask.main()
    msg = str(e.value.code)
    assert "xgrammar" in msg and "--compare none" in msg and "\n" not in msg


def test_both_engines_when_xgrammar_is_there(monkeypatch, capsys):
    pytest.importorskip("xgrammar")
    out = run(QUICK, monkeypatch, capsys)
    assert sorted(n.split()[0] for n in out["engines"]) == ["llguidance", "xgrammar"]
