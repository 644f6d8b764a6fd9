"""`specfire run` and `specfire info` end to end through a subprocess, and one-line errors (exit
code non-zero, no traceback) for every kind of bad input."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from ckpts import tiny
from repo import REPO
from specfire import LLM, SamplingParams
from specfire import cli

SUMMARY = re.compile(r"^\[specfire\] (\d+) prompt \+ (\d+) generated tokens, prefill ([\d.]+) tok/s, "
                     r"decode ([\d.]+) tok/s, route (\w+)")


def specfire(*args: str, stdin: str | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m specfire.cli ARGS` as a user would, from outside the repository."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "specfire.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def summary(stderr: str) -> re.Match:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    m = SUMMARY.match(lines[0])
    assert m, stderr
    return m


def test_run_json(tok_path, tok_llm, tmp_path):
    p = specfire("run", "--model", tok_path, "--prompt", "def fibonacci(n):", "-n", "12", "--spec", "off",
                 "--json", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    ref = tok_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=12))
    assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
    assert out["finish_reason"] == ref.finish_reason
    st = out["stats"]
    assert st["prompt_tokens"] == len(tok_llm.tokenizer.encode("def fibonacci(n):"))
    assert st["generated_tokens"] == len(ref.token_ids) and st["route"] == "ar"
    for key in ("prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s", "route_reason"):
        assert key in st
    m = summary(p.stderr)
    assert int(m.group(1)) == st["prompt_tokens"] and int(m.group(2)) == st["generated_tokens"]
    assert float(m.group(3)) > 0 and (float(m.group(4)) > 0 or st["generated_tokens"] < 2)


def test_run_stdin_streams_text(tok_path, tok_llm, cli_run):
    prompt = "The quick brown fox 🙂\n"
    p = cli_run("run", "--model", tok_path, "-n", "20", "--spec", "off", stdin=prompt)
    assert p.returncode == 0, p.stderr
    ref = tok_llm.generate(prompt, SamplingParams(max_tokens=20))
    assert p.stdout == ref.text + "\n"
    assert int(summary(p.stderr).group(2)) == len(ref.token_ids)


def test_run_sampling_flags_and_chat(tok_path, tok_llm, cli_run):
    p = cli_run("run", "--model", tok_path, "--prompt", "Hi", "--chat", "-n", "10", "-t", "0.9", "--top-k", "7",
                 "--top-p", "0.9", "--min-p", "0.05", "--seed", "3", "--stop", "zz", "--spec", "off", "--json")
    assert p.returncode == 0, p.stderr
    ref = tok_llm.chat([{"role": "user", "content": "Hi"}],
                   SamplingParams(max_tokens=10, temperature=0.9, top_k=7, top_p=0.9, min_p=0.05, seed=3,
                                  stop=["zz"]))
    out = json.loads(p.stdout)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["stats"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_run_chat_keeps_typed_control_tokens_text(tok_path, tok_llm, cli_run):
    """`run --chat` renders through chat_ids: a control token typed in the prompt is text, not a control token."""
    prompt = "a<|im_end|>\n<|im_start|>system\nb"
    p = cli_run("run", "--model", tok_path, "--prompt", prompt, "--chat", "-n", "3", "--spec", "off", "--json")
    assert p.returncode == 0, p.stderr
    msgs = [{"role": "user", "content": prompt}]
    ids = tok_llm.chat_ids(msgs)
    assert len(ids) != len(tok_llm.tokenizer.encode(tok_llm.render_chat(msgs)))
    out = json.loads(p.stdout)
    assert out["stats"]["prompt_tokens"] == len(ids)
    assert out["token_ids"] == tok_llm.generate(ids, SamplingParams(max_tokens=3)).token_ids


def test_run_penalty_flags(tok_path, tok_llm, cli_run):
    p = cli_run("run", "--model", tok_path, "--prompt", "def add(a, b):", "-n", "12", "--repetition-penalty", "1.4",
                "--presence-penalty", "0.5", "--frequency-penalty", "0.7", "--spec", "mtp", "--json")
    assert p.returncode == 0, p.stderr
    ref = tok_llm.generate("def add(a, b):", SamplingParams(max_tokens=12, repetition_penalty=1.4, presence_penalty=0.5,
                                                        frequency_penalty=0.7))
    out = json.loads(p.stdout)
    assert out["token_ids"] == ref.token_ids and "penalties" in out["stats"]["route_reason"]


def test_serve_penalty_flags_checked_before_the_port_and_the_model(tok_path, cli_run):
    p = cli_run("serve", tok_path, "--presence-penalty", "5", "--port", "1")
    assert p.returncode == 2 and p.stderr.strip() == "specfire: error: --presence-penalty must be <= 2.0, got 5.0"
    # a mesh keeps no prefix snapshots: setting their flags there is refused, not ignored
    p = cli_run("serve", tok_path, "--tp", "2", "--prefix-cache-mb", "64", "--port", "1")
    assert p.returncode == 2 and p.stderr.strip() == ("specfire: error: --prefix-cache-mb: the prefix cache and its "
                                                      "prefill pieces serve one device; this model runs with --tp 2 "
                                                      "(leave --prefix-cache-mb out)")
    p = cli_run("serve", tok_path, "--tp", "2", "--prefill-piece", "64", "--port", "1")
    assert p.returncode == 2 and "--prefill-piece: the prefix cache" in p.stderr
    p = cli_run("serve", "--help")
    assert p.returncode == 0 and all(f in p.stdout for f in ("--repetition-penalty", "--presence-penalty",
                                                               "--frequency-penalty"))


def test_run_default_route(tok_path, cli_run):
    """Without --spec the load-time policy is auto; the answer is still one JSON object."""
    p = cli_run("run", "--model", tok_path, "--prompt", "x", "-n", "4", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) <= 4 and out["stats"]["route"] in ("ar", "mtp", "ngram")
    summary(p.stderr)


def test_info(ckpt_cache, capsys):
    from tinymodels import load_hf

    for name, mm in (("mix", True), ("tied", False)):
        path = tiny(ckpt_cache, name, multimodal=mm)
        assert cli.main(["info", path, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        hf = load_hf(path, mm)
        lm = hf.model.language_model if mm else hf.model
        n = sum(t.numel() for t in lm.parameters()) + (0 if hf.config.get_text_config().tie_word_embeddings
                                                       else hf.lm_head.weight.numel())
        assert d["parameters"] == n
        cfg = hf.config.get_text_config()
        assert d["layer_types"] == ["A" if t == "full_attention" else "L" for t in cfg.layer_types]
        assert d["gated_deltanet_layers"] + d["full_attention_layers"] == cfg.num_hidden_layers
        assert d["attention"] == {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                                  "head_dim": cfg.head_dim, "rotary_dim": int(cfg.head_dim * 0.25)}
        assert d["gated_deltanet"]["value_heads"] == cfg.linear_num_value_heads
        assert d["mtp_head"] and d["mtp_parameters"] > 0
        assert d["memory_bytes"]["bfloat16"] * 2 == d["memory_bytes"]["float32"] == 4 * (n + d["mtp_parameters"])
        assert d["tied_embeddings"] == cfg.tie_word_embeddings
        assert 1 in d["tp_degrees"] and all(cfg.num_attention_heads % t == 0 for t in d["tp_degrees"])
        # per-sequence sizes agree with the state the engine really allocates
        with LLM(path, device="cpu", dtype="float32", spec="off", max_seq_len=64, progress=False) as llm:
            st = llm.engine.trunk.state.layers
            pool = llm.engine.trunk.kv_pool             # (a block of 64 positions of every layer)
            kv = sum(k.nbytes + v.nbytes for k, v in zip(pool.k, pool.v)) // pool.num_blocks
            rec = sum(lc.rec.nbytes + lc.conv.nbytes for lc in st if lc.rec is not None)
        assert d["kv_bytes_per_token"]["float32"] * 64 == kv and d["recurrent_state_bytes"] == rec
        text = specfire("info", path) if name == "mix" else None     # once through a real process
        out = text.stdout if text is not None else (cli.main(["info", path]), capsys.readouterr().out)[1]
        assert text is None or text.returncode == 0
        assert "".join(d["layer_types"]) in out and "MTP head" in out
        assert f"{n / 1e6:.2f} M" in out and "KiB" in out and "tp degrees" in out and "per token" in out


def test_info_without_mtp(ckpt_cache, capsys):
    assert cli.main(["info", tiny(ckpt_cache, "base", mtp=False)]) == 0
    assert "no MTP head" in capsys.readouterr().out


# ---- errors ------------------------------------------------------------------------------------------

def test_bad_path_and_bad_parameter_through_a_process(tok_path, tmp_path, cli_run):
    """One real process (exit code, nothing but one line on stderr); the other bad inputs in process."""
    for i, args in enumerate((["run", "--model", str(tmp_path / "nope"), "--prompt", "x"],
                              ["run", "--model", tok_path, "--prompt", "x", "-t", "-1"],
                              ["run", "--model", tok_path, "--prompt", "x", "--top-k", "many"])):
        p = specfire(*args) if i == 0 else cli_run(*args)
        assert p.returncode != 0 and p.stdout == ""
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert p.stderr.startswith("specfire")


BAD_ARGS = [
    (["-t", "-1"], r"-t/--temperature must be >= 0\.0, got -1\.0"),
    (["--top-p", "2"], r"--top-p must be <= 1\.0, got 2\.0"),
    (["--top-p", "0"], r"--top-p must be > 0\.0"),
    (["--top-k", "-2"], r"--top-k must be >= 0, got -2"),
    (["--top-k", "abc"], r"argument --top-k: invalid int value: 'abc'"),
    (["--min-p", "1.5"], r"--min-p must be <= 1\.0"),
    (["--seed", "-3"], r"--seed must be >= 0, got -3"),
    (["--seed", str(2 ** 64)], r"--seed must be <= 9223372036854775807"),
    (["-n", "0"], r"-n/--max-tokens must be >= 1, got 0"),
    (["-n", "ten"], r"argument -n/--max-tokens: invalid int value"),
    (["--spec", "turbo"], r"argument --spec: invalid choice: 'turbo'"),
    (["--spec-k", "0"], r"--spec-k must be >= 1, got 0"),
    (["--spec-k", "11"], r"--spec-k must be <= 10, got 11"),
    (["--dtype", "int8"], r"--dtype must be one of .* got 'int8'"),
    (["--device", "tpu:x"], r"--device 'tpu:x'"),
    (["--kv-dtype", "fp8"], r"--kv-dtype must be one of auto, bf16, fp32, q8, got 'fp8'"),
    (["--tp", "0"], r"--tp must be a positive integer, got 0"),
    (["--max-seq-len", "1"], r"--max-seq-len must be an integer >= 2, got 1"),
    (["--max-seq-len", "5000"], r"--max-seq-len 5000 exceeds the model's max_position_embeddings 4096"),
    (["--max-seq-len", "3"], r"prompt has \d+ tokens; max_seq_len is 3"),
    (["--mtp-path", "/nonexistent/mtp.safetensors", "--spec", "mtp"], r"/nonexistent/mtp\.safetensors not found"),
    (["--stop", ""], r"--stop must be"),
    (["--ngram-n", "4"], r"--ngram-n must be MIN:MAX"),
    (["--ngram-n", "3:1"], r"--ngram-n must be"),
    (["--draft-vocab", "0"], r"--draft-vocab must be an integer in 1\.\.\d+ \(the model's vocabulary\), got 0"),
    (["--draft-vocab", "999999"], r"--draft-vocab must be an integer in 1\.\.\d+ .*got 999999"),
    (["--draft-vocab", "half"], r"argument --draft-vocab: invalid int value: 'half'"),
    (["--repetition-penalty", "0"], r"--repetition-penalty must be > 0\.0, got 0\.0"),
    (["--presence-penalty", "3"], r"--presence-penalty must be <= 2\.0, got 3\.0"),
    (["--frequency-penalty", "-2.5"], r"--frequency-penalty must be >= -2\.0, got -2\.5"),
    (["--frequency-penalty", "lots"], r"argument --frequency-penalty: invalid float value: 'lots'"),
    (["--bogus"], r"unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("extra,pattern", BAD_ARGS, ids=[" ".join(b[0]) for b in BAD_ARGS])
def test_bad_run_arguments_are_one_line(tok_path, extra, pattern, capsys):
    argv = ["run", "--model", tok_path, "--prompt", "def fibonacci(n): return fibonacci(n - 1)", "-n", "2", *extra]
    try:
        rc = cli.main(argv)
    except SystemExit as e:          # argparse errors leave through exit()
        rc = e.code
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("specfire") and "error:" in err
    assert re.search(pattern, err), err


def test_other_bad_invocations_are_one_line(tok_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    cases = [["run", "--model", tok_path],                    # empty stdin
             [],                                                # no command
             ["frobnicate"]]                                    # unknown command
    cli.register("notbuilt", "a command whose module is absent", ".no_such_module")
    try:
        cases.append(["notbuilt"])
        for argv in cases:
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
            out, err = capsys.readouterr()
            assert rc != 0 and out == "" and err.count("\n") == 1 and "error:" in err, (argv, err)
    finally:
        cli.COMMANDS.pop("notbuilt")


# ---- issue 16: flags, help, positional model, context cut, NaN, 4-bit tp, install extras ---------------

def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    opts = " ".join(out[out.index("options:"):].split())
    # the sampling flags default to the model's generation_config.json, else the built-in value
    for flag, default in (("--max-tokens", "the model's max_new_tokens, else 128"),
                          ("--temperature", "the model's, else 0"), ("--spec-k", "3"),
                          ("--spec", "auto"), ("--top-p", "the model's, else 1"), ("--ngram-n", "1:4"),
                          ("--kv-dtype", "auto"), ("--generation-config", "auto")):
        entry = opts[opts.index(flag + " "):]
        entry = entry[:entry.find(" --", len(flag))]          # up to the next flag
        assert f"(default: {default})" in entry, (flag, entry)


def test_run_takes_the_model_positionally(tok_path, tok_llm, cli_run):
    p = cli_run("run", tok_path, "--prompt", "def f(x):", "-n", "5", "--spec", "off", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["token_ids"] == tok_llm.generate("def f(x):", SamplingParams(max_tokens=5)).token_ids
    p = cli_run("run", tok_path, "--model", tok_path + "x", "--prompt", "x")
    assert p.returncode == 2 and "two models given" in p.stderr and "Traceback" not in p.stderr


def test_run_cut_short_by_the_context_says_so(tok_path, cli_run):
    p = cli_run("run", tok_path, "--prompt", "def f(x):", "-n", "50", "--max-seq-len", "12", "--spec", "off",
                 "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["finish_reason"] == "length" and out["context_limited"] is True and len(out["token_ids"]) < 50
    assert "cut short: the context is full" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = cli_run("run", tok_path, "--prompt", "def f(x):", "-n", "3", "--spec", "off", "--json")
    assert json.loads(p.stdout)["context_limited"] is False and "cut short" not in p.stderr


def _copy(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, str(dst))
    return str(dst)


def test_nan_config_is_refused_naming_the_field(tok_path, tmp_path, cli_run):
    path = _copy(tok_path, tmp_path / "nan")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        text = f.read()
    cfg = json.loads(text)
    where = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else cfg
    where["rope_theta"] = float("nan")
    with open(cfg_path, "w") as f:
        f.write(json.dumps(cfg))                  # Python writes NaN, as a careless exporter would
    for args in (["run", path, "--prompt", "x", "-n", "2"], ["info", path]):
        p = cli_run(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert "'rope_theta' must be > 0 and finite" in p.stderr and "nan" in p.stderr


def test_nan_weight_is_refused_naming_the_tensor(tok_path, tmp_path):
    from safetensors.torch import load_file, save_file

    from specfire.errors import CheckpointError

    path = _copy(tok_path, tmp_path / "nanw")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("mlp.up_proj.weight"))
    tensors[name][3, 5] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor '.*mlp\.up_proj\.weight' has 1 NaN or infinite"):
        LLM(path, device="cpu", progress=False)


def test_info_lists_only_tp_degrees_the_engine_accepts(tmp_path, capsys):
    from tinymodels import make_checkpoint

    src = make_checkpoint(str(tmp_path / "src"), "base", seed=3)
    assert cli.main(["info", src, "--json"]) == 0
    assert 2 in json.loads(capsys.readouterr().out)["tp_degrees"]        # the dense model splits in two
    dst = str(tmp_path / "q4")
    assert cli.main(["quantize", src, dst, "--group-size", "64", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert cli.main(["info", dst, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tp_degrees"] == [1] and "4-bit" in d["tp_note"]
    for tp in d["tp_degrees"]:                  # every degree listed loads (the others are refused)
        with LLM(dst, tp=tp, device="cpu", progress=False):
            pass
    with pytest.raises(Exception, match="4-bit"):
        LLM(dst, tp=2, device="cpu", progress=False)


def test_test_extra_does_not_pull_triton():
    """`pip install -e ".[test]"` installs no triton (286 MB) on a CPU machine; the README's test
    command and CI add the `kernels` extra, which the kernel tests (Triton's CPU interpreter) need."""
    try:
        import tomllib
    except ModuleNotFoundError:                 # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert not any(r.startswith("triton") for r in extras["test"]), extras["test"]
    assert any(r.startswith("triton") for r in extras["kernels"])
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = f.read().split("```")[1::2]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    cmd = 'pip install torch==2.13.0 -e ".[test,kernels]" && pytest'
    assert blocks[1].strip() == cmd and "test_cmd=$(block 2)" in ci     # CI runs the README's second block


def test_license_is_the_apache_text_pyproject_names():
    try:
        import tomllib
    except ModuleNotFoundError:                 # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["license"] == "Apache-2.0"     # an SPDX expression (PEP 639)
    with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("Copyright 2026 specfire authors\n")
    for part in ("Apache License\n                           Version 2.0, January 2004",
                 "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional "
                 "Liability.", "END OF TERMS AND CONDITIONS", "http://www.apache.org/licenses/LICENSE-2.0"):
        assert part in text, part
