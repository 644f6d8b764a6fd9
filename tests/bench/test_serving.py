"""bench/serving.py --smoke: `specfire serve` with the bundled model on the CPU, driven at two
concurrency levels; every figure of a level present and consistent."""
import json
import sys

from bench import serving


def test_serving_smoke_reports_each_level(monkeypatch, capsys, tmp_path):
    """--in-process: bench.batch's rate on the same levels beside the HTTP one."""
    monkeypatch.setattr(sys, "argv", ["serving", "--smoke", "--spec", "off", "--in-process", "--out", str(tmp_path)])
    assert serving.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "serving" and [r["concurrency"] for r in last["levels"]] == [1, 2]
    for r in last["levels"]:
        assert r["failed"] == 0 and r["requests"] == 2
        assert r["output_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"] and r["decode_tok_s_min"] > 0
        # ignore_eos: each request generated exactly --output-len tokens
        assert r["output_tokens"] == 2 * r["output_len"]
        assert r["peak_mem_gb"] and r["peak_mem_gb"] > 0.01        # the server's resident set
        assert r["in_process_tok_s"] > 0 and r["http_x_in_process"] > 0
        assert r["engine_cpu_ms_per_tok"] > 0                     # the engine process's busiest thread
        assert r["captures_warmup"] == r["captures_timed"] == 0    # no CUDA graphs on a CPU
        assert r["captured_warmup"] == r["captured_timed"] == {}
    assert last["server_start"]["captures_at_start"] == 0 and last["server_start"]["start_s"] > 0
    assert json.loads((tmp_path / "serving.json").read_text())["levels"] == last["levels"]


def test_captures_are_counted_past_an_offset(tmp_path):
    """A level counts the capture lines its server logged after an offset, and returns where the
    log ends, so the warm-up's and the timed part's are told apart; no log, no count."""
    log = tmp_path / "server.log"
    log.write_text("[specfire] captured a CUDA graph for 1 row(s)\n[specfire] serving x\n")
    n, at = serving.captures(str(log), 0)
    assert (n, at) == (["CUDA graph for 1 row(s)"], log.stat().st_size)
    with open(log, "a") as f:
        f.write("[specfire] captured a CUDA graph for 4 slots' 16 rows\n"
                "[specfire] captured a CUDA graph for 4 slots' draft chains (k=3)\n"
                "[specfire] captured a CUDA graph for 4 slots' 16 rows\n")
    got, end = serving.captures(str(log), at)
    assert end == log.stat().st_size
    assert serving.tally(got) == {"CUDA graph for 4 slots' 16 rows": 2, "CUDA graph for 4 slots' draft chains (k=3)": 1}
    assert serving.captures(None, 7) == (None, 7) and serving.tally(None) is None


def test_percentile_is_nearest_rank():
    assert serving.percentile([], 50) is None
    assert serving.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert serving.percentile(list(range(1, 101)), 99) == 99
    assert serving.percentile([5.0], 99) == 5.0


def test_serving_smoke_on_random_tied_weights_accepts_every_draft(monkeypatch, capsys):
    """--shape: the bench writes random weights (final norms -1) and a tokenizer, the server loads them."""
    monkeypatch.setattr(sys, "argv", ["serving", "--smoke", "--shape", "tiny", "--tied", "--spec", "mtp"])
    assert serving.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["model"] == "random tiny tied" and last["spec"] == {"mode": "mtp", "k": 3}
    for r in last["levels"]:
        assert r["failed"] == 0 and r["output_tokens"] == 2 * r["output_len"]
        assert r["mean_accept_len_p50"] > 2      # 5 decode tokens in 2 cycles: every draft accepted
