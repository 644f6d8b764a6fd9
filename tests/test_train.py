"""The trainer's batched forward equals the inference modules, and the whole recipe runs on the CPU."""
from __future__ import annotations

import json
import os

import pytest
import torch

from specfire.api import LLM
from specfire.config import SamplingParams
from specfire.train import model as tm
from specfire.train.corpus import HELD_OUT, build_corpus
from specfire.train.train import PRESETS, TrainConfig, run
from tinymodels import make_checkpoint


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    make_checkpoint(d, "gqa4", seed=int(torch.randint(0, 1000, ()).item()))
    llm = LLM(d, device="cpu", dtype="float32", spec="mtp", progress=False)
    yield llm
    llm.close()


def test_training_forward_matches_inference_logits(tiny_llm):
    trunk = tiny_llm.engine.trunk.model
    v = trunk.cfg.vocab_size
    ids = torch.randint(0, v, (3, 137))                 # not a multiple of the GDN chunk
    ref = torch.stack([tiny_llm.score(row.tolist()) for row in ids])
    with torch.no_grad():
        got = tm.lm_logits(trunk, tm.trunk_hidden(trunk, ids))
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


def test_chained_mtp_rows_match_the_drafter_convention(tiny_llm):
    """Step s of the training MTP forward at position p equals the head run step by step as the
    drafter does: trunk-fed rows up to p-s+1, then its own post-norm output fed back."""
    trunk = tiny_llm.engine.trunk.model
    head = tiny_llm.engine.drafters["mtp"].head
    t = 90
    ids = torch.randint(0, trunk.cfg.vocab_size, (2, t))
    with torch.no_grad():
        h = tm.trunk_hidden(trunk, ids)
        outs = tm.mtp_hidden(head, trunk, ids, h, steps=3)
        for b, p0 in ((0, 0), (1, 17), (0, 70)):
            x = ids[b]
            st = head.new_state(t + 4, torch.float32)
            if p0 > 0:
                head(trunk.embed_tokens(x[1:p0 + 1]), h[b, :p0], 0, st, rows=False)
            _, post = head(trunk.embed_tokens(x[p0 + 1:p0 + 2]), h[b, p0:p0 + 1], p0, st, rows=True)
            assert torch.allclose(post[0], outs[0][b, p0], atol=1e-4, rtol=1e-4)
            for s in (2, 3):
                p = p0 + s - 1
                _, post = head(trunk.embed_tokens(x[p + 1:p + 2]), post, p, st, rows=True)
                assert torch.allclose(post[0], outs[s - 1][b, p], atol=1e-4, rtol=1e-4), (b, p0, s)


def test_corpus_holds_out_the_documented_modules():
    c = build_corpus()
    train = {r for r, _ in c.train}
    held = {r for r, _ in c.held_out}
    assert held and not (train & held)
    assert all(any(r == h or (h.endswith("/") and r.startswith(h)) for h in HELD_OUT) for r in held)
    assert not any(r.endswith(("test_json/__init__.py", "test_csv.py", "test_argparse.py")) for r in train)


def test_tiny_recipe_end_to_end(tmp_path):
    out = str(tmp_path / "ckpt")
    kw = dict(PRESETS["tiny"])
    kw.update(steps=3, max_files=25, eval_windows=2, seq_len=64)
    m = run(TrainConfig(out=out, device="cpu", **kw), log=lambda *_: None)
    assert m["steps_done"] == 3 and m["held_out"]["ppl"] > 1
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"].count("full_attention") * 3 == cfg["layer_types"].count("linear_attention")
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    with LLM(out, device="cpu", spec="mtp", progress=False) as llm:
        assert llm.mtp_loaded
        assert llm.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi<|im_end|>")
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        a = llm.generate("def f(x):", sp, spec="off")
        b = llm.generate("def f(x):", sp, spec={"mode": "mtp", "k": 3})
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        ids = llm.tokenizer.encode("import os\n\ndef main():\n    return 0\n")
        ours = llm.score(ids)
    from transformers import Qwen3_5ForCausalLM      # the export is a real HF checkpoint

    hf = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ((ref - ours).abs().max() / ref.abs().max()).item() < 1e-4


# ---- the site corpus: licences, deduplication, held-out packages, transfer packing ---------------

def _meta(**fields):
    from email.message import Message

    m = Message()
    for k, v in fields.items():
        for item in (v if isinstance(v, list) else [v]):
            m[k.replace("_", "-")] = item
    return m


def test_spdx_expressions():
    from specfire.train.licences import spdx_permissive

    assert spdx_permissive("MIT") and spdx_permissive("Apache-2.0 OR BSD-2-Clause")
    assert spdx_permissive("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-3-Clause")
    assert spdx_permissive("(MIT OR GPL-3.0-only) AND BSD-3-Clause")
    assert not spdx_permissive("MPL-2.0 AND MIT") and not spdx_permissive("GPL-2.0-or-later")
    assert not spdx_permissive("LicenseRef-NVIDIA-Proprietary") and not spdx_permissive("MIT AND (")
    assert not spdx_permissive("GPL-2.0 WITH Classpath-exception-2.0")


def test_licence_classification_reads_every_metadata_source():
    from specfire.train.licences import classify

    assert classify(_meta(License_Expression="BSD-3-Clause")).permissive
    assert not classify(_meta(License_Expression="MPL-2.0")).permissive
    assert classify(_meta(License="Apache 2.0 License")).name == "Apache-2.0"
    assert classify(_meta(License="BSD 3-Clause License\n\nCopyright (c) someone\nRedistribution ...")).permissive
    bsd = "License :: OSI Approved :: BSD License"
    gpl = "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"
    assert classify(_meta(Classifier=[bsd])).permissive
    assert not classify(_meta(Classifier=[bsd, gpl])).permissive          # which one applies is unknown
    assert not classify(_meta(License="MIT", Classifier=[gpl])).permissive
    assert not classify(_meta(License="LGPL")).permissive
    assert not classify(_meta()).permissive                                # nothing known: refused
    mit_text = "Permission is hereby granted, free of charge, to any person obtaining a copy"
    assert classify(_meta(), [mit_text]).name == "MIT"


def test_deduper_drops_exact_and_near_copies():
    from specfire.train.sources import Deduper

    body = "".join(f"    value_{i} = compute_something(argument_{i}, {i})\n" for i in range(30))
    d = Deduper()
    assert d.seen("def a():\n" + body) == ""
    assert d.seen("def a():\n" + body + "\n\n") == "exact_dup"
    renamed = "def b():\n" + body.replace("value_3 ", "other_3 ").replace("value_7 ", "other_7 ")
    assert d.seen(renamed) == "near_dup"
    fresh = "".join(f"    total_{i} += weights[{i}] * inputs[{i}]\n" for i in range(30))
    assert d.seen("def c():\n" + fresh) == ""


def test_site_corpus_holds_out_whole_packages_and_refuses_unknown_licences():
    from specfire.train.corpus import build_site_corpus
    from specfire.train.sources import distributions

    held = ("jinja2", "packaging")
    c = build_site_corpus(held, max_files=3)
    by_name = {p.name: p for p in c.packages}
    train_pkgs = {r.split("/")[0] for r, _ in c.train if "/" in r}
    for name in held:
        if name in by_name:
            assert by_name[name].role == "held_out" and name not in train_pkgs
            assert any(r.startswith(name + "/") for r, _ in c.held_out)
    refused = {p.name for p, _ in distributions() if not p.permissive}
    assert not (train_pkgs & refused)
    assert c.held_out_stdlib and all(by_name[p].permissive for p in train_pkgs if p in by_name)
    assert by_name["python-stdlib"].licence == "PSF-2.0" and by_name["python-stdlib"].files > 0


def test_pack_splits_and_rejoins(tmp_path):
    import tarfile

    from specfire.train.evaluate import pack

    src = tmp_path / "ck"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2500))
    (src / "b.txt").write_text("hello")
    parts = pack(str(src), str(tmp_path / "out"), part_bytes=1000)
    assert len(parts) >= 3 and all(os.path.getsize(p) <= 1000 for p in parts)
    joined = tmp_path / "j.tar"
    joined.write_bytes(b"".join(open(p, "rb").read() for p in parts))
    with tarfile.open(joined) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    assert (tmp_path / "x" / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
