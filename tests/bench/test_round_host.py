"""bench/round_host.py on random tiny weights: rounds of c requests timed apart from their forward,
one host wait a round for all of them."""
import json
import sys

from bench import round_host


def test_round_host_times_full_rounds(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["round_host", "--shape", "tiny", "--concurrency", "1,3", "--tokens", "12",
                                      "--reps", "1", "--ahead"])
    assert round_host.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "round_host" and last["ahead"] is True and [r["c"] for r in last["levels"]] == [1, 3]
    for r in last["levels"]:
        assert r["rounds"] >= 9 and 0 < r["host_ms_per_req_min"] <= r["host_ms_per_req_median"]
    assert last["levels"][1]["reads_per_req_round"] < 0.5          # one wait a round for three requests
