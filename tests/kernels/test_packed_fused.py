"""The packed rows forward through the GPU's layers (fused attention and Gated DeltaNet kernels,
interpreted on the CPU): each sequence's rows get the bits of its own verify."""
from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("q8", [False, True], ids=["bf-cache", "q8-cache"])
def test_packed_forward_attention_kernels_launch_once_per_layer(monkeypatch, q8):
    """With the attention kernels on (as on CUDA; interpreted here), the packed forward launches
    the q/k write (a Q8 cache: the quantized rows' write), the split attention and its combine
    once per attention layer for all three sequences, and each sequence still gets its own
    verify's bits (which run the same attention kernels; a Q8 cache's rows written by kv_write)."""
    from specfire.kernels import attention as A
    from specfire.kernels.attention import kernel as ak

    monkeypatch.setattr(A, "_use_kernel", lambda q: q.shape[-1] in A.KERNEL_HEAD_DIMS)
    launches = []
    write = (af, "_q8_rows_kernel") if q8 else (af, "_qk_kernel")
    split = (ak, "_attn_q8t_kernel") if q8 else (ak, "_attn_split_kernel")
    for mod, name in (write, split, (ak, "_attn_combine_kernel")):
        real = getattr(mod, name)

        class Counted:
            def __getitem__(self, grid, real=real, name=name):
                def go(*a, **k):
                    launches.append((name, k.get("MULTI", name == "_q8_rows_kernel")))
                    return real[grid](*a, **k)
                return go
        monkeypatch.setattr(mod, name, Counted())
    m = model(CUDA, torch.float32, fused=True)
    run(m, A.Q8_KV if q8 else torch.float32)
    packed = [x for x in launches if x[1]]
    n_attn = sum(hasattr(layer, "self_attn") for layer in m.layers)
    assert sorted(packed) == sorted((mod[1], True) for mod in (write, split, (ak, "_attn_combine_kernel"))
                                    for _ in range(n_attn))
    alone = 2 if q8 else 3                                  # a Q8 cache's rows alone: kv_write (torch)
    assert len(launches) - len(packed) == alone * n_attn * 3      # each sequence alone: the same kernels
