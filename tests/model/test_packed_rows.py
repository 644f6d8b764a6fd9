"""The packed rows forward (Qwen35Trunk.packed, runtime/trunk.py verify_many): several sequences'
verify rows in one forward give each sequence exactly what its own verify gives (logits, hidden
rows, KV rows, the rows' log and the state after commit), on every one-device target."""
from __future__ import annotations

import pytest
import torch

from packedrows import model, run
from specfire.layers import CPU, CPU_EXACT


@pytest.mark.parametrize("target,dtype", [(CPU, torch.float32), (CPU, torch.bfloat16), (CPU_EXACT, torch.float32)],
                         ids=["cpu-packed-f32", "cpu-modules-bf16", "canonical"])
def test_packed_forward_gives_each_sequence_its_own_bits(target, dtype):
    run(model(target, dtype), dtype)


def test_packed_forward_interleaved_prefix_is_bit_exact_at_one_thread():
    """One CPU thread (the default): the vectorised elementwise math over all rows at once still
    rounds each row as alone (layers/rows.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(model(CPU, torch.float32), torch.float32)
    finally:
        torch.set_num_threads(n)
