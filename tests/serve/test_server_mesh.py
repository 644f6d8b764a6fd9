"""`specfire serve --tp 2` on a 2-rank gloo mesh (CPU): concurrent chats of mixed policies share the
mesh's steps and each streams the text it gives alone."""
import threading

import openai
import pytest

from serving import mixed_chats, start_server, stop

NAME = "tiny-mesh"
CHATS = mixed_chats(24)


@pytest.fixture(scope="module")
def mesh_client(tinytok_ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("mesh") / "server.log")
    proc, base = start_server([tinytok_ckpt, "--tp", "2", "--tp-invariant", "--served-model-name", NAME,
                               "--max-seq-len", "512", "--max-num-seqs", "4"], log, timeout=240)
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        stop(proc)


def test_concurrent_chats_on_a_mesh_match_alone(mesh_client):
    alone = [mesh_client.chat.completions.create(model=NAME, **kw).choices[0].message.content for kw in CHATS]
    got: list = [None] * len(CHATS)
    start = threading.Barrier(len(CHATS))

    def go(i):
        start.wait(30)
        text = ""
        for c in mesh_client.chat.completions.create(model=NAME, stream=True, **CHATS[i]):
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
        got[i] = text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(CHATS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(a for a in alone[:3]), alone
    assert got == alone
