"""Checkpoint loading: every damaged checkpoint gives one clear CheckpointError line (naming the
tensor, the file or the field), and the CLI turns it into a one-line error and a non-zero exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpts import copy_checkpoint, tiny
from repo import REPO
from specfire import LLM, CheckpointError, SamplingParams
from specfire import cli
from specfire.model import loader

TENSOR = "model.layers.0.mlp.up_proj.weight"          # a text-layout trunk tensor [96, 64]


def _edit_tensors(path: str, fn) -> None:
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    fn(tensors)
    save_file(tensors, st, metadata={"format": "pt"})


def _edit_config(path: str, fn) -> None:
    p = os.path.join(path, "config.json")
    with open(p) as f:
        raw = json.load(f)
    fn(raw)
    with open(p, "w") as f:
        json.dump(raw, f)


def _truncate(path: str) -> None:
    st = os.path.join(path, "model.safetensors")
    size = os.path.getsize(st)
    with open(st, "r+b") as f:
        f.truncate(size // 2)


def _corrupt_header(path: str) -> None:
    st = os.path.join(path, "model.safetensors")
    data = bytearray(open(st, "rb").read())
    data[8:40] = b"#" * 32                      # the JSON header now starts with garbage
    open(st, "wb").write(bytes(data))


def _huge_header_len(path: str) -> None:
    st = os.path.join(path, "model.safetensors")
    data = bytearray(open(st, "rb").read())
    data[0:8] = (2**40).to_bytes(8, "little")
    open(st, "wb").write(bytes(data))


def _shard(path: str, drop_second: bool = False) -> str:
    """Split model.safetensors into two shards with an index; return the second shard's path."""
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    names = sorted(tensors)
    second = os.path.join(path, "model-00002-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[::2]}, os.path.join(path, "model-00001-of-00002.safetensors"))
    if not drop_second:
        save_file({n: tensors[n] for n in names[1::2]}, second)
    wm = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)
    os.remove(st)
    return second


def _missing_shard(path: str) -> None:
    _shard(path, drop_second=True)


def _truncated_shard(path: str) -> None:
    second = _shard(path)
    with open(second, "r+b") as f:
        f.truncate(os.path.getsize(second) - 100)


def _bad_index(path: str) -> None:
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")


# (id, how to damage the directory, regex the one-line message must match)
DAMAGE = [
    ("missing-tensor", lambda p: _edit_tensors(p, lambda t: t.pop(TENSOR)),
     r"missing tensor 'layers\.0\.mlp\.up_proj\.weight'"),
    ("unexpected-trunk-tensor", lambda p: _edit_tensors(p, lambda t: t.update(
        {"model.layers.1.mlp.extra_proj.weight": torch.zeros(4, 4)})),
     r"unexpected tensor '.*layers\.1\.mlp\.extra_proj\.weight'"),
    ("unknown-tensor", lambda p: _edit_tensors(p, lambda t: t.update({"foo.bar.weight": torch.zeros(2)})),
     r"unexpected tensor 'foo\.bar\.weight'"),
    ("wrong-shape", lambda p: _edit_tensors(p, lambda t: t.update({TENSOR: t[TENSOR].t().contiguous()})),
     r"tensor '.*layers\.0\.mlp\.up_proj\.weight' has shape \[64, 96\], expected \[96, 64\]"),
    ("wrong-shape-mtp", lambda p: _edit_tensors(p, lambda t: t.update(
        {"mtp.fc.weight": torch.zeros(64, 64)})),
     r"tensor 'mtp\.fc\.weight' has shape \[64, 64\], expected \[64, 128\]"),
    ("int32-tensor", lambda p: _edit_tensors(p, lambda t: t.update({TENSOR: t[TENSOR].to(torch.int32)})),
     r"'model\.layers\.0\.mlp\.up_proj\.weight'.*dtype .*int32"),
    ("fp8-scales", lambda p: _edit_tensors(p, lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1, 1)})),
     r"FP8-quantized checkpoint \(tensor 'layers\.0\.mlp\.up_proj\.weight_scale_inv'\)"),
    ("truncated", _truncate, r"truncated|corrupt"),
    ("corrupt-header", _corrupt_header, r"truncated|corrupt|not a safetensors"),
    ("huge-header", _huge_header_len, r"truncated|corrupt|not a safetensors"),
    ("no-weights", lambda p: os.remove(os.path.join(p, "model.safetensors")),
     r"no model\.safetensors or model\.safetensors\.index\.json"),
    ("missing-shard", _missing_shard, r"shard model-00002-of-00002\.safetensors .* missing"),
    ("truncated-shard", _truncated_shard, r"model-00002-of-00002\.safetensors.*truncated"),
    ("bad-index", _bad_index, r"model\.safetensors\.index\.json is malformed"),
    ("missing-config", lambda p: os.remove(os.path.join(p, "config.json")), r"config\.json not found"),
    ("config-not-json", lambda p: open(os.path.join(p, "config.json"), "w").write("{"),
     r"config\.json is not valid JSON"),
    ("unsupported-model-type", lambda p: _edit_config(p, lambda c: c.update(model_type="llama")),
     r"unsupported model_type 'llama'"),
    ("missing-field", lambda p: _edit_config(p, lambda c: c.pop("hidden_size")),
     r"missing required field 'hidden_size'"),
    ("bad-field", lambda p: _edit_config(p, lambda c: c.update(num_key_value_heads=3)),
     r"num_key_value_heads"),
]


@pytest.fixture(scope="module")
def base(ckpt_cache):
    return tiny(ckpt_cache, "base")


def _damaged(base: str, tmp_path, damage) -> str:
    path = copy_checkpoint(base, str(tmp_path / "ckpt"))
    damage(path)
    return path


@pytest.mark.parametrize("damage,pattern", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damaged_checkpoint_is_one_clear_error(base, tmp_path, damage, pattern, capsys):
    path = _damaged(base, tmp_path, damage)
    with pytest.raises(CheckpointError, match=pattern) as ei:
        LLM(path, device="cpu", progress=False)
    assert "\n" not in str(ei.value)
    # the CLI: non-zero exit, exactly one line on stderr, nothing on stdout
    rc = cli.main(["run", "--model", path, "--device", "cpu", "--prompt", "x", "-n", "2"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("specfire: error:") and str(ei.value) in err


def test_wrong_path_is_one_clear_error(tmp_path, capsys):
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointError, match="is not a directory"):
        LLM(missing, device="cpu", progress=False)
    for argv in (["run", "--model", missing, "--device", "cpu", "--prompt", "x"], ["info", missing]):
        assert cli.main(argv) != 0
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "does-not-exist" in err


def test_spec_mtp_without_head_is_clear(ckpt_cache):
    path = tiny(ckpt_cache, "base", mtp=False)
    with pytest.raises(CheckpointError, match="no mtp"):
        LLM(path, device="cpu", spec="mtp", progress=False)
    with LLM(path, device="cpu", progress=False) as llm:   # auto: loads fine, no head
        assert not llm.mtp_loaded


def test_cli_damaged_checkpoint_no_traceback(base, tmp_path, cli_run):
    """Exit code non-zero, a single stderr line, no traceback: the first damage through a real
    process, the second through the same `cli.main` in process."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for i, (name, damage, _) in enumerate(d for d in DAMAGE if d[0] in ("wrong-shape", "truncated")):
        path = _damaged(base, tmp_path / str(i), damage)
        args = ["run", "--model", path, "--device", "cpu", "--prompt", "x"]
        p = (subprocess.run([sys.executable, "-m", "specfire.cli", *args], capture_output=True, text=True,
                            env=env, timeout=120) if i == 0 else cli_run(*args))
        assert p.returncode != 0, name
        assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
        assert p.stderr.startswith("specfire: error:")


def test_layouts_and_prefixes(ckpt_cache):
    """Names normalise to the trunk's own in both layouts; vision tensors are skipped; mtp.* kept."""
    assert loader.normalise_name("model.language_model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert loader.normalise_name("model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert loader.normalise_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert loader.normalise_name("mtp.fc.weight") == "mtp.fc.weight"
    assert loader.normalise_name("lm_head.weight") == "lm_head.weight"
    mm = loader.open_checkpoint(tiny(ckpt_cache, "base", multimodal=True))
    text = loader.open_checkpoint(tiny(ckpt_cache, "base"))
    assert sorted(mm.names()) == sorted(text.names())
    assert not any("visual" in n for n in mm.names())
    tied = loader.open_checkpoint(tiny(ckpt_cache, "tied"))
    assert "lm_head.weight" not in tied and "lm_head.weight" in text


def test_bf16_checkpoint_loads(base, tmp_path):
    """A bfloat16 checkpoint loads with its weights cast exactly to the requested float32."""
    path = copy_checkpoint(base, str(tmp_path / "bf16"))
    _edit_tensors(path, lambda t: t.update({n: v.to(torch.bfloat16) for n, v in t.items()}))
    ids = torch.randint(0, 131, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with LLM(path, device="cpu", dtype="float32", progress=False) as a, \
            LLM(base, device="cpu", dtype="float32", progress=False) as b:
        assert a.engine.trunk.model.embed_tokens.weight.dtype == torch.float32
        assert torch.isfinite(a.score(ids)).all()
        w = dict(b.engine.trunk.model.named_parameters())
        for n, p in a.engine.trunk.model.named_parameters():
            assert torch.equal(p, w[n].to(torch.bfloat16).float())


def test_progress_bar_silent_when_not_a_tty(base, capsys):
    with LLM(base, device="cpu") as llm:                # progress left at its default
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
    out, err = capsys.readouterr()
    assert out == "" and err == ""


# ---- files that are not regular files, index names that leave the folder --------------------------

def _fifo_in_place(path: str, name: str) -> None:
    if os.path.exists(os.path.join(path, name)):
        os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))


UNBLOCK = """
import os, sys, time
time.sleep(20)
while True:
    for root, _, files in os.walk(sys.argv[1]):
        for f in files:
            p = os.path.join(root, f)
            try:
                if not os.path.isfile(p):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    time.sleep(0.2)
"""


@pytest.fixture
def unblock_fifos(tmp_path):
    """A reader blocked on a FIFO (what the loader did) is released after a while by another
    process opening the FIFO for writing (a blocked open may hold the GIL), so a regression fails
    instead of hanging the run."""
    proc = subprocess.Popen([sys.executable, "-c", UNBLOCK, str(tmp_path)])
    yield
    proc.kill()
    proc.wait()


NOT_REGULAR = [
    ("fifo-weights", lambda p: _fifo_in_place(p, "model.safetensors"), "model.safetensors is a FIFO"),
    ("fifo-shard", lambda p: (_shard(p), _fifo_in_place(p, "model-00002-of-00002.safetensors")),
     "model-00002-of-00002.safetensors is a FIFO"),
    ("fifo-index", lambda p: (_shard(p), _fifo_in_place(p, "model.safetensors.index.json")),
     "model.safetensors.index.json is a FIFO"),
    ("fifo-config", lambda p: _fifo_in_place(p, "config.json"), "config.json is a FIFO"),
    ("fifo-generation-config", lambda p: _fifo_in_place(p, "generation_config.json"),
     "generation_config.json is a FIFO"),
    ("dir-weights", lambda p: (os.remove(os.path.join(p, "model.safetensors")),
                               os.mkdir(os.path.join(p, "model.safetensors"))), "model.safetensors is a directory"),
]


@pytest.mark.parametrize("damage,word", [d[1:] for d in NOT_REGULAR], ids=[d[0] for d in NOT_REGULAR])
def test_non_regular_files_are_refused(base, tmp_path, unblock_fifos, damage, word, capsys):
    path = _damaged(base, tmp_path, damage)
    with pytest.raises(CheckpointError, match="not a regular file") as ei:
        LLM(path, device="cpu", progress=False)
    assert word in str(ei.value) and "\n" not in str(ei.value)
    rc = cli.main(["run", "--model", path, "--device", "cpu", "--prompt", "x", "-n", "2"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == "" and err.count("\n") == 1 and word in err


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_non_regular_tokenizer_files_are_refused(ckpt_cache, tmp_path, unblock_fifos, name):
    path = copy_checkpoint(tiny(ckpt_cache, "base", tokenizer=True), str(tmp_path / "ckpt"))
    _fifo_in_place(path, name)
    if name == "chat_template.jinja":             # read only when tokenizer_config.json has no template
        _edit_json(os.path.join(path, "tokenizer_config.json"), lambda c: c.pop("chat_template"))
    with pytest.raises(CheckpointError, match=f"{name} is a FIFO, not a regular file"):
        LLM(path, device="cpu", progress=False)


def _edit_json(p: str, fn) -> None:
    with open(p) as f:
        raw = json.load(f)
    fn(raw)
    with open(p, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "../outside.safetensors", "/etc/passwd", "sub/../../x", "", 5])
def test_index_names_outside_the_folder_are_refused(base, tmp_path, bad):
    path = copy_checkpoint(base, str(tmp_path / "ckpt"))
    _shard(path)
    outside = tmp_path / "outside.safetensors"    # a real file there: the name alone is refused
    save_file({"x": torch.zeros(1)}, str(outside))
    _edit_json(os.path.join(path, "model.safetensors.index.json"),
               lambda ix: ix["weight_map"].update({"model.embed_tokens.weight": bad}))
    with pytest.raises(CheckpointError) as ei:
        LLM(path, device="cpu", progress=False)
    msg = str(ei.value)
    assert "model.safetensors.index.json" in msg and "\n" not in msg
    assert ("outside the checkpoint folder" in msg and repr(bad) in msg) if isinstance(bad, str) and bad else \
        "not a file name" in msg


def test_hugging_face_cache_symlinks_still_load(base, tmp_path):
    """A snapshot folder of symlinks into ../../blobs/ (the Hugging Face cache layout) loads: the
    check is on the index's names and on what the links point to."""
    src = copy_checkpoint(base, str(tmp_path / "src"))
    _shard(src)
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(src))):
        os.rename(os.path.join(src, f), blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f)
    ids = [3, 1, 4, 1, 5]
    with LLM(str(snap), device="cpu", progress=False) as a, LLM(base, device="cpu", progress=False) as b:
        assert torch.equal(a.score(ids), b.score(ids))
    os.remove(blobs / "blob0")                    # a dangling link is a missing file, as before
    with pytest.raises(CheckpointError):
        LLM(str(snap), device="cpu", progress=False)


def test_cpu_weights_start_on_64_byte_bounds(base):
    """A safetensors file maps tensors at 8-byte offsets; loaded CPU weights are moved onto 64-byte
    bounds (on a CPU where MKL peels a misaligned start, a mesh shard's product rounded unlike the
    same rows of the whole matrix: tp2 != tp1 in the last bits)."""
    src = loader.open_checkpoint(base)
    assert any(src.get(n).data_ptr() % 64 for n in src.names())      # the file's own offsets
    with LLM(base, device="cpu", dtype="float32", progress=False) as llm:
        for n, p in llm.engine.trunk.model.named_parameters():
            assert p.data_ptr() % 64 == 0, n
