"""bench/headline.py --smoke: the five headline runs on the CPU, each check it makes, one JSON line last."""
import json
import sys

from bench import headline


def test_headline_smoke_measures_the_five_figures(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["headline", "--smoke", "--out", str(tmp_path)])
    assert headline.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "headline" and last["ok"] is True and last["quantize_s"] > 0
    got = [(r["weights"], r["route"], r["draft_vocab"]) for r in last["results"]]
    assert got == [("bf16", "ar", 512), ("bf16", "mtp3", 512), ("bf16", "mtp3", 128),
                   ("4-bit", "ar", 128), ("4-bit", "mtp3", 128)]
    for r in last["results"]:
        assert r["tok_s"] > 0 and 0 < r["bw_frac"] == r["tok_s"] * r["step_bytes"] / 4.17e12
        if r["route"] == "mtp3":          # final norms -1: every draft accepted, output AR's
            assert r["all_accepted"] and r["equals_ar"] and r["mean_accept_len"] > 3
    bf16, q4 = last["results"][0]["step_bytes"], last["results"][3]["step_bytes"]
    assert q4 < 0.5 * bf16                # `specfire quantize` made the projections 4-bit
    assert (tmp_path / "headline.jsonl").read_text().count('"stage": "figure"') == 5
