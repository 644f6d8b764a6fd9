"""`specfire run --spec ... --spec-k N`: the speculation stats reach --json and the stderr summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import specfit
from specfire.config import ModelConfig


@pytest.fixture(scope="module")
def model(ckpt_cache, tmp_path_factory) -> tuple[str, str]:
    fitted = specfit.fitted_checkpoint(ckpt_cache["root"])
    path = specfit.variant(fitted, str(tmp_path_factory.mktemp("cli") / "m"), tokenizer=True)
    chars = specfit.char_vocab(ModelConfig.from_dir(path).vocab_size)
    prompt = "".join(chars[t] for t in specfit.prompts(1, seed=41)[0])
    return path, prompt


def test_run_json_and_summary_carry_spec_stats(model, cli_run):
    path, prompt = model
    r = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "-n", "24", "--spec", "mtp",
            "--spec-k", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    st = out["stats"]
    assert st["route"] == "mtp" and st["k"] == 3 and st["generated_tokens"] == len(out["token_ids"]) == 24
    assert st["cycles"] > 0 and st["accepted"] > 0 and len(st["accept_per_pos"]) == 3
    assert st["mean_accept_len"] == pytest.approx(1 + st["accepted"] / st["cycles"])
    for f in ("drafted", "route_reason", "prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"):
        assert f in st
    summary = r.stderr.strip().splitlines()[-1]
    assert "route mtp, k=3" in summary and f"mean_accept_len {st['mean_accept_len']:.2f}" in summary
    assert f"{st['accepted']}/{st['drafted']} drafts accepted in {st['cycles']} cycles" in summary

    a = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "-n", "24", "--spec", "off", "--json")
    assert a.returncode == 0, a.stderr
    ar = json.loads(a.stdout)
    assert ar["stats"]["route"] == "ar" and ar["token_ids"] == out["token_ids"]
    assert "route ar" in a.stderr and "speculation off" in a.stderr


def test_run_bad_spec_values_are_one_line_errors(model, ckpt_cache, tmp_path, cli_run):
    path, prompt = model
    r = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "--spec-k", "11")
    assert r.returncode == 2 and "--spec-k" in r.stderr and "Traceback" not in r.stderr
    nohead = specfit.variant(path, str(tmp_path / "nohead"), mtp_sidecar=True)
    os.unlink(os.path.join(nohead, "mtp.safetensors"))
    r = cli_run("run", "--model", nohead, "--device", "cpu", "--prompt", prompt, "--spec", "mtp")
    assert r.returncode == 2 and "MTP head" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_ngram_range_is_one_line_error():
    """Through a real process: exit code, one line, no traceback (the other errors run in process)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "specfire.cli", "run", "--prompt", "x", "--ngram-n", "4"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert r.returncode != 0
    assert "--ngram-n must be MIN:MAX" in r.stderr and "Traceback" not in r.stderr
