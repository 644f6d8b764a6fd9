"""bench/peers on the CPU: the checkpoint pair, the specfire runner, the table builder, and the
ExLlamaV3 runner's one-line refusal without CUDA (the GPU run itself is `python -m bench.peers.run`)."""
import json
import os
import sys

import pytest
import torch

from bench.peers import common, make_ckpt, table


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    ck = make_ckpt.make("tiny", str(root), "cpu", torch.float32, tokenizer=False)
    prompts = common.make_prompts(common.TINY_VOCAB, 2, 8)
    pf = root / "prompts.json"
    pf.write_text(json.dumps(prompts))
    return ck, str(pf)


def run_main(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    module.main()


def test_pair_shares_shards_and_ties_only_the_norms(pair):
    ck, _ = pair
    normal, tied = ck["normal"], ck["tied"]
    shards = [f for f in os.listdir(tied) if f.endswith(".safetensors") and f != common.NORMS_FILE]
    assert shards and all(os.path.islink(os.path.join(tied, f)) for f in shards)
    from safetensors.torch import load_file
    n, t = load_file(os.path.join(normal, common.NORMS_FILE)), load_file(os.path.join(tied, common.NORMS_FILE))
    assert sorted(t) == sorted(common.NORM_KEYS)
    assert all(bool((t[k] == -1).all()) and not bool((n[k] == -1).all()) for k in t)
    with open(os.path.join(normal, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    assert wm["model.norm.weight"] == common.NORMS_FILE and any(k.startswith("mtp.") for k in wm)


def test_specfire_runner_then_table(pair, tmp_path, monkeypatch):
    from bench.peers import run_specfire
    ck, pf = pair
    out = tmp_path / "sf.json"
    run_main(run_specfire, ["--normal", ck["normal"], "--tied", ck["tied"], "--prompts", pf, "--tokens", "5",
                            "--modes", "ar,mtp3", "--out", str(out)], monkeypatch)
    sf = json.loads(out.read_text())
    ar, mtp = sf["modes"]["ar"], sf["modes"]["mtp3"]
    assert [len(x) for x in ar["token_ids"]] == [5, 5] and ar["tok_s"] > 0 and ar["ttft_s"] > 0
    assert any(t != 0 for x in ar["token_ids"] for t in x)          # normal weights: logits do not tie
    assert mtp["token_ids"] == [[0] * 5] * 2 and mtp["mean_accept_len"] > 3   # tied: every draft accepted
    # the table: transformers' tokens as the reference, one prompt diverging at token 2
    ref = [list(ar["token_ids"][0]), list(ar["token_ids"][1])]
    ref[1][2] = ref[1][2] + 1
    results = {"shapes": {"tiny": {"step_bytes": 4.17e9, "runners": {
        "specfire": {**sf, "wanted": ["ar", "mtp3"]},
        "transformers": {"version": "x", "wanted": ["eager", "static_compile"], "modes": {
            "eager": {"tok_s": 2.0, "ttft_s": 0.5, "checkpoint": "normal", "token_ids": ref},
            "static_compile": {"tok_s": 3.0, "ttft_s": 0.5, "checkpoint": "normal", "token_ids": ref[:1],
                               "compiled": True, "prompts_done": 1, "prompts_total": 2}}},
        "exllamav3": {"wanted": ["ar"], "status_line": "needs CUDA", "modes": {}}}}}}
    rows = {(r["engine"], r["mode"].split(",")[0]): r for r in table.rows(results)}
    assert rows[("specfire", "AR")]["check"] == "5/5, 2/5"
    assert rows[("specfire", "AR")]["bw"] == pytest.approx(ar["tok_s"] / 1000)
    assert rows[("specfire", "MTP k=3")]["check"].startswith("n/a")
    assert [r["check"] for r in table.rows(results) if "dynamic cache" in r["mode"]] == ["reference"]
    assert rows[("exllamav3", "AR")]["reason"] == "needs CUDA"
    cut = [r for r in table.rows(results) if "static cache" in r["mode"]]      # a run cut after prompt 1
    assert len(cut) == 1 and "1 of 2 prompts" in cut[0]["mode"] and cut[0]["check"] == "5/5"
    md = table.markdown(results)
    assert "| tiny | exllamav3 |" in md and "not run: needs CUDA" in md and "published, not measured" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_exllamav3_runner_refuses_in_one_line_without_cuda(pair, tmp_path, monkeypatch, capsys):
    from bench.peers import run_exllamav3
    ck, pf = pair
    out = tmp_path / "exl3.json"
    with pytest.raises(SystemExit) as e:
        run_main(run_exllamav3, ["--normal", ck["normal"], "--prompts", pf, "--out", str(out)], monkeypatch)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs CUDA" in err
    assert "needs CUDA" in json.loads(out.read_text())["error"]


def fake_exllamav3(monkeypatch, bias: float = 1.0):
    """The part of ExLlamaV3's API the runner calls, faked on the CPU: the generator emits token 0
    with every draft accepted when both final norms are tied (weight -1, bias 1: output 0), else 7."""
    import importlib.machinery
    import types

    class RMSNorm:
        def __init__(self, key):
            self.key, self.constant_bias, self.weight = key, bias, None

        def load(self):
            self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    class Model:
        loads: list = []

        def __init__(self, cfg, component):
            self.cfg, self.component = cfg, component
            self.final_norm = RMSNorm("mtp.norm" if component == "mtp" else "model.norm")
            self.modules = ["embed", self.final_norm, "lm_head"]
            self.logit_layer_idx = 2

        @classmethod
        def from_config(cls, cfg, component="model"):
            return cls(cfg, component)

        def load(self, progressbar=False, draft_model=None):
            Model.loads.append((self.cfg.directory, self.component))
            self.final_norm.load()
            if self.cfg.directory.endswith("_tied"):
                self.final_norm.weight.data.fill_(-1)

        def warmup(self, cache=None):
            pass

        def unload(self):
            self.final_norm.weight = None

    def tied(m):
        return m is not None and bool((m.final_norm.weight == -1).all())      # the tied checkpoint's value

    class Generator:
        def __init__(self, model, cache, tokenizer, max_batch_size, draft_model=None, draft_cache=None,
                     num_draft_tokens=None):
            self.model, self.draft, self.jobs = model, draft_model, []

        def enqueue(self, job):
            self.jobs.append(job)

        def num_remaining_jobs(self):
            return len(self.jobs)

        def iterate(self):
            job = self.jobs.pop()
            both = tied(self.model) and tied(self.draft)
            t = 0 if tied(self.model) else 7
            n = job.max_new_tokens
            acc = n - 1 if both else 0
            return [{"stage": "streaming", "token_ids": torch.full((1, n), t)},
                    {"stage": "streaming", "eos": True, "accepted_draft_tokens": acc,
                     "rejected_draft_tokens": 0 if both else (n - 1 if self.draft else 0), "cached_tokens": 0}]

    class Job:
        def __init__(self, input_ids, max_new_tokens, sampler, stop_conditions):
            self.max_new_tokens = max_new_tokens

    class Config:
        def __init__(self, directory, *a, **kw):
            self.directory = directory

    class BaseModel:
        def __init__(self, config=None, **kw):
            pass

    mods = {}
    for name in ("exllamav3", "exllamav3.architecture", "exllamav3.architecture.qwen3_5",
                 "exllamav3.architecture.qwen3_5_mtp", "exllamav3.modules", "exllamav3.modules.rmsnorm"):
        m = mods[name] = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, m)
    e = mods["exllamav3"]
    e.__version__, e.Model, e.Generator, e.Job = "fake", Model, Generator, Job
    e.Cache = lambda *a, **kw: object()
    e.Tokenizer = types.SimpleNamespace(from_config=lambda cfg: None)
    e.ArgmaxSampler = object
    mods["exllamav3.architecture.qwen3_5"].Qwen3_5BaseModel = BaseModel
    mods["exllamav3.architecture.qwen3_5"].Qwen3_5VLBaseConfig = Config
    mods["exllamav3.architecture.qwen3_5_mtp"].Qwen3_5MTPModel = object
    mods["exllamav3.modules.rmsnorm"].RMSNorm = RMSNorm
    return Model


@pytest.mark.parametrize("bias", [1.0, 0.0])
def test_exllamav3_runner_flow_ties_in_place_or_loads_the_tied_checkpoint(pair, tmp_path, monkeypatch, bias):
    """AR on the normal weights, then the head loaded onto the same trunk with both final norms set
    in place (bias 1); when that cannot be done (bias 0 here), the tied checkpoint is loaded."""
    from bench.peers import run_exllamav3
    Model = fake_exllamav3(monkeypatch, bias)
    monkeypatch.setattr(run_exllamav3.common, "device", lambda: "cuda")
    ck, pf = pair
    out = tmp_path / "exl3.json"
    run_main(run_exllamav3, ["--normal", ck["normal"], "--tied", ck["tied"], "--prompts", pf, "--tokens", "4",
                             "--out", str(out)], monkeypatch)
    r = json.loads(out.read_text())
    assert r["modes"]["ar"]["token_ids"] == [[7] * 4] * 2 and r["modes"]["ar"]["checkpoint"] == "normal"
    for m in ("mtp1", "mtp3"):
        assert r["modes"][m]["token_ids"] == [[0] * 4] * 2 and r["modes"][m]["draft_accept_rate"] == 1.0
    if bias == 1.0:
        assert r["tied_in_place"] == ["model.norm", "mtp.norm"]
        assert r["modes"]["mtp3"]["checkpoint"].startswith("tied (final norms set to -1 in place")
        assert Model.loads == [(ck["normal"], "model"), (ck["normal"], "mtp")]
    else:
        assert "constant bias 1" in r["tie_in_place_error"] and r["modes"]["mtp3"]["checkpoint"] == "tied"
        assert Model.loads[-2:] == [(ck["tied"], "mtp"), (ck["tied"], "model")]


def test_warm_shape_keeps_the_widths_in_two_layers():
    big, warm = common.cfg_for("27B"), common.cfg_for("27B" + common.WARM)
    assert warm.layer_types == ("linear_attention", "full_attention") and warm.vocab_size == 4096
    for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "linear_num_key_heads", "linear_num_value_heads", "head_dim"):
        assert getattr(warm, f) == getattr(big, f), f


def test_dry_plan_transformers_yields_to_exllamav3_once_built(tmp_path, monkeypatch):
    """run.py --dry: the real scheduling with sleeping stand-ins; a long transformers task is stopped
    once the ExLlamaV3 build is done (after --hf-yield-after), and ExLlamaV3 then runs."""
    from bench.peers import run
    monkeypatch.setattr(sys, "argv", ["run.py", "--dry", "build=40,ckpt=5,specfire=5,transformers=400,exllamav3=5,install=0",
                                      "--shapes", "tiny", "--budget", "150", "--dry-scale", "0.03", "--hf-yield-after", "10",
                                      "--hf-late-min", "500", "--out", str(tmp_path)])
    run.main()
    res = json.loads((tmp_path / "results.json").read_text())
    r = res["shapes"]["tiny"]["runners"]
    assert r["transformers"]["task_status"].startswith("stopped after") and r["exllamav3"]["task_status"] == "ok"
    done = {e["what"]: e["t"] for e in res["timeline"]}
    assert done["exl3 build ended"] <= done["transformers tiny done"] < done["exllamav3 tiny done"] < 150
