"""bench/constrained_gpu.py on the CPU (tiny shape, a 3,001-entry synthetic tokenizer): every row
equal, every tied cycle's draft rejected."""
import json
import sys

from bench import constrained_gpu


def test_runs_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["constrained_gpu.py", "--shape", "tiny", "--vocab", "3001", "--max-tokens", "8"])
    constrained_gpu.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"] == "cpu" and len(out["tied"]) == len(out["bundled"]) == 4
    assert all(r["equal"] and r["route"] == "mtp" for r in out["tied"] + out["bundled"])
    assert all(r["accepted"] == 0 and r["cycles"] > 0 and r["ar_head"][0] == 123 for r in out["tied"])
