"""The 4-bit format: kernel (TRITON_INTERPRET=1) vs reference, row invariance, quality, and the
`specfire quantize` round trip through the loader."""

import dataclasses
import json
import os

import pytest
import torch

from specfire.kernels.gemv import linear, linear_rows_ref
from specfire.kernels.q4 import (QuantWeight, dequantize_ref, hadamard_rotate, pick_group, quantize_tensor,
                                unpack_codes)
from specfire.kernels.q4.config import Q4Config
from specfire.kernels.q4.gemv import q4_gemv


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_kernel_layout_round_trip():
    from specfire.kernels.q4 import from_kernel_layout, to_kernel_layout

    q, s, z = quantize_tensor(torch.randn(5, 256, generator=_g(9)), 64)
    kq = to_kernel_layout(q, 64)
    assert torch.equal(from_kernel_layout(kq, 64), unpack_codes(q))
    assert torch.equal(kq[:, :32] & 15, unpack_codes(q)[:, :32])       # byte j: code j ...
    assert torch.equal(kq[:, :32] >> 4, unpack_codes(q)[:, 32:64])     # ... and code j + G/2
    assert torch.equal(QuantWeight.from_stored(q, s, z, False).dequantize(), dequantize_ref(q, s, z))


def test_pack_layout_is_documented_one():
    w = torch.randn(3, 64, generator=_g(0))
    q, s, z = quantize_tensor(w, 32)
    assert q.dtype == torch.uint8 and q.shape == (3, 32) and s.shape == z.shape == (3, 2)
    assert s.dtype == z.dtype == torch.bfloat16
    codes = unpack_codes(q)
    assert torch.equal(codes[:, 0::2], q & 15) and torch.equal(codes[:, 1::2], q >> 4)
    w_hat = codes.float().view(3, 2, 32) * s.float()[..., None] + z.float()[..., None]
    assert torch.equal(w_hat.view(3, 64), dequantize_ref(q, s, z))
    assert codes.max() <= 15


def test_quantization_error_is_small_and_clip_search_helps():
    w = torch.randn(64, 256, generator=_g(1))
    errs = {}
    for clip in (False, True):
        q, s, z = quantize_tensor(w, 64, clip_search=clip)
        errs[clip] = float((dequantize_ref(q, s, z) - w).norm() / w.norm())
    assert errs[True] <= errs[False] < 0.12


def test_hadamard_is_orthonormal_and_row_invariant():
    x = torch.randn(5, 256, generator=_g(2))
    y = hadamard_rotate(x, 128)
    torch.testing.assert_close(hadamard_rotate(y, 128), x, rtol=1e-5, atol=1e-5)  # H H = I
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    for i in range(5):
        assert torch.equal(hadamard_rotate(x[i:i + 1], 128)[0], y[i])


def test_hadamard_weight_equivalence():
    w = torch.randn(16, 128, generator=_g(3))
    qw = QuantWeight.quantize(w, 64, hadamard=True)
    x = torch.randn(3, 128, generator=_g(4))
    torch.testing.assert_close(linear(x, qw, rows=True), x @ qw.effective().t(), rtol=1e-4, atol=1e-4)


def test_bit_trick_constants():
    """The kernel's int->float shortcuts: bf16 bits 0x4300 | q are 128 + q, and float32 bits
    0x4B000000 | q are 2^23 + q, for every 4-bit code q."""
    q = torch.arange(16)
    assert torch.equal((q.to(torch.int16) | 0x4300).view(torch.bfloat16).float(), q.float() + 128)
    assert torch.equal((q.to(torch.int32) | 0x4B000000).view(torch.float32) - 8388608.0, q.float())


def test_asm_word_conversion_model():
    """The inline-PTX nibble conversion (modelled bit for bit in Python): element i of each output
    is byte i of the word, low nibble -> bf16 128 + lo, high nibble -> bf16 128 + hi."""
    from specfire.kernels.q4.kernel import asm_q4_emulate

    gen = _g(11)
    words = [0, 0xFFFFFFFF, 0x12345678, 0x0F0F0F0F, 0xF0F0F0F0] + \
        [int(v) for v in torch.randint(0, 2 ** 31, (50,), generator=gen)]
    for w in words:
        lo, hi = asm_q4_emulate(w)
        for i in range(4):
            b = (w >> (8 * i)) & 255
            val = torch.tensor([lo[i], hi[i]], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
            assert val.tolist() == [128 + (b & 15), 128 + (b >> 4)], (hex(w), i)


def test_q4_split_counters_reset():
    """The in-kernel split-K combine leaves its counters at zero (the next launch relies on it),
    and repeated calls give identical results."""
    from specfire.kernels.q4.gemv import _LOCKS

    w = torch.randn(40, 512, generator=_g(12))
    qw = QuantWeight.quantize(w, 64)
    x = torch.randn(3, 512, generator=_g(13))
    cfg = Q4Config(16, split_k=4, wa=True, rows=8)   # 9 rows below: two row tiles, a counter each
    y1, y2 = q4_gemv(x, qw, cfg), q4_gemv(x, qw, cfg)
    assert torch.equal(q4_gemv(x.repeat(3, 1), qw, cfg), y1.repeat(3, 1))
    assert torch.equal(y1, y2)
    assert all(int(b.abs().sum()) == 0 for b in _LOCKS.values())


def test_kernel_module_defines_each_kernel_once():
    """A kernel defined twice silently takes the later body (and Triton ignores launch arguments
    the bound kernel lacks): that once sent benchmark configs to the wrong code path."""
    import inspect
    import re

    import specfire.kernels.q4.kernel as tq

    names = re.findall(r"^def (\w+)\(", inspect.getsource(tq), flags=re.M)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_quantize_policy_covers_every_projection():
    """`specfire quantize` takes every projection matrix, the GDN input projections included (they
    were once left bf16 because only `*_proj` names counted), and keeps the per-head gates dense."""
    from specfire.quantize import _quantizable

    gdn = "model.layers.0.linear_attn."
    for name in (gdn + "in_proj_qkv.weight", gdn + "in_proj_z.weight", gdn + "out_proj.weight", "mtp.fc.weight",
                 "model.layers.3.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert _quantizable(name, (8, 8), False), name
    for name in (gdn + "in_proj_a.weight", gdn + "in_proj_b.weight", "model.embed_tokens.weight", gdn + "norm.weight"):
        assert not _quantizable(name, (8, 8), False), name
    assert not _quantizable("lm_head.weight", (8, 8), True) and not _quantizable(gdn + "conv1d.weight", (8, 1, 4), False)
    # `specfire quantize --gates`: the gates too (they then join the layer's 4-bit input launch)
    assert _quantizable(gdn + "in_proj_a.weight", (8, 8), False, gates=True)
    assert _quantizable(gdn + "in_proj_b.weight", (8, 8), False, gates=True)
    assert not _quantizable("model.embed_tokens.weight", (8, 8), False, gates=True)


def test_pick_group():
    assert pick_group(5120, 128) == 128 and pick_group(96, 128) == 32 and pick_group(48, 128) is None


CASES = [  # odd N, masked group tails (a split's last group range shorter), split-K combined by
    # the last CTA (four partials at a time: masked past the last split), group sizes 32 / 64 / 128,
    # codes as rows and in tiles (last field)
    (1, 37, 128, 32, False, Q4Config(16), 0),
    (5, 100, 384, 64, True, Q4Config(32, split_k=2), 64),
    (3, 70, 640, 128, False, Q4Config(64, split_k=4), 0),
    (7, 50, 160, 32, False, Q4Config(16, split_k=3), 16),
    (9, 33, 2304, 64, False, Q4Config(32, split_k=5, wa=True, rows=8), 64),   # 8-row tiles: M = 9 runs two
    (4, 48, 512, 128, False, Q4Config(16, split_k=3, num_warps=1, zc=16), 0),
    (16, 64, 256, 128, False, None, 0),
    # codes as the MMA's A operand (wa, the adopted form): odd N, masked tails, both layouts; the default config on the default layout (64-row tiles, N padded); the
    # adopted gate/up form (128 columns, 2 warps, 3 stages) with a short last split
    (5, 45, 384, 128, False, Q4Config(32, split_k=2, wa=True, rows=8, zc=16), 0),   # zero term after the loop
    (11, 70, 640, 64, True, Q4Config(16, split_k=4, wa=True, rows=8), 64),
    (13, 77, 384, 128, False, None, 64),
    (2, 150, 640, 128, False, Q4Config(128, split_k=3, num_warps=2, num_stages=3, wa=True), 64),
    # the zero term after the loop (zc): splits of one group, of two and a short last one, zc chunks
    # shorter than a split (the first chunk's scales / zeros loaded before the loop, the rest after)
    (6, 40, 896, 128, True, Q4Config(16, split_k=7, wa=True, rows=8, zc=2), 64),
    (5, 29, 1280, 128, False, Q4Config(32, split_k=2, wa=True, rows=8, zc=2), 0),
]


def _rows_to_check(m: int) -> list[int]:
    """The single rows (or prefix lengths - 1) a row-invariance check runs: the first two, both
    sides of the 8-row tile bound, the middle and the last (a masked row tile's rows); other rows
    repeat one of these positions."""
    return sorted({i for i in (0, 1, 7, 8, m // 2, m - 2, m - 1) if 0 <= i < m})


@pytest.mark.parametrize("m,n,k,g,had,cfg,tile", CASES)
def test_q4_kernel_matches_reference_and_is_row_invariant(m, n, k, g, had, cfg, tile):
    w = torch.randn(n, k, generator=_g(m + n))
    qw = QuantWeight.quantize(w, g, had)
    qw = QuantWeight(qw.qweight, qw.scales_t, qw.zeros_t, had, qw.dtype, tile)
    assert qw.tile == tile
    x = qw.prepare_input(torch.randn(m, k, generator=_g(k)))
    y = q4_gemv(x, qw, cfg)
    ref = linear_rows_ref(x, qw.dequantize())
    # the fp32 path also uses the 128 + q codes (as bf16 does on the GPU): sum (128 + q) x minus
    # 128 sum(x) cancels a few more float32 bits than sum q x, hence the relative bound
    assert float((y - ref).norm() / ref.norm()) < 3e-5
    for i in _rows_to_check(m):
        assert torch.equal(q4_gemv(x[i:i + 1], qw, cfg)[0], y[i]), f"row {i}"


def test_q4_kernel_prefixes_are_row_invariant():
    """Prefixes of a 16-row call (M = 1, 2, 8, 9, 15, 16: both sides of the 8-row tile bound and of
    the end) give the same rows bit for bit (with and without split-K)."""
    qw = QuantWeight.quantize(torch.randn(24, 384, generator=_g(21)), 128)
    x = torch.randn(16, 384, generator=_g(22))
    for cfg in (Q4Config(16, split_k=2), Q4Config(32), Q4Config(16, split_k=2, wa=True, rows=8, zc=16)):
        full = q4_gemv(x, qw, cfg)
        for m in (i + 1 for i in _rows_to_check(16)):
            assert torch.equal(q4_gemv(x[:m], qw, cfg), full[:m]), (cfg, m)


@pytest.mark.parametrize("cfg", [Q4Config(16, split_k=3, wa=True, rows=8, rows_hi=16),
                                 Q4Config(32, split_k=2, wa=True, rows=8, zc=2, rows_hi=16),
                                 Q4Config(16, wa=True, rows=8, zc=4, rows_hi=16)])
def test_q4_wide_row_tile_is_row_invariant(cfg):
    """rows_hi: a call of more than 8 rows runs one 16-row tile instead of two 8-row tiles (the
    codes read once); prefixes M = 1, 2, 8 (one 8-row tile), 9, 15, 16 (the wide tile) and single
    rows give the bits of the 16-row call, which equals the two-tile form; odd N, a masked group
    tail (5 groups in splits of 3 and 2 or in zc chunks of 2 and 4)."""
    qw = _qw(45, 640, 128, 26)
    x = torch.randn(16, 640, generator=_g(27))
    full = q4_gemv(x, qw, cfg)
    assert torch.equal(full, q4_gemv(x, qw, dataclasses.replace(cfg, rows_hi=0)))
    ref = linear_rows_ref(x, qw.dequantize())
    assert float((full - ref).norm() / ref.norm()) < 3e-5
    for m in (i + 1 for i in _rows_to_check(16)):
        assert torch.equal(q4_gemv(x[:m], qw, cfg), full[:m]), m
    for i in (0, 5, 8, 15):
        assert torch.equal(q4_gemv(x[i:i + 1], qw, cfg)[0], full[i]), i


def test_q4_config_rejects_bad_values():
    for bad in (dict(rows=12), dict(rows=8, rows_hi=8), dict(rows=8, rows_hi=24), dict(zc=3)):
        with pytest.raises(ValueError, match="Q4Config"):
            Q4Config(**bad)


def test_tiled_storage_round_trip_and_both_layouts_agree():
    """Codes stored in tiles of 64 rows (N padded) give back the same kernel packing, row slices
    included, and the kernel reads either layout to the same bits."""
    from specfire.kernels.q4 import TILE, tile_rows, untile_rows

    made = QuantWeight.quantize(torch.randn(70, 384, generator=_g(24)), 64)
    assert made.tile == TILE == 64       # the package's layout
    rows = QuantWeight(made.qweight, made.scales_t, made.zeros_t, False, torch.float32, 0)
    qw = QuantWeight(rows.qweight, rows.scales_t, rows.zeros_t, False, torch.float32, 64)
    assert rows.tile == 0 and qw.qtiled.shape == (2, 6, 64, 32) and qw.shape == (70, 384)
    assert torch.equal(qw.qweight, rows.qtiled) and torch.equal(qw.to("cpu").qtiled, qw.qtiled)
    assert torch.equal(untile_rows(tile_rows(rows.qtiled, 64, 16), slice(3, 61), 70), rows.qtiled[3:61])
    assert torch.equal(qw.dequantize(slice(5, 67)), rows.dequantize()[5:67])
    assert qw.nbytes() == rows.nbytes() == 70 * 192 + 2 * 70 * 6 * 2
    x = torch.randn(3, 384, generator=_g(25))
    for cfg in (Q4Config(16, split_k=2), Q4Config(32, split_k=3), Q4Config(64, split_k=2, wa=True)):
        assert torch.equal(q4_gemv(x, qw, cfg), q4_gemv(x, rows, cfg))


def test_q4_rejects_bad_shapes():
    qw = QuantWeight.quantize(torch.randn(8, 128, generator=_g(23)), 64)
    with pytest.raises(ValueError, match="at most 16 rows"):
        q4_gemv(torch.randn(17, 128), qw)
    with pytest.raises(ValueError, match="K=96"):
        q4_gemv(torch.randn(2, 96), qw)


# ---- the CLI round trip ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tinymodels import make_checkpoint
    from specfire.cli import main

    root = tmp_path_factory.mktemp("q4")
    src = make_checkpoint(str(root / "src"), "base", seed=3)
    dst = str(root / "dst")
    assert main(["quantize", src, dst, "--group-size", "64", "--device", "cpu"]) == 0
    return src, dst


@pytest.fixture(scope="module")
def dense_equivalent(ckpts, tmp_path_factory):
    """The source checkpoint with every quantized weight replaced by its dequantized value, written
    independently of the loader: the quantized model must compute exactly this model."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = ckpts
    out = str(tmp_path_factory.mktemp("q4eff") / "eff")
    shutil.copytree(src, out)
    dense = load_file(os.path.join(src, "model.safetensors"))
    q = load_file(os.path.join(dst, "model.safetensors"))
    n = 0
    for name in q:
        if not name.endswith((".qweight", ".scales", ".zeros")):
            assert q[name].dtype == torch.bfloat16  # kept tensors are stored in bf16
            dense[name] = q[name].float()
        if name.endswith(".qweight"):
            base = name[:-len("qweight")]
            dense[base + "weight"] = dequantize_ref(q[name], q[base + "scales"], q[base + "zeros"])
            n += 1
    # 4 layers x 3 MLP + 4 attention (1 layer) + 2 GDN input projections (3 layers; out_proj's K = 48
    # fits no group) + lm_head + 8 in the MTP head
    assert n == 31
    save_file(dense, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_quantized_checkpoint_layout(ckpts):
    from safetensors import safe_open

    src, dst = ckpts
    cfg = json.load(open(os.path.join(dst, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "specfire-q4"
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").dtype == torch.uint8
    assert "model.layers.0.mlp.gate_proj.qweight" in names and "model.layers.0.mlp.gate_proj.weight" not in names
    assert "mtp.layers.0.mlp.up_proj.scales" in names and "mtp.fc.zeros" in names and "lm_head.qweight" in names
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "model.layers.0.linear_attn.in_proj_a.weight" in names  # per-head gates stay dense


def test_quantized_model_equals_dequantized_and_is_near_source(ckpts, dense_equivalent):
    """Exact to the dense model with the dequantized weights; near the unquantized source (tiny
    random models amplify weight error: 8% per weight gives about 63% on the logits here, with the
    GDN input projections quantized too; quality on a trained model: bench/quant_ppl.py)."""
    from specfire import LLM
    from specfire.kernels.q4 import QuantWeight

    src, dst = ckpts
    ids = list(range(5, 60, 3))
    with LLM(src, device="cpu", spec="off") as a:
        ref = a.score(ids)
    with LLM(dense_equivalent, device="cpu", spec="off") as a:
        eff = a.score(ids)
    with LLM(dst, device="cpu", spec="off") as b:
        got = b.score(ids)
        mlp = b.engine.trunk.model.layers[0].mlp
        assert isinstance(mlp.gate_proj.weight, QuantWeight) and mlp.gate_proj.weight.group_size == 64
        assert mlp.down_proj.weight.group_size == 32  # K = 96: the largest group dividing it
        assert isinstance(b.engine.trunk.model.lm_head.weight, QuantWeight)
    torch.testing.assert_close(got, eff, rtol=1e-5, atol=1e-5)
    rel = float((got - ref).norm() / ref.norm())
    assert 0.01 < rel < 0.8, rel


def test_mtp_equals_ar_on_quantized_model(ckpts):
    from specfire import LLM, SamplingParams, SpecPolicy

    _, dst = ckpts
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(dst, device="cpu", spec="auto") as llm:
        ar = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="off"))
        mtp = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="mtp", k=3))
    assert mtp.stats["route"] == "mtp" and mtp.token_ids == ar.token_ids


def test_quantize_gates_option(ckpts, tmp_path):
    """`specfire quantize --gates`: the GDN gate projections are written 4-bit too, load as 4-bit
    weights and decode with greedy MTP == AR."""
    from safetensors import safe_open

    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.cli import main
    from specfire.kernels.q4 import QuantWeight

    src, _ = ckpts
    dst = str(tmp_path / "gates")
    assert main(["quantize", src, dst, "--group-size", "64", "--device", "cpu", "--gates"]) == 0
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.linear_attn.in_proj_a.qweight" in names and "model.layers.0.linear_attn.in_proj_b.zeros" in names
    assert "model.layers.0.linear_attn.in_proj_a.weight" not in names
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    with LLM(dst, device="cpu", spec="auto") as llm:
        assert isinstance(llm.engine.trunk.model.layers[0].linear_attn.in_proj_a.weight, QuantWeight)
        ar = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="off"))
        mtp = llm.generate([3, 9, 27, 81], sp, spec=SpecPolicy(mode="mtp", k=3))
    assert mtp.token_ids == ar.token_ids


def test_quantize_rejects_bad_input(ckpts, tmp_path, capsys):
    from specfire.cli import main

    src, dst = ckpts
    assert main(["quantize", src, str(tmp_path / "x"), "--group-size", "48"]) == 2
    assert "group_size" in capsys.readouterr().err
    assert main(["quantize", dst, str(tmp_path / "y")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_dequantize_row_slices():
    qw = QuantWeight.quantize(torch.randn(10, 128, generator=_g(11)), 64)
    full = qw.dequantize()
    assert torch.equal(torch.cat([qw.dequantize(slice(0, 3)), qw.dequantize(slice(3, 10))]), full)


def test_linear_dequantized_in_slices():
    """The GPU prefill path (dequantise a slice of rows at a time) equals one dense matmul."""
    import torch.nn.functional as F

    qw = QuantWeight.quantize(torch.randn(37, 128, generator=_g(12)), 64)
    x = torch.randn(20, 128, generator=_g(13))
    torch.testing.assert_close(qw.linear_dequantized(x, step=8), F.linear(x, qw.dequantize()))


def test_info_reports_memory_as_stored(ckpts):
    """`specfire info` on a 4-bit checkpoint: the memory it needs is its stored bytes, which are
    well under the bf16 size and equal the bytes of its safetensors payloads."""
    import glob

    from safetensors import safe_open

    from specfire.info import describe

    src, dst = ckpts
    dense, q4 = describe(src), describe(dst)
    assert set(q4["memory_bytes"]) == {"as stored (4-bit)"}
    stored = q4["memory_bytes"]["as stored (4-bit)"]
    payload = 0
    for f in glob.glob(os.path.join(dst, "*.safetensors")):
        with safe_open(f, "pt") as h:
            payload += sum(h.get_tensor(n).numel() * h.get_tensor(n).element_size() for n in h.keys())
    assert stored == payload
    assert stored < dense["memory_bytes"]["bfloat16"]
    q = q4["quantization"]  # group 64 (32 where K needs it): 4.5..5 bits per quantized weight, MTP included
    assert dense["quantization"] is None and q["group_size"] == 64
    assert 4.5 <= q["bits_per_weight"] <= 5.0 and q["mtp_quantized_weights"] > 0
    assert q["bits_per_parameter"] == 8 * stored / (q4["parameters"] + q4["mtp_parameters"])


# ---- grouped launches: 4-bit weights of one input in one launch ------------------------------

def _qw(n, k, g, seed, tile=64, had=False):
    qw = QuantWeight.quantize(torch.randn(n, k, generator=_g(seed)), g, had)
    return QuantWeight(qw.qweight, qw.scales_t, qw.zeros_t, had, qw.dtype, tile)


@pytest.mark.parametrize("cfg,tile", [(Q4Config(32, split_k=2, wa=True, rows=8), 64),
                                      (Q4Config(64, split_k=2, wa=True), 0)])
def test_q4_group_equals_separate_launches_and_is_row_invariant(cfg, tile):
    """q4_group: two and four weights of one input (odd N, masked group tails, split-K combined in
    the kernel, rows and tiles) give each output the bits of its own launch
    with the same settings, 128-byte aligned; each row of an M-row call equals a one-row call."""
    from specfire.kernels.q4.gemv import q4_group

    k, g = 192, 64                               # 3 groups: split 2 leaves a short last split
    ws = [_qw(n, k, g, 30 + n, tile) for n in (37, 20, 5, 70)]
    x = torch.randn(2, k, generator=_g(31))
    for sel in ((3, 2, 0, 1), (1, 2)):
        group = [ws[i] for i in sel]
        got = q4_group(x, group, cfg)
        assert [tuple(y.shape) for y in got] == [(2, w.shape[0]) for w in group]
        assert all(y.is_contiguous() and (y.data_ptr() - got[0].data_ptr()) % 128 == 0 for y in got)
        for y, w in zip(got, group):
            assert torch.equal(y, q4_gemv(x, w, cfg))
            ref = linear_rows_ref(x, w.dequantize())
            assert float((y - ref).norm() / ref.norm()) < 3e-5
    for i in range(2):
        assert all(torch.equal(a[0], b[i]) for a, b in zip(q4_group(x[i:i + 1], group, cfg), got)), i


def test_q4_rows_groups_shards_as_the_whole(monkeypatch):
    """q4_rows: the group's settings come from the whole matrices' N, so shards (rows from a tile
    bound on, launch_ns = the whole N) get the whole group's bits; Hadamard weights rotate x once;
    more than 16 rows run in 16-row launches (row-invariant across them)."""
    from specfire.kernels.q4 import config as q4cfg
    from specfire.kernels.q4 import q4_rows
    from specfire.kernels.q4.config import group_config

    # settings by shape: the whole group's (N = 170) differ from what the shards' own N would pick
    monkeypatch.setattr(q4cfg, "q4_config", lambda n, k, g: Q4Config(32) if n == 170 else Q4Config(16, split_k=2))
    k, g = 256, 128
    wholes = [_qw(n, k, g, 40 + n, had=True) for n in (100, 70)]
    x = torch.randn(18, k, generator=_g(41))
    full = q4_rows(x, wholes, [None, None])
    xr = hadamard_rotate(x, g)
    cfg = group_config([100, 70], k, g)
    for y, w in zip(full, wholes):
        assert torch.equal(y[:16], q4_gemv(xr[:16], w, cfg)) and torch.equal(y[16:], q4_gemv(xr[16:], w, cfg))
        assert float((y - x @ w.effective().t()).norm() / y.norm()) < 1e-4
    shards = [QuantWeight(w.qweight[64:], w.scales_t[:, 64:].contiguous(), w.zeros_t[:, 64:].contiguous(), True,
                          w.dtype) for w in wholes]
    for a, b in zip(q4_rows(x[:3], shards, [100, 70]), full):
        assert torch.equal(a, b[:3, 64:])


def test_q4_config_picks_the_measured_settings():
    """The launch settings of a 27B step's 4-bit launches and the MTP fc are the measured winners:
    one per (N, K), whatever M."""
    from specfire.kernels.q4.config import group_config, q4_config

    want = {(34816, 5120): Q4Config(64, 3, 2, 3, wa=True, rows=8, rows_hi=16),       # MLP gate + up
            (16384, 5120): Q4Config(64, 3, 2, 3, wa=True, rows=8, rows_hi=16),       # GDN qkv + z
            (14336, 5120): Q4Config(128, 7, 2, 3, wa=True, rows=8, rows_hi=16),      # attention q + gate, k, v
            (5120, 17408): Q4Config(64, 13, 2, 3, wa=True, rows=8, rows_hi=16),      # MLP down
            (5120, 6144): Q4Config(64, 10, 2, 3, wa=True, rows=8, rows_hi=16),       # attention o, GDN out
            (248320, 5120): Q4Config(32, 1, 1, 4, wa=True, rows=8, rows_hi=16),      # lm_head
            (5120, 10240): Q4Config(64, 9, 2, 3, wa=True, rows=8, rows_hi=16)}       # MTP fc
    for (n, k), cfg in want.items():
        assert q4_config(n, k, 128) == cfg, (n, k)
    assert group_config([17408, 17408], 5120, 128) == want[(34816, 5120)]
    assert group_config([12288, 1024, 1024], 5120, 128) == want[(14336, 5120)]
    assert group_config([10240, 6144], 5120, 128) == want[(16384, 5120)]
    # the tiles per row count: the draft lm_head of a 32,768-token draft vocabulary at
    # M = 1 runs 32 columns on one warp, 3 stages, its split-K (1) unchanged; other M as q4_config
    from specfire.kernels.q4.config import M_TILES, launch_config
    assert M_TILES == {(32768, 5120, 1): (32, 1, 3)}
    d = q4_config(32768, 5120, 128)
    assert launch_config(d, 32768, 5120, 128, 1) == dataclasses.replace(d, block_n=32, num_warps=1, num_stages=3)
    assert launch_config(d, 32768, 5120, 128, 4) == d


# ---- tiles per row count, partials dropped ------------------------------------------------------

def test_q4_m_tiles_change_the_tile_not_the_bits(monkeypatch):
    """M_TILES: an M-row launch of a shape may run another tile width / warps / stages than
    q4_config's (never another split-K or row tile): launch_config applies it only to that (N, K, M)
    and only where the settings are q4_config's, and the outputs keep the bits of q4_config's launch
    (odd N, split-K over a short last split, rows == single rows)."""
    from specfire.kernels.q4 import config as q4cfg
    from specfire.kernels.q4.config import launch_config, q4_config

    n, k, g = 77, 640, 64
    base = q4_config(n, k, g)
    assert base.split_k > 1
    qw = _qw(n, k, g, 52)
    x = torch.randn(4, k, generator=_g(53))
    want = q4_gemv(x, qw, base)
    monkeypatch.setattr(q4cfg, "M_TILES", {(n, k, 4): (16, 1, 2), (n, k, 2): (32, 4, 3)})
    got = launch_config(base, n, k, g, 4)
    assert (got.block_n, got.num_warps, got.num_stages) == (16, 1, 2)
    assert dataclasses.replace(got, block_n=base.block_n, num_warps=base.num_warps,
                               num_stages=base.num_stages) == base
    assert launch_config(base, n, k, g, 3) == base                       # no entry for M = 3
    other = dataclasses.replace(base, split_k=base.split_k + 1)
    assert launch_config(other, n, k, g, 4) == other                     # not q4_config's settings
    assert torch.equal(q4_gemv(x, qw), want)                             # M = 4 through the tile of M_TILES
    assert torch.equal(q4_gemv(x[:2], qw), want[:2])                     # M = 2 through its own
    for i in range(4):
        assert torch.equal(q4_gemv(x[i:i + 1], qw)[0], want[i]), i


def test_q4_discard_only_where_lines_stay_inside_a_tile():
    """DISCARD drops a partial line only if no other tile's value can share it."""
    from specfire.kernels.q4.gemv import discard_ok

    assert discard_ok(True, 64, [17408, 17408], 1 << 20)
    assert not discard_ok(False, 64, [17408], 1 << 20)                  # no split-K / the CPU
    assert not discard_ok(True, 16, [17408], 1 << 20)                   # a tile narrower than a line
    assert not discard_ok(True, 64, [17408, 1000], 1 << 20)             # an N off the line grid
    assert not discard_ok(True, 64, [17408], (1 << 20) + 64)            # a buffer off the line grid
