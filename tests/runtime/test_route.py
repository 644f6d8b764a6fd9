"""The typed speculation policy end to end: validation, what LLM(spec=...) loads, per-request
override, the route selector and its reason in stats, and where the MTP head's weights come from."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import specfit
from specfire import LLM, SamplingParams, SpecPolicy
from specfire.errors import CheckpointError, SpecfireError
from specfire.runtime.route import select_route
from ckpts import tiny



def ckpt(cache, name: str, mtp: bool = True) -> str:
    return tiny(cache, name, mtp=mtp)


SP = SamplingParams(max_tokens=6, ignore_eos=True)


# ---- SpecPolicy --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    (dict(mode="fast"), "spec.mode"), (dict(mode=None), "spec.mode"), (dict(k=0), "spec.k"),
    (dict(k=11), "spec.k"), (dict(k=2.5), "spec.k"), (dict(k=True), "spec.k"), (dict(k="3"), "spec.k"),
])
def test_policy_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpecPolicy(**kw)


def test_policy_coerce():
    d = SpecPolicy(mode="ngram", k=2)
    assert SpecPolicy.coerce(None, d) is d
    assert SpecPolicy.coerce("mtp", d) == SpecPolicy("mtp", 2)
    assert SpecPolicy.coerce({"k": 5}, d) == SpecPolicy("ngram", 5)
    with pytest.raises(ValueError, match="unknown field"):
        SpecPolicy.coerce({"mode": "mtp", "depth": 3}, d)
    with pytest.raises(ValueError, match="spec must be"):
        SpecPolicy.coerce(3, d)
    with pytest.raises(ValueError, match="spec.k"):
        SpecPolicy.coerce({"k": 0}, d)


# ---- the route selector -------------------------------------------------------------------------

BOTH, NGRAM = ("mtp", "ngram"), ("ngram",)      # the drafters a model has built


def test_select_route():
    g = SamplingParams()
    assert select_route(SpecPolicy("off"), BOTH, g) == ("ar", "speculation off by policy")
    r, why = select_route(SpecPolicy("auto", 4), BOTH, g)                # measured cycle by cycle
    assert r == "auto" and "k<=4" in why and "MTP and n-gram" in why
    r, why = select_route(SpecPolicy("auto"), NGRAM, g)
    assert r == "auto" and "n-gram (no MTP head loaded)" in why
    r, why = select_route(SpecPolicy("auto"), BOTH, SamplingParams(max_tokens=1))
    assert r == "ar" and "single token" in why
    assert select_route(SpecPolicy("auto"), BOTH, SamplingParams(temperature=0.8))[0] == "auto"
    assert select_route(SpecPolicy("ngram"), NGRAM, g) == ("ngram", "n-gram prompt lookup requested (k=3, single)")
    assert select_route(SpecPolicy("mtp", 2), BOTH, g) == ("mtp", "MTP head requested (k=2, single)")
    with pytest.raises(SpecfireError, match="spec mode 'mtp' requested but no MTP head is loaded"):
        select_route(SpecPolicy("mtp"), NGRAM, g)
    r, why = select_route(SpecPolicy("auto"), BOTH, g, "tp2")    # the topology labels the reason only
    assert r == "auto" and "tp2" in why


def test_every_drafting_spec_mode_is_a_registered_drafter(ckpt_cache):
    """The SpecPolicy modes past off / auto are exactly the registry's routes, in auto's order, and
    the engine's drafters are the registry's, each under its own name."""
    from specfire.params import SPEC_MODES
    from specfire.runtime.drafters import KINDS, DraftSource, make_drafters

    assert SPEC_MODES == ("off", "auto") + tuple(k.name for k in KINDS)
    assert [k.name for k in KINDS] == ["mtp", "ngram"]
    assert list(make_drafters(DraftSource(None, None, torch.float32, (2, 3)))) == ["ngram"]   # no head: no MTP
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", progress=False) as llm:
        assert list(llm.engine.drafters) == ["mtp", "ngram"]
        assert all(d.name == r for r, d in llm.engine.drafters.items())


# ---- what LLM(spec=...) loads -------------------------------------------------------------------

def test_spec_off_never_loads_the_head(ckpt_cache, tmp_path):
    path = ckpt(ckpt_cache, "base")
    missing = str(tmp_path / "nowhere.safetensors")
    with LLM(path, device="cpu", spec="off", mtp_path=missing, progress=False) as llm:   # not even looked at
        assert not llm.mtp_loaded
        r = llm.generate([1, 2, 3], SP)
        assert r.stats["route"] == "ar" and r.stats["route_reason"] == "speculation off by policy"
        with pytest.raises(SpecfireError, match="mtp"):
            llm.generate([1, 2, 3], SP, spec="mtp")                       # an error, not a fallback
        with pytest.raises(SpecfireError, match="mtp"):
            llm.generate([1, 2, 3], SP, spec={"mode": "mtp", "k": 2})
        assert "mtp" not in llm.generate([1, 2, 3], SP, spec="auto").stats["routes"]
        assert llm.generate([1, 2, 3], SP, spec="ngram").stats["route"] == "ngram"


def test_spec_mtp_requires_a_head(ckpt_cache):
    path = ckpt(ckpt_cache, "base", mtp=False)
    with pytest.raises(CheckpointError, match=r"mtp\.\* tensors.*mtp\.safetensors"):
        LLM(path, device="cpu", spec="mtp", progress=False)
    with pytest.raises(CheckpointError):
        LLM(path, device="cpu", spec={"mode": "mtp", "k": 2}, progress=False)


def test_spec_auto_loads_when_present_and_says_so(ckpt_cache, caplog):
    with caplog.at_level(logging.INFO, logger="specfire"):
        with LLM(ckpt(ckpt_cache, "base"), device="cpu", progress=False) as llm:
            assert llm.spec == SpecPolicy() and llm.mtp_loaded
            r = llm.generate([1, 2, 3], SP)
            assert r.stats["route"] in ("ar", "mtp", "ngram") and r.stats["route_reason"].startswith("auto")
    assert any("MTP head loaded" in m for m in caplog.messages)
    with LLM(ckpt(ckpt_cache, "base", mtp=False), device="cpu", progress=False) as llm:
        assert not llm.mtp_loaded
        r = llm.generate([1, 2, 3], SP)
        assert r.stats["route"] in ("ar", "ngram") and "mtp" not in r.stats["routes"]
        with pytest.raises(SpecfireError, match="no MTP head"):
            llm.generate([1, 2, 3], SP, spec="mtp")


def test_per_request_override(ckpt_cache):
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", spec={"mode": "ngram", "k": 2}, progress=False) as llm:
        r = llm.generate([1, 2, 1, 2, 1, 2], SP)
        assert (r.stats["route"], r.stats["k"]) == ("ngram", 2)
        r = llm.generate([1, 2, 1, 2], SP, spec={"k": 5})                   # mode from the default
        assert (r.stats["route"], r.stats["k"]) == ("ngram", 5)
        r = llm.generate([1, 2, 1, 2], SP, spec=SpecPolicy("mtp", 4))
        assert (r.stats["route"], r.stats["k"]) == ("mtp", 4)
        r = llm.generate([1, 2, 1, 2], SP, spec="off")
        assert (r.stats["route"], r.stats["k"]) == ("ar", 0)
        r = llm.generate([1, 2, 1, 2], SamplingParams(max_tokens=1), spec="auto")
        assert r.stats["route"] == "ar" and len(r.token_ids) == 1
        with pytest.raises(ValueError, match="spec.mode"):
            llm.generate([1, 2], SP, spec="turbo")
        with pytest.raises(ValueError, match="spec.k"):
            llm.generate([1, 2], SP, spec={"k": 99})


# ---- where the head's weights come from ---------------------------------------------------------

def head_tensors(llm: LLM) -> dict[str, torch.Tensor]:
    head = llm.engine.drafters["mtp"].head
    return {"mtp." + n: p.detach() for n, p in head.named_parameters()}


def test_mtp_sidecar_beside_the_checkpoint(ckpt_cache, tmp_path):
    fitted = specfit.fitted_checkpoint(ckpt_cache["shared"])
    side = specfit.variant(fitted, str(tmp_path / "side"), mtp_sidecar=True)
    assert not any(k.startswith("mtp.") for k in load_file(os.path.join(side, "model.safetensors")))
    p = specfit.prompts(1, seed=31)[0]
    with LLM(fitted, device="cpu", progress=False) as a, LLM(side, device="cpu", progress=False) as b:
        assert b.mtp_loaded
        ta, tb = head_tensors(a), head_tensors(b)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        ra = a.generate(p, SamplingParams(max_tokens=24, ignore_eos=True), spec={"mode": "mtp", "k": 3})
        rb = b.generate(p, SamplingParams(max_tokens=24, ignore_eos=True), spec={"mode": "mtp", "k": 3})
        assert ra.token_ids == rb.token_ids and ra.stats["accepted"] == rb.stats["accepted"] > 0
    with LLM(side, device="cpu", spec="off", progress=False) as c:
        assert not c.mtp_loaded


def test_mtp_path_given_explicitly(ckpt_cache, tmp_path):
    fitted = specfit.fitted_checkpoint(ckpt_cache["shared"])
    heads = {k: v for k, v in load_file(os.path.join(fitted, "model.safetensors")).items() if k.startswith("mtp.")}
    sidecar = str(tmp_path / "my_head.safetensors")
    save_file(heads, sidecar)
    nohead = ckpt(ckpt_cache, "base", mtp=False)
    with LLM(nohead, device="cpu", spec="mtp", mtp_path=sidecar, progress=False) as llm:
        got = head_tensors(llm)
        assert all(torch.equal(got[k], heads[k]) for k in heads)
        assert llm.generate([1, 2, 3], SP).stats["route"] == "mtp"
    # an explicit path wins over the checkpoint's own mtp.* tensors
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", mtp_path=sidecar, progress=False) as llm:
        got = head_tensors(llm)
        assert all(torch.equal(got[k], heads[k]) for k in heads)
    with pytest.raises(CheckpointError, match="not found"):
        LLM(nohead, device="cpu", spec="auto", mtp_path=str(tmp_path / "missing.safetensors"), progress=False)
    bad = dict(heads)
    bad["mtp.fc.weight"] = bad["mtp.fc.weight"][:, :5].contiguous()
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight"):
        LLM(nohead, device="cpu", spec="mtp", mtp_path=str(tmp_path / "bad.safetensors"), progress=False)


def test_a_route_plan_goes_with_its_request(ckpt_cache):
    """LLM.plan_route decides once; stream(plan=) serves that decision (its params and spec by
    default) and refuses it for other params."""
    with LLM(ckpt(ckpt_cache, "base"), device="cpu", progress=False) as llm:
        sp = SamplingParams(max_tokens=4)
        plan = llm.plan_route(sp, {"mode": "ngram", "k": 2})
        assert (plan.route, plan.reason) == llm.preview_route(sp, {"mode": "ngram", "k": 2})
        res = list(llm.stream([1, 2, 3], plan=plan))[-1].result
        assert res.stats["route"] == "ngram" and res.stats["route_reason"] == plan.reason
        with pytest.raises(ValueError, match="plan: a route plan serves the spec policy and sampling params"):
            list(llm.stream([1, 2, 3], SamplingParams(max_tokens=5), plan=plan))
        with pytest.raises(ValueError, match="plan must be a RoutePlan"):
            llm.stream([1, 2, 3], plan=("ngram", "why"))
