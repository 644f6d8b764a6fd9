"""A chat's next turn resumes from the end of the previous turn's prompt: the chat's ids carry the
turn ends (tokenizer.ChatIds), every prefill of the prompt ends a forward there, so a resumed
prefill gives the bits of a cold one (runtime/prefix.py)."""
import pytest
import torch

from specfire import LLM, SamplingParams
from specfire.runtime.prefix import PrefixCache
from specfire.tokenizer import Tokenizer
from tinytok import make_tok_checkpoint

PIECE = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One checkpoint twice, both prefilling in 16-row pieces: one keeping snapshots, one cold."""
    path = make_tok_checkpoint(str(tmp_path_factory.mktemp("turns") / "ckpt"), seed=7)
    with LLM(path, device="cpu", max_seq_len=512, progress=False) as warm, \
            LLM(path, device="cpu", max_seq_len=512, progress=False) as cold:
        warm.enable_prefix_cache(64 << 20, piece=PIECE)
        cold.enable_prefix_cache(0, piece=PIECE)
        cold.engine.trunk.piece = PIECE
        yield warm, cold


def chat(msgs, *turns):
    for reply, user in turns:
        msgs = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    return msgs


def test_chat_ids_carry_the_turn_ends(pair, ckpt_cache):
    warm, _ = pair
    msgs = chat([{"role": "user", "content": "Name a colour."}], ("Blue.", "Another one?"), ("Red.", "And a third?"))
    ids = warm.chat_ids(msgs)
    heads = [warm.chat_ids(msgs[:i]) for i in (1, 3)]      # the prompts the two assistant messages answered
    assert all(ids[:len(h)] == h for h in heads)
    assert ids.ends == (len(heads[0]), len(heads[1]), len(ids)) and list(ids) == warm.prompt_ids(ids)
    assert warm.chat_ids(msgs[:1]).ends == (len(heads[0]),)
    # a template that renders an earlier answer unlike the prompt that asked for it (Qwen3.5's drops
    # the think block the generation prompt opened) has no turn end there; a tool call after the
    # last user message keeps its think block, so the step that made it is a turn end
    from qwenstyle import qwen_ckpt

    tok = Tokenizer(qwen_ckpt(ckpt_cache, "xml"))
    plain = tok.chat_ids(msgs)
    assert plain.ends == (len(plain),)
    call = {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "find", "arguments": {"q": "colour"}}}]}
    loop = msgs + [call, {"role": "tool", "content": "green"}]
    ids = tok.chat_ids(loop)
    head = tok.chat_ids(msgs)
    assert ids.ends == (len(head), len(ids)) and ids[:len(head)] == head


def test_turns_through_the_server_resume_from_the_last_prompt(pair):
    """Turns 2 and 3 report the previous turn's whole prompt as cached and answer as a cold server
    does, token for token (turn 3 with two choices: the shared prefill of a request's choices)."""
    from fastapi.testclient import TestClient

    from specfire.serve.http import build_app

    warm, cold = pair
    warm.engine.prefix.clear()
    msgs = [{"role": "user", "content": "Tell me about the lighthouse keeper and the bottle."}]
    prev = None
    with TestClient(build_app(warm, "w")) as tw, TestClient(build_app(cold, "c")) as tc:
        for turn in range(3):
            body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "n": 2 if turn == 2 else 1}
            got, want = tw.post("/v1/chat/completions", json=body).json(), tc.post("/v1/chat/completions", json=body).json()
            texts = [c["message"]["content"] for c in got["choices"]]
            assert texts == [c["message"]["content"] for c in want["choices"]], turn
            usage = got["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if prev is None else prev["prompt_tokens"])
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            prev = usage
            msgs = chat(msgs, (texts[0], f"And then? ({turn})"))


def test_a_resumed_prefill_has_the_bits_of_a_cold_one(pair):
    warm, cold = pair
    msgs = chat([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                ("def add(a, b): return a + b", "Now subtract."))
    warm.chat(msgs[:1], SamplingParams(max_tokens=2))           # keeps the first turn's prompt end
    ids = warm.chat_ids(msgs)
    assert ids.ends[0] % PIECE                                   # a turn end that no piece multiple makes
    prompt = torch.tensor(ids)
    rows, cached = warm.engine.prefix.prefill(ids, prompt, ends=ids.ends)
    assert cached == ids.ends[0]
    trunk = cold.engine.trunk
    trunk.begin()
    ref = trunk.prefill(prompt, ends=ids.ends)
    assert torch.equal(rows.logits, ref.logits) and torch.equal(rows.hidden, ref.hidden)
    # the negative control: a cold prefill in piece multiples alone computes other bits, so a
    # snapshot at the turn end is exact only because the cold prefill cuts there too
    trunk.begin()
    plain = trunk.prefill(prompt)
    assert not (torch.equal(plain.logits, ref.logits) and torch.equal(plain.hidden, ref.hidden))


def test_a_snapshot_cut_elsewhere_is_not_restored(pair):
    """A snapshot whose prefill did not cut where this prompt's does holds other bits: it is passed
    over, and the prefill is a cold one's."""
    warm, cold = pair
    cache = PrefixCache(warm.engine.trunk, 64 << 20)
    raw = list(range(3, 43))                                     # 40 tokens: a snapshot at 32, no turn ends
    cache.prefill(raw, torch.tensor(raw))
    assert [len(k) for k, _ in cache.entries] == [32]
    ids = raw + list(range(50, 70))
    ends = (20, len(ids))                                        # a chat cut at 20: 32 was reached otherwise
    rows, cached = cache.prefill(ids, torch.tensor(ids), ends=ends)
    trunk = cold.engine.trunk
    trunk.begin()
    ref = trunk.prefill(torch.tensor(ids), ends=ends)
    assert cached == 0 and torch.equal(rows.logits, ref.logits)
    assert sorted(len(k) for k, _ in cache.entries) == [32, 48, 60]   # ... and its own, cut at 20
    more = ids + [71, 72]
    assert cache.prefill(more, torch.tensor(more), ends=(20, len(ids), len(more)))[1] == len(ids)
