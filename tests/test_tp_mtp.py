"""The MTP head split over a CPU mesh like a trunk layer (parallel/mtp.py; gloo, 2 ranks): every
rank runs the draft chain on its shard of the head, and greedy MTP on the mesh still equals AR on
one device (canonical mode), with the drafts of one device's whole head."""
from __future__ import annotations

import pytest

import specfit
from tinymodels import make_checkpoint

from specfire import LLM, SamplingParams, SpecPolicy
from specfire.kernels import canonical


@pytest.fixture(scope="module")
def pair(tmp_path_factory, monkeypatch_module):
    path = make_checkpoint(str(tmp_path_factory.mktemp("tpmtp") / "base"), "base", seed=7)
    monkeypatch_module.setenv("SPECFIRE_TP_MTP", "shard")
    canonical.set_enabled(True)
    one = LLM(path, tp=1, device="cpu", progress=False)
    mesh = LLM(path, tp=2, device="cpu", progress=False)
    yield one, mesh
    canonical.set_enabled(None)
    mesh.close()
    one.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_sharded_head_drafts_equal_one_device(pair):
    """Greedy MTP k=3 on the mesh (every rank holding a shard of the head) == AR on one device,
    and the drafts equal one device's whole head's, eager and with the chain in emulated graphs."""
    from specfire.runtime.graphs import DraftGraphs

    one, mesh = pair
    assert mesh.engine.trunk.mtp_mesh is not None and mesh.engine.drafters["mtp"].mesh is not None
    ids = list(range(3, 23))
    sp = SamplingParams(max_tokens=14)
    ar = one.generate(ids, sp, spec="off").token_ids
    runs = {}
    for name, llm, graphs in (("one", one, False), ("mesh", mesh, False), ("mesh_graphs", mesh, True)):
        d, log = specfit.spy_drafts(llm)
        d.graphs = DraftGraphs(d._chain_for, d.head.fc.weight.device, emulate=True) if graphs else None
        try:
            runs[name] = (llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3)).token_ids, log)
        finally:
            del d.propose
            d.graphs = None
    assert runs["one"][0] == runs["mesh"][0] == runs["mesh_graphs"][0] == ar
    assert runs["one"][1] == runs["mesh"][1] == runs["mesh_graphs"][1] and len(runs["one"][1]) > 2


def test_sharded_head_k2_and_sampled(pair):
    """k=2 (an odd collective count padded) and a seeded sampled chain: the mesh equals one device."""
    one, mesh = pair
    ids = list(range(5, 30))
    g = SamplingParams(max_tokens=10)
    assert mesh.generate(ids, g, spec=SpecPolicy("mtp", k=2)).token_ids == one.generate(ids, g, spec="off").token_ids
    s = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    a = one.generate(ids, s, spec=SpecPolicy("mtp", k=2)).token_ids
    b = mesh.generate(ids, s, spec=SpecPolicy("mtp", k=2)).token_ids
    assert a == b


def test_bad_head_mode_is_refused(monkeypatch):
    from specfire.parallel.mtp import head_mode, wanted

    monkeypatch.setenv("SPECFIRE_TP_MTP", "half")
    with pytest.raises(ValueError, match="SPECFIRE_TP_MTP='half': allowed values are shard, whole"):
        head_mode()
    monkeypatch.delenv("SPECFIRE_TP_MTP")
    assert not wanted("cuda", True)                   # opt-in
