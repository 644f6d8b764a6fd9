import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ckpt_cache(tmp_path_factory):
    """Session-wide cache of tiny checkpoints, keyed by their recipe."""
    return {"root": tmp_path_factory.mktemp("ckpts"), "made": {}}
