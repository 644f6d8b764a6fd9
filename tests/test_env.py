"""specfire/env.py: the operational knobs, typed, with a bad value refused by name."""
import pytest

from specfire.env import DEFAULT_TP_TIMEOUT_S, Env
from specfire.parallel.launch import mesh_timeout


def test_defaults_and_values():
    assert Env.read({}) == Env(api_key=None, tp_timeout_s=DEFAULT_TP_TIMEOUT_S)
    assert Env.read({"SPECFIRE_API_KEY": "k", "SPECFIRE_TP_TIMEOUT": "2.5"}) == Env("k", 2.5)
    assert Env.read({"SPECFIRE_API_KEY": ""}).api_key is None


@pytest.mark.parametrize("bad", ["0", "-3", "x", "inf", "nan", ""])
def test_a_bad_timeout_names_the_variable(bad):
    with pytest.raises(ValueError, match=f"SPECFIRE_TP_TIMEOUT must be a positive number of seconds, got {bad!r}"):
        Env.read({"SPECFIRE_TP_TIMEOUT": bad})


def test_the_mesh_reads_its_timeout_there(monkeypatch):
    monkeypatch.setenv("SPECFIRE_TP_TIMEOUT", "7")
    assert mesh_timeout() == 7.0
