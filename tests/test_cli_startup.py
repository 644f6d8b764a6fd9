"""The command line before a command runs: `--help` and flag errors without torch, a missing
package named in one line, vLLM's flag spellings, global flags after the subcommand."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repo import REPO
from specfire import cli
from specfire.params import SpecPolicy



def python(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a fresh interpreter that imports this checkout."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)


# each argv through cli.main in one interpreter; after each, which heavy modules are loaded
PROBE = """
import json, sys
from specfire.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    print(json.dumps([argv, rc, "torch" in sys.modules, "fastapi" in sys.modules]), file=sys.__stderr__)
"""

HELP_AND_ERRORS = [["--help"], ["run", "--bogus"], ["run", "-n", "ten"], ["frobnicate"], ["run", "--spec", "x"],
                   ["run", "--help"], ["info", "--help"], ["bench", "--help"], ["quantize", "--help"],
                   ["train", "--help"], ["daemon", "--help"], ["serve", "--port", "http"], ["serve", "--help"]]


def test_help_and_flag_errors_load_no_torch():
    """Every subcommand's --help and a flag error are answered before torch loads (it took 5-8 s
    on a busy machine); the top-level help loads no subcommand's module either."""
    p = python(PROBE.replace("sys.argv[1]", repr(json.dumps(HELP_AND_ERRORS))))
    rows = [json.loads(line) for line in p.stderr.splitlines() if line.startswith("[[")]
    assert [r[0] for r in rows] == HELP_AND_ERRORS, p.stderr
    for argv, rc, torch_loaded, fastapi_loaded in rows:
        assert not torch_loaded, argv
        assert rc == (0 if "--help" in argv else 2), (argv, rc)
    assert rows[0][3] is False                      # `specfire --help` did not import the server
    p = python("import runpy, sys; sys.argv = ['specfire', '--help']; runpy.run_module('specfire', run_name='__main__')",
               "-X", "importtime")
    assert p.returncode == 0 and "COMMAND" in p.stdout
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "specfire.cli" in imported and "torch" not in imported


MISSING = """
import sys
sys.modules[sys.argv[1]] = None                    # the package cannot be imported
from specfire.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_serve_without_fastapi_names_the_package():
    """It said `unrecognized arguments: --host ... --port ...` (the flags were never registered)."""
    argv = ["serve", "--host", "127.0.0.1", "--port", "8123"]
    p = subprocess.run([sys.executable, "-c", MISSING, "fastapi", *argv], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == ("specfire: error: 'specfire serve' needs the Python package fastapi, which is not "
                        "installed: pip install fastapi uvicorn\n"), p.stderr


def test_serve_without_uvicorn_names_the_package(cli_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    r = cli_run("serve", "--port", "8123")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == ("specfire: error: 'specfire serve' needs the Python package uvicorn, which is not "
                        "installed: pip install fastapi uvicorn\n")


def parse(*argv: str):
    return cli.build_parser(list(argv)).parse_args(list(argv))


@pytest.mark.parametrize("command", ["run", "serve"])
def test_vllm_spellings_of_the_model_flags(command):
    ours = parse(command, "--tp", "2", "--max-seq-len", "512")
    for tp in (["--tensor-parallel-size", "2"], ["-tp", "2"]):
        theirs = parse(command, *tp, "--max-model-len", "512")
        assert (theirs.tp, theirs.max_seq_len) == (ours.tp, ours.max_seq_len) == (2, 512)
    if command == "run":
        assert parse("run", "-t", "0.5", "-tp", "2").temperature == 0.5      # -t stays the temperature


def test_tp_invariant_flag_reaches_the_llm(monkeypatch):
    """--tp-invariant on run, serve, daemon and bench battery; run's and serve's reach LLM(tp_invariant=...)."""
    import specfire.api

    seen = []

    class Recorder:
        def __init__(self, model, **kw):
            seen.append(kw["tp_invariant"])

    monkeypatch.setattr(specfire.api, "LLM", Recorder)
    for command in ("run", "serve"):
        for argv, want in (((), False), (("--tp-invariant",), True)):
            cli.load_model(parse(command, *argv))
            assert seen.pop() is want, (command, argv)
    assert parse("daemon", "--tp-invariant").tp_invariant and not parse("daemon").tp_invariant
    assert parse("bench", "battery", "--tp-invariant").tp_invariant


def test_global_flags_after_the_subcommand(cli_run):
    a = parse("run", "-v", "--threads", "2", "--prompt", "x")
    assert a.verbose is True and a.threads == 2 and a.prompt == "x"
    a = parse("-v", "--threads", "3", "run")               # left out after the command: the first ones stay
    assert a.verbose is True and a.threads == 3
    a = parse("run")
    assert a.verbose is False and a.threads is None
    assert parse("--thr", "2", "info").threads == 2        # an abbreviation takes its value too
    r = cli_run("run", "--threads", "0", "--prompt", "x")
    assert r.returncode == 2 and r.stderr == "specfire: error: --threads must be >= 1, got 0\n"


def test_speculative_config_maps_to_the_policy():
    from specfire.flags import speculative_config

    assert speculative_config('{"method": "mtp", "num_speculative_tokens": 2}') == (SpecPolicy("mtp", 2), (1, 4))
    assert speculative_config('{"method": "qwen3_next_mtp"}') == (SpecPolicy("mtp", 3), (1, 4))
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                              '"prompt_lookup_max": 3}') == (SpecPolicy("ngram", 5), (2, 3))
    assert speculative_config('{"method": "ngram", "prompt_lookup_max": 3}') == (SpecPolicy("ngram", 3), (3, 3))
    assert speculative_config('{"method": "off"}')[0].mode == "off"
    assert speculative_config('{"method": "auto", "num_speculative_tokens": 4}')[0] == SpecPolicy("auto", 4)


@pytest.mark.parametrize("text,message", [
    ("{method: mtp}", "--speculative-config is not valid JSON"),
    ('"mtp"', "--speculative-config must be a JSON object"),
    ('{"method": "eagle"}', "--speculative-config method must be mtp (or a model's *_mtp name), ngram, auto or "
                            "off, got 'eagle'"),
    ('{"num_speculative_tokens": 3}', "method must be mtp"),
    ('{"method": "mtp", "model": "x"}', "--speculative-config has unknown key(s) model; allowed: method, "
                                        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max"),
    ('{"method": "mtp", "num_speculative_tokens": 11}', "num_speculative_tokens must be <= 10, got 11"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer, got 0"),
    ('{"method": "mtp", "num_speculative_tokens": "3"}', "must be a positive integer, got '3'"),
    ('{"method": "mtp", "prompt_lookup_max": 3}', "apply to method ngram or auto, not 'mtp'"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min 4 is above"),
])
def test_bad_speculative_config_is_one_line(text, message, cli_run):
    r = cli_run("run", "--prompt", "x", "--speculative-config", text)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("specfire: error: ") and message in r.stderr, r.stderr


def test_speculative_config_and_spec_flags_exclude_each_other(cli_run):
    for flag in (["--spec", "mtp"], ["--spec-k", "2"], ["--ngram-n", "1:3"]):
        r = cli_run("run", "--prompt", "x", "--speculative-config", '{"method": "mtp"}', *flag)
        assert r.returncode == 2 and f"--speculative-config and {flag[0]} both set the speculation" in r.stderr


def test_speculative_config_runs_as_the_spec_flags(tok_path, cli_run):
    ours = cli_run("run", tok_path, "--device", "cpu", "--prompt", "def f(x):", "-n", "12", "--spec", "mtp",
                   "--spec-k", "2", "--json")
    theirs = cli_run("run", tok_path, "--device", "cpu", "--prompt", "def f(x):", "-n", "12", "--speculative-config",
                     '{"method": "mtp", "num_speculative_tokens": 2}', "--json")
    assert ours.returncode == theirs.returncode == 0, theirs.stderr
    a, b = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert a["token_ids"] == b["token_ids"] and (b["stats"]["route"], b["stats"]["k"]) == ("mtp", 2)


def help_entry(command: str, flag: str, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    opts = " ".join(out[out.index("options:"):].split())
    entry = opts[opts.index(flag + " "):]
    return entry[:entry.find(" --", len(flag))]


def test_dtype_help_lists_what_the_api_takes(capsys):
    from specfire.params import DTYPE_NAMES

    entry = help_entry("run", "--dtype", capsys)
    assert all(name in entry for name in DTYPE_NAMES), entry


def test_dtype_checked_before_torch_loads():
    code = ("import sys\nfrom specfire.cli import main\nrc = main(['run', '--prompt', 'x', '--dtype', 'int8'])\n"
            "print(rc, 'torch' in sys.modules)")
    p = python(code)
    assert p.stdout.split() == ["2", "False"] and "--dtype must be one of auto, float32" in p.stderr


@pytest.mark.parametrize("command,whose", [("run", "default"), ("serve", "default for requests that leave the field out")])
def test_penalty_help_reads_well(command, whose, capsys):
    for flag, neutral in (("--repetition-penalty", "1"), ("--presence-penalty", "0"), ("--frequency-penalty", "0")):
        entry = help_entry(command, flag, capsys)
        assert entry.endswith(f"; {neutral} is off ({whose}: the model's generation_config.json value, else "
                              f"{neutral})"), entry
