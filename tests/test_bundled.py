"""The bundled model: loads with no path, writes Python, and MTP greedy equals AR greedy on it."""
from __future__ import annotations

import ast
import os

from specfire.api import BUNDLED_MODEL
from specfire.params import SamplingParams

PROMPT = "def is_even(n):\n    \"\"\"Return True if n is even.\"\"\"\n"


def test_bundled_is_a_qwen35_checkpoint_with_mtp(bundled):
    cfg = bundled.cfg
    assert cfg.model_type == "qwen3_5_text" and cfg.mtp_num_hidden_layers == 1 and bundled.mtp_loaded
    assert cfg.n_linear == 3 * cfg.n_full and cfg.rotary_dim == cfg.head_dim // 4
    assert cfg.linear_num_value_heads == 2 * cfg.linear_num_key_heads
    size = sum(os.path.getsize(os.path.join(BUNDLED_MODEL, f)) for f in os.listdir(BUNDLED_MODEL))
    assert size <= 20_000_000, size


def test_bundled_writes_python(bundled):
    """The greedy completion of a function body uses Python keywords and indentation, and the
    prompt plus the completion's first complete statement parses."""
    res = bundled.generate(PROMPT, SamplingParams(max_tokens=40), spec="off")
    text = res.text
    stopped = res.token_ids[-1] in bundled.eos_ids
    assert res.finish_reason == ("stop" if stopped else "length") and (stopped or len(res.token_ids) == 40)
    assert text.strip()
    assert text.startswith("    ") and any(kw in text for kw in ("return", "if ", "for ", "=", "("))
    body = text.split("\n\n")[0].rstrip()
    ast.parse(PROMPT + body + "\n")


def test_bundled_mtp_greedy_equals_ar(bundled):
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = "import os\n\n\ndef list_python_files(root):\n"
    ar = bundled.generate(prompt, sp, spec="off")
    for k in (1, 3):
        mtp = bundled.generate(prompt, sp, spec={"mode": "mtp", "k": k})
        assert mtp.stats["route"] == "mtp"
        assert mtp.token_ids == ar.token_ids, k
        assert mtp.stats["mean_accept_len"] > 1.0
