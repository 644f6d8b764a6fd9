"""The packed rows forward through the GPU's layers (fused attention and Gated DeltaNet kernels,
interpreted on the CPU): each sequence's rows get the bits of its own verify."""
from __future__ import annotations

import torch

from packedrows import model, run
from specfire.kernels.attention import fused as af
from specfire.kernels.gdn import fused as gf
from specfire.layers import CUDA


def test_packed_forward_fused_kernels_give_each_sequence_its_own_bits(monkeypatch):
    ran = []
    for mod, name in ((gf, "gdn_decode_triton"), (af, "qk_norm_rope_write_triton"), (af, "out_gate_triton")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: ran.append(name) or real(*a, **k))
    run(model(CUDA, torch.float32, fused=True), torch.float32)
    assert {"gdn_decode_triton", "qk_norm_rope_write_triton", "out_gate_triton"} <= set(ran)
