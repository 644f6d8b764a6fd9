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
    """The ends: each earlier answer's prompt and where the messages before it end, and where this
    prompt's messages end (before its generation prompt), each where its ids start the prompt's."""
    warm, _ = pair
    msgs = chat([{"role": "user", "content": "Name a colour."}], ("Blue.", "Another one?"), ("Red.", "And a third?"))
    ids = warm.chat_ids(msgs)
    heads = [warm.chat_ids(msgs[:i]) for i in (1, 3)]      # the prompts the two assistant messages answered
    assert all(ids[:len(h)] == h for h in heads)
    assert {len(h) for h in heads} | {h.ends[-2] for h in heads} < set(ids.ends) and ids.ends[-1] == len(ids)
    assert len(ids.ends) == 6 and list(ids) == warm.prompt_ids(ids)
    first = warm.chat_ids(msgs[:1])
    assert first.ends == (first.ends[0], len(first)) and 0 < first.ends[0] < len(first)
    # a ChatML template renders an earlier answer after the very prompt that asked for it: the next
    # turn starts with this whole prompt. Qwen3.5's drops the think block the generation prompt
    # opened, so the next turn starts with this prompt's messages only: their end is the cut both share
    from qwenstyle import qwen_ckpt

    tok = Tokenizer(qwen_ckpt(ckpt_cache, "xml"))
    for t, whole in ((warm.tokenizer, True), (tok, False)):
        now, nxt = t.chat_ids(msgs), t.chat_ids(chat(msgs, ("Green.", "One more?")))
        shared = max(e for e in now.ends if e in nxt.ends and nxt[:e] == now[:e])
        assert shared == (len(now) if whole else now.ends[-2]), t
        assert list(now[:now.ends[-2]]) == list(t.chat_ids(msgs, add_generation_prompt=False))   # then its generation prompt
    call = {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "find", "arguments": {"q": "colour"}}}]}
    loop = msgs + [call, {"role": "tool", "content": "green"}]
    ids = tok.chat_ids(loop)
    head = tok.chat_ids(msgs)
    assert len(head) in ids.ends and ids[:len(head)] == head   # a tool call after the last user message


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
    ids, first = warm.chat_ids(msgs), len(warm.chat_ids(msgs[:1]))
    assert first % PIECE and first in ids.ends                   # a turn end that no piece multiple makes
    prompt = torch.tensor(ids)
    rows, cached = warm.engine.prefix.prefill(ids, prompt, ends=ids.ends)
    assert cached == first
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
    assert sorted(len(k) for k, _ in cache.entries) == [20, 32, 48, 60]   # ... and its own: its end and its last cut
    more = ids + [71, 72]
    assert cache.prefill(more, torch.tensor(more), ends=(20, len(ids), len(more)))[1] == len(ids)


def test_a_qwen_template_chat_resumes_where_the_last_prompt_s_messages_end(ckpt_cache):
    """Under a Qwen3.5-style template (earlier answers rendered without the think block their
    prompt opened) turn 2 resumes where turn 1's messages ended, before its generation prompt, and
    answers as a cold run does (without the cut there it resumes at a piece multiple at best)."""
    from qwenstyle import qwen_ckpt

    path = qwen_ckpt(ckpt_cache, "xml")
    msgs = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
    sp = SamplingParams(max_tokens=6, temperature=0)
    with LLM(path, device="cpu", max_seq_len=512, progress=False) as warm, \
            LLM(path, device="cpu", max_seq_len=512, progress=False) as cold:
        warm.enable_prefix_cache(64 << 20, piece=PIECE)
        cold.enable_prefix_cache(0, piece=PIECE)
        cold.engine.trunk.piece = PIECE
        first = warm.chat(msgs, sp)
        turn1 = warm.chat_ids(msgs)
        msgs2 = msgs + [{"role": "assistant", "content": first.text or "Hm."}, {"role": "user", "content": "And then?"}]
        second, want = warm.chat(msgs2, sp), cold.chat(msgs2, sp)
        assert second.token_ids == want.token_ids
        # from where turn 1's messages end (or a piece multiple past it inside the shared prefix)
        assert 0 < turn1.ends[-2] <= second.stats["cached_tokens"] < len(turn1) and want.stats["cached_tokens"] == 0
        ids = warm.chat_ids(msgs2)
        assert ids[:len(turn1)] != list(turn1)                  # the whole first prompt is not a prefix ...
        assert turn1.ends[-2] in ids.ends                       # ... its messages are, and cut both prefills
