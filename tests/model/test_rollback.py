"""Rollback by a logged replay: after verify(k+1 rows) + commit(n), every Gated DeltaNet layer's
recurrent state and conv window are bit-identical (float32, CPU) to those after n+1 one-row
decodes, and decoding continues identically (attention rows past the commit are never read)."""
from __future__ import annotations

import pytest
import torch

from specfire import LLM
from ckpts import tiny

K = 6



def ckpt(cache, name: str) -> str:
    return tiny(cache, name)


def gdn_state(trunk) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(lc.rec.clone(), lc.conv.clone()) for lc in trunk.state.layers if lc.rec is not None]


@pytest.mark.parametrize("name", ["base", "mix", "gqa4", "kdim", "mha"])
def test_commit_n_equals_n_plus_1_decodes(ckpt_cache, name):
    with LLM(ckpt(ckpt_cache, name), device="cpu", spec="off", progress=False) as llm:
        trunk = llm.engine.trunk
        g = torch.Generator().manual_seed(len(name))
        prompt = torch.randint(0, llm.cfg.vocab_size, (11,), generator=g)
        rows_ids = torch.randint(0, llm.cfg.vocab_size, (K + 1,), generator=g)
        after = torch.randint(0, llm.cfg.vocab_size, (1,), generator=g)
        pos = prompt.shape[0]

        # reference: one-row decodes, each committed
        trunk.begin()
        trunk.prefill(prompt)
        ref_states, ref_logits = [], []
        for i in range(K + 1):
            r = trunk.verify(rows_ids[i:i + 1], pos + i)
            trunk.commit(0)
            ref_states.append(gdn_state(trunk))
            ref_logits.append(r.logits[0])

        for n in range(K + 1):
            trunk.begin()
            trunk.prefill(prompt)
            r = trunk.verify(rows_ids, pos)
            for i in range(K + 1):          # row invariance: a verify row is the one-row decode
                assert torch.equal(r.logits[i], ref_logits[i]), (name, i)
            trunk.commit(n)
            got = gdn_state(trunk)
            assert len(got) == llm.cfg.n_linear
            for (rec, conv), (rrec, rconv) in zip(got, ref_states[n]):
                assert torch.equal(rec, rrec), (name, n, "recurrent state")
                assert torch.equal(conv, rconv), (name, n, "conv window")
            # a different token after the commit point continues exactly like AR from there
            nxt = trunk.verify(after, pos + n + 1).logits[0]
            trunk.commit(0)
            trunk.begin()
            trunk.prefill(prompt)
            for i in range(n + 1):
                trunk.verify(rows_ids[i:i + 1], pos + i)
                trunk.commit(0)
            want = trunk.verify(after, pos + n + 1).logits[0]
            trunk.commit(0)
            assert torch.equal(nxt, want), (name, n)


def test_commit_needs_a_rows_forward(ckpt_cache):
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", spec="off", progress=False) as llm:
        trunk = llm.engine.trunk
        trunk.begin()
        trunk.prefill(torch.tensor([1, 2, 3]))
        with pytest.raises(RuntimeError, match="commit"):
            trunk.commit(0)


@pytest.mark.parametrize("name", ["base", "kdim"])
def test_one_launch_commit_equals_per_layer_commits(ckpt_cache, name):
    """The commit over the state's stacked buffers (one launch on a GPU) gives, at every n, the
    bits of the per-layer commit (a state without a book), written into the live tensors in place
    (graphs keep their addresses), the log detached, and row n's state, not another row's."""
    from specfire.model import state as state_mod

    with LLM(ckpt(ckpt_cache, name), device="cpu", spec="off", progress=False) as llm:
        trunk = llm.engine.trunk
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(0, llm.cfg.vocab_size, (9,), generator=g)
        rows_ids = torch.randint(0, llm.cfg.vocab_size, (K + 1,), generator=g)
        prev = None
        calls = []
        real = state_mod._stacked
        for n in range(K + 1):
            got = {}
            for stacked in (False, True):
                state_mod._stacked = lambda *a, s=stacked: calls.append(s and real(*a)) or calls[-1]
                try:
                    trunk.begin()
                    trunk.prefill(prompt)
                    trunk.verify(rows_ids, prompt.shape[0])
                    st = trunk.state
                    live = [(lc.rec.data_ptr(), lc.conv.data_ptr()) for lc in st.layers if lc.rec is not None]
                    st.commit(n)
                finally:
                    state_mod._stacked = real
                assert [(lc.rec.data_ptr(), lc.conv.data_ptr()) for lc in st.layers if lc.rec is not None] == live
                assert all(lc.log is None for lc in st.layers)
                got[stacked] = gdn_state(trunk)
            for (rec, conv), (rrec, rconv) in zip(got[True], got[False]):
                assert torch.equal(rec, rrec) and torch.equal(conv, rconv), (name, n)
            assert prev is None or not all(torch.equal(a[0], b[0]) for a, b in zip(got[True], prev))
            prev = got[True]
        assert calls == [False, True] * (K + 1)       # both forms ran: the stacked one really stacked


def test_commit_rejects_a_row_the_forward_did_not_run(ckpt_cache):
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", spec="off", progress=False) as llm:
        trunk = llm.engine.trunk
        trunk.begin()
        trunk.prefill(torch.tensor([1, 2, 3]))
        trunk.verify(torch.tensor([4, 5]), 3)
        with pytest.raises(ValueError, match=r"commit\(2\).*2 row"):
            trunk.commit(2)
