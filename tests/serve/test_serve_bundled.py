"""Smoke test of `specfire serve` with no model argument: the bundled model behind the openai client.

Needs the bundled checkpoint (specfire/bundled/), which the training pipeline produces."""
import json
import os

import openai
import pytest

from repo import REPO
from serving import start_server, stop

BUNDLED = os.path.join(REPO, "specfire", "bundled")

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = start_server(["--device", "cpu", "--max-seq-len", "2048"], str(tmp_path_factory.mktemp("bundled") / "server.log"))
    yield base
    stop(proc)


def test_bundled_chat_and_speculation(server, capsys):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["bundled"]
    msgs = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    texts = {}
    for mode in ("off", "auto"):
        r = client.chat.completions.create(model="bundled", messages=msgs, max_tokens=32, temperature=0,
                                           extra_body={"speculation": {"mode": mode, "k": 3}})
        texts[mode] = r.choices[0].message.content
        assert r.usage.completion_tokens >= 1
    assert texts["off"] == texts["auto"] and texts["off"].strip()
    chunks = list(client.chat.completions.create(model="bundled", messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["off"]

    from specfire.cli import main

    assert main(["bench", "battery", "--url", server, "-n", "24", "--identity", "--spec", "auto"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["identity"] is True and all(r["saw_done"] for r in lines[:-1])
