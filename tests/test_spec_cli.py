"""`specfire run --spec ... --spec-k N`: the speculation stats reach --json and the stderr summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repo import REPO
import specfit
from specfire.config import ModelConfig


@pytest.fixture(scope="module")
def model(ckpt_cache, tmp_path_factory) -> tuple[str, str]:
    fitted = specfit.fitted_checkpoint(ckpt_cache["shared"])
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
    r = subprocess.run([sys.executable, "-m", "specfire.cli", "run", "--prompt", "x", "--ngram-n", "4"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert r.returncode != 0
    assert "--ngram-n must be MIN:MAX" in r.stderr and "Traceback" not in r.stderr


def test_auto_summary_says_what_each_route_did(model, cli_run):
    """`auto` measures AR and the drafters before it settles: the summary names every route that
    ran, its tokens, and the acceptance of the drafting ones (not the settled route with the
    others' drafts); stats["per_route"] has the same counts."""
    path, prompt = model
    r = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "-n", "48", "--spec", "auto",
                "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    st, per = out["stats"], out["stats"]["per_route"]
    assert {"ar", "mtp"} <= set(per), per                   # AR is measured first on a fresh engine
    assert sum(c["tokens"] for c in per.values()) == st["generated_tokens"] - 1     # the first is the prefill's
    assert {r: c["tokens"] for r, c in per.items()} == st["routes"]
    assert sum(c["cycles"] for c in per.values()) == st["cycles"] and per["ar"]["cycles"] == 0
    assert sum(c["accepted"] for c in per.values()) == st["accepted"]
    mtp = per["mtp"]
    assert mtp["mean_accept_len"] == pytest.approx(1 + mtp["accepted"] / mtp["cycles"])
    summary = r.stderr.strip().splitlines()[-1]
    what = "ar" if st["route"] == "ar" else f"{st['route']}, k={st['k']}"
    assert f"route auto, settled on {what}: first token from the prefill; ar {per['ar']['tokens']} token" in summary
    assert (f"mtp {mtp['tokens']} tokens, mean_accept_len {mtp['mean_accept_len']:.2f} ({mtp['accepted']}/"
            f"{mtp['drafted']} drafts accepted in {mtp['cycles']} cycles") in summary


def test_summary_of_auto_that_settled_on_ar():
    """What the summary printed as `route ar, k=0 mean_accept_len 3.00 (8/12 drafts accepted in 4
    cycles)`: now the AR choice, then what each route did."""
    from specfire.report import RequestFigures

    per = {"ar": {"steps": 10, "tokens": 10, "cycles": 0, "drafted": 0, "accepted": 0, "mean_accept_len": 0.0,
                  "accept_per_pos": []},
           "mtp": {"steps": 4, "tokens": 12, "cycles": 4, "drafted": 12, "accepted": 8, "mean_accept_len": 3.0,
                   "accept_per_pos": [1.0, 0.75, 0.25]},
           "ngram": {"steps": 3, "tokens": 3, "cycles": 0, "drafted": 0, "accepted": 0, "mean_accept_len": 0.0,
                     "accept_per_pos": []}}
    st = {"prompt_tokens": 5, "generated_tokens": 26, "route": "ar", "route_reason": "auto: ar; ...", "k": 0,
          "cycles": 4, "drafted": 12, "accepted": 8, "mean_accept_len": 3.0, "prefill_s": 0.1, "prefill_tok_s": 50.0,
          "decode_s": 0.5, "decode_tok_s": 50.0, "accept_per_pos": [1.0, 0.75, 0.25], "per_route": per}
    fig = RequestFigures.of(st, "length", 26)
    assert fig.per_route == per and fig.timings(1.0)["per_route"] == per
    assert fig.summary().endswith(
        "route auto, settled on ar: first token from the prefill; ar 10 tokens; mtp 12 tokens, mean_accept_len 3.00 "
        "(8/12 drafts accepted in 4 cycles, per position 1.00/0.75/0.25); ngram 3 tokens, no drafts in 3 steps "
        "(auto: ar; ...)")


def test_k1_summary_lists_no_positions(model, cli_run):
    path, prompt = model
    r = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "-n", "16", "--spec", "mtp",
                "--spec-k", "1", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    summary = r.stderr.strip().splitlines()[-1]
    assert f"route mtp, k=1 mean_accept_len {st['mean_accept_len']:.2f} ({st['accepted']}/{st['drafted']} " in summary
    assert "per position" not in summary and list(st["per_route"]) == ["mtp"]


@pytest.mark.parametrize("spec,unsaid", [("off", "draft"), ("ngram", "MTP")])
def test_penalty_reason_speaks_only_of_the_drafts_that_run(model, cli_run, spec, unsaid):
    path, prompt = model
    r = cli_run("run", "--model", path, "--device", "cpu", "--prompt", prompt, "-n", "8", "--spec", spec,
                "--frequency-penalty", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    assert "frequency_penalty=0.5" in st["route_reason"] and "frequency_penalty=0.5" in st["penalties"]
    assert unsaid not in st["route_reason"] and unsaid not in st["penalties"], st["route_reason"]
