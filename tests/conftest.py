import io
import os
import random
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# The test models are tiny: one intra-op thread is as fast as several on an idle machine and far
# faster on a busy one (threads spinning on shared cores slowed decode up to 60x).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded_rngs(request):
    """The global RNGs start from a seed of the test's own id, so a draw that forgets its generator
    is still the same whatever ran before (tests should pass a torch.Generator all the same)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    if torch.get_num_threads() != 1:        # an in-process `specfire --threads N` leaves N behind
        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def ckpt_cache(tmp_path_factory):
    """Session-wide cache of tiny checkpoints, keyed by their recipe. "shared": a folder every
    xdist worker of this run sees (the run's base temp), for what is built once for all of them."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return {"root": tmp_path_factory.mktemp("ckpts"), "shared": shared, "made": {}}


@pytest.fixture(scope="module")
def tiny_vocab(ckpt_cache) -> str:
    """A tiny checkpoint with a vocabulary of 8: sampled speculation's distribution is checkable."""
    from tinymodels import make_checkpoint

    key = ("spec", "vocab8")
    if key not in ckpt_cache["made"]:
        ckpt_cache["made"][key] = make_checkpoint(os.path.join(ckpt_cache["root"], "spec_vocab8"), "base",
                                                  vocab_size=8, seed=3)
    return ckpt_cache["made"][key]


@pytest.fixture(scope="module")
def tok_path(ckpt_cache):
    """A tiny checkpoint with a small byte-level BPE tokenizer (tests/ckpts.py)."""
    from ckpts import tiny

    return tiny(ckpt_cache, "base", tokenizer=True)


@pytest.fixture(scope="module")
def tok(tok_path):
    from specfire.tokenizer import Tokenizer

    return Tokenizer(tok_path)


@pytest.fixture(scope="module")
def tok_llm(tok_path):
    """The tok_path checkpoint loaded without speculation: the reference for text-level runs."""
    from specfire import LLM

    with LLM(tok_path, device="cpu", spec="off", progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def tinytok_ckpt(tmp_path_factory) -> str:
    """A tiny checkpoint with a trained BPE and ChatML (tests/tinytok.py, seed 3), fresh per module."""
    from tinytok import make_tok_checkpoint

    return make_tok_checkpoint(str(tmp_path_factory.mktemp("tinytok") / "ckpt"), seed=3)


@pytest.fixture(scope="module")
def fitted(ckpt_cache) -> str:
    """The fitted tiny model (tests/specfit.py): its MTP head's drafts really get accepted."""
    import specfit

    return specfit.fitted_checkpoint(ckpt_cache["shared"])


@pytest.fixture(scope="module")
def bundled():
    """The bundled model (specfire/bundled/) on the CPU, loaded once per module."""
    from specfire import LLM

    with LLM(device="cpu", progress=False) as m:
        yield m


class Ran:
    """What one in-process `specfire ...` invocation returned (the shape of subprocess's answer)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli_run(capsys, monkeypatch):
    """`specfire ARGS` through `cli.main` in this process: the same argument parsing, error handling
    and output as the console script, without a new interpreter (seconds each on a 2-core machine).
    Each CLI test file keeps one or two runs through a real process (exit code, no traceback)."""
    from specfire import cli

    def go(*args: str, stdin: str = "") -> Ran:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        try:
            rc = cli.main(list(args))
        except SystemExit as e:              # argparse leaves through exit()
            rc = e.code
        out, err = capsys.readouterr()
        return Ran(rc, out, err)

    return go


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """pytest-randomly prints its seed in the header, which -q hides: repeat it, so a failure in
    one order can be rerun in that order."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed")
        terminalreporter.write_line(f"test order: pytest-randomly seed {seed} (rerun this order: "
                                    f"pytest --randomly-seed={seed}; fixed order: pytest -p no:randomly)")
