"""The checkpoint's generation_config.json supplies the default sampling (vLLM's `--generation-config
auto`): the keys read and checked, `do_sample: false` as greedy, and the defaults applied to what a
request leaves out (and overridden by what it sets) in the Python API, `specfire run`, the HTTP
server and the JSON-lines daemon; `generation_config="none"` / `--generation-config none` opts out."""
from __future__ import annotations

import io
import json
import os
import socket

import pytest

from specfire import LLM, SamplingParams
from specfire.api import BUNDLED_MODEL
from specfire.config import GenerationDefaults
from specfire.errors import ConfigError

PROMPT = "def add(a, b):"
PEN = {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 1.0}
N = 12


def write_gen(path: str, **keys) -> None:
    gp = os.path.join(path, "generation_config.json")
    with open(gp) as f:
        raw = json.load(f)
    raw = {"eos_token_id": raw["eos_token_id"], **keys}
    with open(gp, "w") as f:
        json.dump(raw, f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tokenizer checkpoint whose generation_config.json asks for greedy with penalties and 12 tokens."""
    from tinytok import make_tok_checkpoint

    path = make_tok_checkpoint(str(tmp_path_factory.mktemp("gencfg") / "ckpt"), seed=3)
    write_gen(path, do_sample=False, temperature=0.7, max_new_tokens=N, **PEN)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, device="cpu", progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def refs(llm):
    """What the model's defaults give (greedy, the penalties, 12 tokens) and plain greedy."""
    want = llm.generate(PROMPT, SamplingParams(max_tokens=N, **PEN), spec="off")
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=N), spec="off")
    assert want.token_ids != plain.token_ids          # the penalties change this completion
    assert len(want.token_ids) == N                   # and it is not cut short by an eos
    return want, plain


# ---- reading the file ----------------------------------------------------------------------------

def test_keys_read_and_mapped():
    g = GenerationDefaults.from_dict({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                      "repetition_penalty": 1.1, "max_new_tokens": 300, "presence_penalty": 0.2,
                                      "frequency_penalty": -0.5, "do_sample": True, "num_beams": 1,
                                      "eos_token_id": [1, 2], "pad_token_id": None})
    assert g.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1,
                           "presence_penalty": 0.2, "frequency_penalty": -0.5, "max_tokens": 300}
    assert g.notes == ()
    assert GenerationDefaults.from_dict({"top_k": -1}).as_dict() == {"top_k": 0}      # -1: no top-k, as 0
    assert GenerationDefaults.from_dict({"temperature": None, "top_p": None}).as_dict() == {}   # null: unset
    assert not GenerationDefaults.from_dict({"eos_token_id": 3, "pad_token_id": 3})


def test_do_sample_false_is_greedy_whatever_temperature_says():
    g = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7, "top_p": 0.8})
    assert g.as_dict() == {"temperature": 0.0, "top_p": 0.8}
    assert g.notes == ("do_sample false: greedy (temperature 0.7 is ignored)",)
    assert GenerationDefaults.from_dict({"do_sample": False}).as_dict() == {"temperature": 0.0}
    # do_sample true without a temperature samples at HF's default temperature, 1
    assert GenerationDefaults.from_dict({"do_sample": True, "top_k": 5}).as_dict() == {"temperature": 1.0, "top_k": 5}
    assert GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.3}).as_dict() == {"temperature": 0.3}
    assert GenerationDefaults.from_dict({"temperature": 0.3}).as_dict() == {"temperature": 0.3}   # vLLM's reading


@pytest.mark.parametrize("key,value,word", [
    ("temperature", "0.7", "must be a finite number, got '0.7'"),
    ("temperature", -1, "must be >= 0.0"),
    ("top_p", 0, "must be > 0.0"),
    ("top_p", 1.5, "must be <= 1.0"),
    ("top_k", 2.5, "must be an integer"),
    ("top_k", -2, "must be >= 0"),
    ("min_p", 2, "must be <= 1.0"),
    ("repetition_penalty", 0, "must be > 0.0"),
    ("presence_penalty", 3, "must be <= 2.0"),
    ("frequency_penalty", [1], "must be a finite number"),
    ("max_new_tokens", 0, "must be >= 1"),
    ("max_new_tokens", True, "must be an integer"),
    ("do_sample", "false", "must be true or false"),
])
def test_bad_values_name_the_file_and_the_key(key, value, word):
    with pytest.raises(ConfigError) as e:
        GenerationDefaults.from_dict({key: value}, "/ckpt/generation_config.json")
    msg = str(e.value)
    assert msg.startswith(f"/ckpt/generation_config.json: '{key}' ") and word in msg, msg
    assert "--generation-config none" in msg


def test_from_dir_modes(tmp_path):
    assert not GenerationDefaults.from_dir(str(tmp_path))                  # no file: no defaults
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"repetition_penalty": 1.2}, f)
    g = GenerationDefaults.from_dir(str(tmp_path))
    assert g.as_dict() == {"repetition_penalty": 1.2} and g.source == str(tmp_path / "generation_config.json")
    assert not GenerationDefaults.from_dir(str(tmp_path), "none")
    with pytest.raises(ValueError, match="generation_config must be one of auto, none, got 'vllm'"):
        GenerationDefaults.from_dir(str(tmp_path), "vllm")


def test_bundled_defaults():
    """The bundled model's demo defaults: greedy with a light repetition penalty and a frequency
    penalty (its MODEL_CARD says why); the eos ids stay."""
    g = GenerationDefaults.from_dir(BUNDLED_MODEL)
    assert g.as_dict() == {"temperature": 0.0, "repetition_penalty": 1.05, "frequency_penalty": 0.7}
    with open(os.path.join(BUNDLED_MODEL, "generation_config.json")) as f:
        raw = json.load(f)
    assert raw["do_sample"] is False and raw["eos_token_id"] == [4093, 4095]
    assert SamplingParams() == SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                                              frequency_penalty=0.0)   # the dataclass itself stays neutral


# ---- the Python API ------------------------------------------------------------------------------

def test_api_defaults_apply_without_params(llm, refs):
    want, plain = refs
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=N, temperature=0.0, **PEN)
    assert llm.generate(PROMPT, spec="off").token_ids == want.token_ids
    assert llm.generate(PROMPT, spec={"mode": "mtp", "k": 2}).token_ids == want.token_ids
    assert "".join(c.text for c in llm.stream(PROMPT, spec="off")) == want.text
    # an explicit SamplingParams is taken as it is: SamplingParams() stays plain greedy
    assert llm.generate(PROMPT, SamplingParams(max_tokens=N), spec="off").token_ids == plain.token_ids
    # overrides of single fields keep the rest of the model's defaults
    sp = llm.get_default_sampling_params(frequency_penalty=0.0, max_tokens=5, top_p=None)
    assert sp == SamplingParams(max_tokens=5, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0.0"):
        llm.get_default_sampling_params(repetition_penalty=0)


def test_api_opt_out(ckpt, refs):
    _, plain = refs
    with LLM(ckpt, device="cpu", progress=False, generation_config="none") as m:
        assert not m.generation_defaults and m.get_default_sampling_params() == SamplingParams()
        assert m.generate(PROMPT, spec="off").token_ids == \
            m.generate(PROMPT, SamplingParams(), spec="off").token_ids
        assert m.generate(PROMPT, spec="off").token_ids[:N] == plain.token_ids
    with pytest.raises(ValueError, match="generation_config must be one of auto, none"):
        LLM(ckpt, device="cpu", progress=False, generation_config="vllm")


def test_bad_file_refuses_to_load_unless_opted_out(tmp_path):
    from tinytok import make_tok_checkpoint

    path = make_tok_checkpoint(str(tmp_path / "ckpt"), seed=1)
    write_gen(path, top_p=0)
    with pytest.raises(ConfigError, match=r"generation_config.json: 'top_p' must be > 0.0, got 0"):
        LLM(path, device="cpu", progress=False)
    with LLM(path, device="cpu", progress=False, generation_config="none") as m:
        assert m.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)).token_ids


# ---- specfire run ---------------------------------------------------------------------------------

def run_json(cli_run, *args):
    p = cli_run("run", *args, "--prompt", PROMPT, "--spec", "off", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_run_flags_over_model_over_builtin(ckpt, llm, refs, cli_run):
    want, plain = refs
    out, err = run_json(cli_run, ckpt)
    assert out["token_ids"] == want.token_ids
    line = ("[specfire] default sampling from the model's generation_config.json: repetition_penalty=1.4, "
            "presence_penalty=0.5, frequency_penalty=1, max_tokens=12 (--generation-config none for the "
            "built-in defaults)")
    assert err.splitlines()[0] == line, err
    # every flag given: nothing comes from the model, no line
    out, err = run_json(cli_run, ckpt, "-n", str(N), "--repetition-penalty", "1", "--presence-penalty", "0",
                        "--frequency-penalty", "0")
    assert out["token_ids"] == plain.token_ids and "generation_config" not in err
    # one flag: the rest from the model
    out, err = run_json(cli_run, ckpt, "--frequency-penalty", "0")
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=N, repetition_penalty=1.4, presence_penalty=0.5), spec="off")
    assert out["token_ids"] == ref.token_ids
    assert "repetition_penalty=1.4, presence_penalty=0.5, max_tokens=12 (" in err
    # the opt-out: built-in defaults (128 tokens, greedy, no penalty)
    out, err = run_json(cli_run, ckpt, "--generation-config", "none", "-n", str(N))
    assert out["token_ids"] == plain.token_ids and "generation_config" not in err
    p = cli_run("run", ckpt, "--generation-config", "vllm", "--prompt", "x")
    assert p.returncode == 2 and "invalid choice: 'vllm'" in p.stderr


def test_run_temperature_from_the_model(tmp_path, cli_run):
    """A sampling model (do_sample true, temperature 0.8): `specfire run` samples unless -t 0."""
    from tinytok import make_tok_checkpoint

    path = make_tok_checkpoint(str(tmp_path / "ckpt"), seed=3)
    write_gen(path, do_sample=True, temperature=0.8, top_k=7)
    with LLM(path, device="cpu", progress=False) as m:
        want = m.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0.8, top_k=7, seed=5), spec="off")
        greedy = m.generate(PROMPT, SamplingParams(max_tokens=N), spec="off")
    out, err = run_json(cli_run, path, "-n", str(N), "--seed", "5")
    assert out["token_ids"] == want.token_ids and "temperature=0.8, top_k=7" in err
    out, err = run_json(cli_run, path, "-n", str(N), "-t", "0")
    assert out["token_ids"] == greedy.token_ids and "temperature" not in err.splitlines()[0]


# ---- the HTTP server -------------------------------------------------------------------------------

def test_server_request_over_flags_over_model_over_builtin(ckpt, llm, refs):
    from fastapi.testclient import TestClient

    from specfire.serve.http import build_app

    want, plain = refs
    body = {"prompt": PROMPT, "ignore_eos": True}
    with TestClient(build_app(llm, "t")) as tc:
        r = tc.post("/v1/completions", json=body)        # no temperature: the model's do_sample false
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text and r.json()["usage"]["completion_tokens"] == N
        r = tc.post("/v1/completions", json={**body, "max_tokens": N, "repetition_penalty": 1, "presence_penalty": 0,
                                             "frequency_penalty": 0})
        assert r.json()["choices"][0]["text"] == plain.text
        r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == N   # max_new_tokens, not the context
    # the serve flags (sampling_defaults) beat the model's values, a request beats both
    with TestClient(build_app(llm, "t", sampling_defaults={"repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                           "frequency_penalty": 0.0})) as tc:
        assert tc.post("/v1/completions", json=body).json()["choices"][0]["text"] == plain.text
        assert tc.post("/v1/completions", json={**body, **PEN}).json()["choices"][0]["text"] == want.text


def test_server_opt_out(ckpt, refs):
    from fastapi.testclient import TestClient

    from specfire.serve.http import build_app

    _, plain = refs
    with LLM(ckpt, device="cpu", progress=False, generation_config="none") as m, \
            TestClient(build_app(m, "t")) as tc:
        r = tc.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": N, "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == plain.text
        r = tc.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16          # the completions endpoint's own default


def test_serve_startup_line(ckpt, cli_run, monkeypatch):
    """`specfire serve` says which defaults come from the model before it serves (uvicorn not run)."""
    import signal

    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = cli_run("serve", ckpt, "--device", "cpu", "--port", str(port), "--presence-penalty", "0.1")
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == ("[specfire] default sampling from the model's generation_config.json: temperature=0, "
                        "repetition_penalty=1.4, frequency_penalty=1, max_tokens=12; do_sample false: greedy "
                        "(temperature 0.7 is ignored) (--generation-config none for the built-in defaults)"), lines
    assert lines[1].startswith("[specfire] serving ckpt on ")
    p = cli_run("serve", ckpt, "--device", "cpu", "--port", str(port), "--generation-config", "none")
    assert p.returncode == 0 and p.stderr.splitlines()[0].startswith("[specfire] serving ckpt on "), p.stderr


# ---- the daemon -----------------------------------------------------------------------------------

def daemon_lines(*msgs):
    from specfire.serve.daemon import Daemon

    out = io.BytesIO()
    d = Daemon(out)
    d.run(iter([json.dumps(m).encode() for m in msgs]))   # every line answered, then the model freed
    return [json.loads(x) for x in out.getvalue().decode().splitlines()]


def daemon_text(evs, attempt):
    return "".join(e["text"] for e in evs if e["type"] == "token" and e["attempt_id"] == attempt)


def test_daemon_defaults_and_opt_out(ckpt, refs):
    want, plain = refs
    gen = {"type": "generate", "prompt": PROMPT, "ignore_eos": True, "speculation": "off"}
    evs = daemon_lines({"type": "load", "model": ckpt, "params": {"device": "cpu"}},
                       {**gen, "attempt_id": 1},
                       {**gen, "attempt_id": 2, "max_tokens": N, "repetition_penalty": 1, "presence_penalty": 0,
                        "frequency_penalty": 0},
                       {**gen, "attempt_id": 3, "speculation": {"mode": "mtp", "k": 3}})
    assert evs[0]["type"] == "loaded" and evs[0]["sampling_defaults"] == {
        "temperature": 0.0, "repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 1.0,
        "max_tokens": N}
    assert daemon_text(evs, 1) == want.text and daemon_text(evs, 3) == want.text
    assert daemon_text(evs, 2) == plain.text
    done = [e for e in evs if e["type"] == "done"]
    assert [e["tokens"] for e in done] == [N, N, N]
    evs = daemon_lines({"type": "load", "model": ckpt, "params": {"device": "cpu", "generation_config": "none"}},
                       {**gen, "attempt_id": 4, "max_tokens": N},
                       {"type": "load", "model": ckpt, "params": {"generation_config": "off"}})
    assert evs[0]["sampling_defaults"] == {} and daemon_text(evs, 4) == plain.text
    assert evs[-1]["type"] == "error" and evs[-1]["class"] == "invalid_request"
    assert "generation_config must be one of auto, none, got 'off'" in evs[-1]["message"]


def test_daemon_flag_and_bad_file(tmp_path, refs):
    from specfire.serve.daemon import Daemon

    from tinytok import make_tok_checkpoint

    _, plain = refs
    path = make_tok_checkpoint(str(tmp_path / "ckpt"), seed=1)
    write_gen(path, repetition_penalty="high")
    evs = daemon_lines({"type": "load", "id": 1, "model": path, "params": {"device": "cpu"}})
    assert evs[0]["type"] == "error" and evs[0]["class"] == "load_error"
    assert "'repetition_penalty' must be a finite number, got 'high'" in evs[0]["message"]
    out = io.BytesIO()
    d = Daemon(out, generation_config="none")          # `specfire daemon --generation-config none`
    d.handle_line(json.dumps({"type": "load", "model": path, "params": {"device": "cpu"}}).encode())
    d._unload()
    ev = json.loads(out.getvalue().decode().splitlines()[0])
    assert ev["type"] == "loaded" and ev["sampling_defaults"] == {}


# ---- specfire info ---------------------------------------------------------------------------------

def test_info_shows_the_defaults(ckpt, capsys):
    from specfire import cli

    assert cli.main(["info", ckpt, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sampling_defaults"] == {"temperature": 0.0, "repetition_penalty": 1.4, "presence_penalty": 0.5,
                                      "frequency_penalty": 1.0, "max_tokens": N}
    assert cli.main(["info", BUNDLED_MODEL]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling")]
    assert line == ["sampling     defaults from generation_config.json: temperature=0, repetition_penalty=1.05, "
                    "frequency_penalty=0.7; do_sample false: greedy (--generation-config none: built-in defaults)"]
