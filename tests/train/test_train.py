"""The trainer's batched forward equals the inference modules, and the whole recipe runs on the CPU."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from repo import REPO
from specfire.api import LLM
from specfire.params import SamplingParams
from specfire.train import model as tm
from specfire.train.corpus import HELD_OUT, build_corpus
from specfire.train.train import PRESETS, TrainConfig, run
from tinymodels import make_checkpoint


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    make_checkpoint(d, "gqa4", seed=417)
    llm = LLM(d, device="cpu", dtype="float32", spec="mtp", progress=False)
    yield llm
    llm.close()


def test_training_forward_matches_inference_logits(tiny_llm):
    trunk = tiny_llm.engine.trunk.model
    v = trunk.cfg.vocab_size
    ids = torch.randint(0, v, (3, 137), generator=torch.Generator().manual_seed(1))   # not a multiple of the GDN chunk
    ref = torch.stack([tiny_llm.score(row.tolist()) for row in ids])
    with torch.no_grad():
        got = tm.lm_logits(trunk, tm.trunk_hidden(trunk, ids))
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


def test_chained_mtp_rows_match_the_drafter_convention(tiny_llm):
    """Step s of the training MTP forward at position p equals the head run step by step as the
    drafter does: trunk-fed rows up to p-s+1, then its own post-norm output fed back."""
    trunk = tiny_llm.engine.trunk.model
    head = tiny_llm.engine.drafters["mtp"].head
    t = 90
    ids = torch.randint(0, trunk.cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = tm.trunk_hidden(trunk, ids)
        outs = tm.mtp_hidden(head, trunk, ids, h, steps=3)
        for b, p0 in ((0, 0), (1, 17), (0, 70)):
            x = ids[b]
            st = head.new_state(t + 4, torch.float32)
            if p0 > 0:
                head(trunk.embed_tokens(x[1:p0 + 1]), h[b, :p0], 0, st, rows=False)
            _, post = head(trunk.embed_tokens(x[p0 + 1:p0 + 2]), h[b, p0:p0 + 1], p0, st, rows=True)
            assert torch.allclose(post[0], outs[0][b, p0], atol=1e-4, rtol=1e-4)
            for s in (2, 3):
                p = p0 + s - 1
                _, post = head(trunk.embed_tokens(x[p + 1:p + 2]), post, p, st, rows=True)
                assert torch.allclose(post[0], outs[s - 1][b, p], atol=1e-4, rtol=1e-4), (b, p0, s)


def test_corpus_holds_out_the_documented_modules():
    c = build_corpus()
    train = {r for r, _ in c.train}
    held = {r for r, _ in c.held_out}
    assert held and not (train & held)
    assert all(any(r == h or (h.endswith("/") and r.startswith(h)) for h in HELD_OUT) for r in held)
    assert not any(r.endswith(("test_json/__init__.py", "test_csv.py", "test_argparse.py")) for r in train)


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny-recipe") / "ckpt")
    kw = dict(PRESETS["tiny"])
    kw.update(steps=3, max_files=25, eval_windows=2, seq_len=64)
    m = run(TrainConfig(out=out, device="cpu", **kw), log=lambda *_: None)
    return out, kw, m


def test_tiny_recipe_end_to_end(tiny_trained):
    out, kw, m = tiny_trained
    assert m["steps_done"] == 3
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"].count("full_attention") * 3 == cfg["layer_types"].count("linear_attention")
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    with LLM(out, device="cpu", spec="mtp", progress=False) as llm:
        assert llm.mtp_loaded
        assert llm.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi<|im_end|>")
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        a = llm.generate("def f(x):", sp, spec="off")
        b = llm.generate("def f(x):", sp, spec={"mode": "mtp", "k": 3})
        assert a.token_ids == b.token_ids and len(a.token_ids) == 12
        ids = llm.tokenizer.encode("import os\n\ndef main():\n    return 0\n")
        ours = llm.score(ids)
        # the reported held-out perplexity is that of the exported model on the held-out windows
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        held = []
        for enc in tok.encode_batch([t for _, t in build_corpus(None, kw["max_files"]).held_out],
                                    add_special_tokens=False):
            held += enc.ids + [tok.token_to_id("<|endoftext|>")]
        t = kw["seq_len"]
        wins = torch.tensor(held[:kw["eval_windows"] * t]).view(-1, t)
        nll = torch.stack([torch.nn.functional.cross_entropy(llm.score(w.tolist())[:-1], w[1:]) for w in wins])
        ev = m["held_out"]
        assert ev["windows"] == len(wins) == kw["eval_windows"] and ev["tokens"] == wins.numel()
        assert math.isclose(ev["ppl"], math.exp(nll.mean().item()), rel_tol=1e-4), (ev["ppl"], nll)
    from transformers import Qwen3_5ForCausalLM      # the export is a real HF checkpoint

    hf = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ((ref - ours).abs().max() / ref.abs().max()).item() < 1e-4


# ---- unlikelihood training: rollouts, losses, the fine-tune phase ---------------------------------

def test_rollout_steps_match_the_batched_forward(tiny_llm):
    """The rollout's one-token steps with recurrent state give the batched forward's logits, and a
    greedy rollout is the argmax of the forward over its own output."""
    from specfire.train.rollout import _State, greedy_rollout, step_logits

    trunk = tiny_llm.engine.trunk.model
    ids = torch.randint(0, trunk.cfg.vocab_size, (3, 71), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = tm.lm_logits(trunk, tm.trunk_hidden(trunk, ids))
        st = _State(trunk, 3, 71, ids.device)
        got = torch.stack([step_logits(trunk, ids[:, p], p, st) for p in range(71)], 1)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    seq = greedy_rollout(trunk, ids[:, :9], 20)
    assert torch.equal(seq[:, :9], ids[:, :9]) and seq.shape == (3, 29)
    with torch.no_grad():
        again = tm.lm_logits(trunk, tm.trunk_hidden(trunk, seq))
    assert torch.equal(again[:, 8:-1].argmax(-1), seq[:, 9:])


def test_ngram_repeat_mask_and_alive_mask():
    from specfire.train.unlikelihood import alive_mask, ngram_repeat_mask

    s = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 9, 9, 9, 9, 9, 9]])
    assert ngram_repeat_mask(s, 0, 4)[0].int().tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    # from position 6 on; the prompt's n-grams count unless with_prompt=False
    assert ngram_repeat_mask(s, 6, 3)[0].int().tolist() == [0] * 6 + [1, 1, 1, 0, 1, 1, 1, 1, 1]
    assert ngram_repeat_mask(s, 6, 3, with_prompt=False)[0].int().tolist() == [0] * 10 + [1] * 5
    assert alive_mask(torch.tensor([[5, 5, 1, 2, 0, 3, 0]]), 2, (0,))[0].int().tolist() == [0, 0, 1, 1, 1, 0, 0]


def test_unlikelihood_losses_match_their_definitions():
    from specfire.train.unlikelihood import sequence_unlikelihood, token_unlikelihood

    g = torch.Generator().manual_seed(3)
    b, t, v = 2, 9, 11
    ids = torch.randint(0, v, (b, t), generator=g)
    logits = torch.randn(b, t - 1, v, generator=g)
    p = logits.softmax(-1)
    want = sum(-torch.log(1 - p[i, j, c]) for i in range(b) for j in range(t - 1)
               for c in set(ids[i, :j + 1].tolist()) - {ids[i, j + 1].item()}) / (b * (t - 1))
    assert torch.allclose(token_unlikelihood(logits, ids), want, rtol=1e-5)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, 4] = mask[1, 7] = True
    alive = torch.ones(b, t, dtype=torch.bool)
    alive[:, :3] = False
    want = (-torch.log(1 - p[0, 3, ids[0, 4]]) - torch.log(1 - p[1, 6, ids[1, 7]])) / (2 * (t - 3))
    assert torch.allclose(sequence_unlikelihood(logits, ids, mask, alive), want, rtol=1e-5)


def test_anchored_unlikelihood_is_unlikelihood_with_an_anchor():
    """At the teacher's own distribution the anchored loss has the plain loss's gradient; elsewhere
    its unmasked rows pull towards the teacher (the plain loss ignores them)."""
    from specfire.train.unlikelihood import anchored_unlikelihood, sequence_unlikelihood

    g = torch.Generator().manual_seed(4)
    b, t, v = 2, 7, 13
    seq = torch.randint(0, v, (b, t), generator=g)
    teacher = torch.randn(b, t - 1, v, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.5
    alive = torch.ones(b, t, dtype=torch.bool)
    grads = []
    for fn in (lambda x: anchored_unlikelihood(x, teacher, seq, mask, alive),
               lambda x: sequence_unlikelihood(x, seq, mask, alive)):
        x = teacher.clone().requires_grad_(True)
        fn(x).backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    x = (teacher + torch.randn(b, t - 1, v, generator=g)).requires_grad_(True)
    anchored_unlikelihood(x, teacher, seq, torch.zeros_like(mask), alive).backward()
    assert x.grad.abs().sum() > 0                                            # pulled back to the teacher


def test_banned_anchored_target_removes_every_repeat_continuation():
    """repeat_continuations bans exactly the tokens that would complete an n-gram seen earlier (brute
    force); the loss is cross-entropy to the teacher without them, the same whatever token was written."""
    from specfire.train.unlikelihood import banned_anchored_unlikelihood, repeat_continuations

    g = torch.Generator().manual_seed(5)
    b, t, v, n, start = 3, 23, 5, 3, 4
    seq = torch.randint(0, 3, (b, t), generator=g)
    ban = repeat_continuations(seq, start, n, v)
    for r in range(b):
        s = seq[r].tolist()
        for i in range(t):
            want = {s[j] for j in range(n - 1, i) if s[j - n + 1:j] == s[i - n + 1:i]} if i >= max(n - 1, start) else set()
            assert set(ban[r, i].nonzero().flatten().tolist()) == want
    teacher = torch.randn(b, t - 1, v, generator=g)
    alive = torch.ones(b, t, dtype=torch.bool)
    alive[:, :start] = False
    alive[1, 15:] = False
    x = torch.randn(b, t - 1, v, generator=g)
    q = teacher.softmax(-1) * ~ban[:, 1:]
    q = q / q.sum(-1, keepdim=True)
    want = -(q * x.log_softmax(-1)).sum(-1)[alive[:, 1:]].mean()
    assert torch.allclose(banned_anchored_unlikelihood(x, teacher, ban, alive), want, rtol=1e-5)
    # with nothing banned the teacher itself is the minimum
    y = teacher.clone().requires_grad_(True)
    banned_anchored_unlikelihood(y, teacher, torch.zeros_like(ban), alive).backward()
    assert y.grad.abs().max() < 1e-6


def test_word_continuations_are_not_banned():
    """With word edges, a repeat is refused only where a new word or symbol starts: in
    `self.celsius = c\nself.cel|sius` the token `sius` (it continues `cel`) stays allowed, while
    `cel` after `self.` and `=` after `sius` are banned as before."""
    from specfire.train.unlikelihood import repeat_continuations, word_edges

    class Tok:                                  # the two methods word_edges uses
        words = ["self", ".", "cel", "sius", " =", " c", "\n", "_f", "lshfd"]

        def get_vocab_size(self):
            return len(self.words)

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.words[i] for i in ids)

    starts, ends = word_edges(Tok(), 10)                # one id more than the tokenizer has: False, False
    assert starts.tolist() == [True, False, True, True, False, False, False, True, True, False]
    assert ends.tolist() == [True, False, True, True, False, True, False, True, True, False]
    # self . cel sius  =  c \n self . cel sius  =
    seq = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    plain = repeat_continuations(seq, 7, 3, 10)
    word = repeat_continuations(seq, 7, 3, 10, (starts, ends))
    assert plain[0, 9, 2] and word[0, 9, 2]            # `cel` after `self .` (a new word): banned
    assert plain[0, 10, 3] and not word[0, 10, 3]      # `sius` after `cel`: continues the word, allowed
    assert plain[0, 11, 4] and word[0, 11, 4]          # ` =` after `sius`: a new symbol, banned
    assert word.sum() == plain.sum() - 1


def test_kl_to_teacher_is_the_kl_divergence():
    from specfire.train.unlikelihood import kl_to_teacher

    g = torch.Generator().manual_seed(6)
    x, t = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    want = torch.nn.functional.kl_div(x.log_softmax(-1), t.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1).mean()
    assert torch.allclose(kl_to_teacher(x, t), want, rtol=1e-5) and kl_to_teacher(x, t) > 0
    y = t.clone().requires_grad_(True)
    kl_to_teacher(y, t).backward()                          # zero, with zero gradient, at the teacher
    assert kl_to_teacher(t, t).abs() < 1e-6 and y.grad.abs().max() < 1e-6


def test_rollout_with_prompts_of_several_lengths(tiny_llm):
    """One batch of prompts of different lengths gives each row what a rollout of its prompt alone gives."""
    from specfire.train.rollout import greedy_rollout

    trunk = tiny_llm.engine.trunk.model
    ids = torch.randint(0, trunk.cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(7))
    lens = [11, 4, 7]
    seq = greedy_rollout(trunk, ids, 9, lengths=lens)
    for r, n in enumerate(lens):
        alone = greedy_rollout(trunk, ids[r:r + 1, :n], 9)[0]
        assert torch.equal(seq[r, :n + 9], alone)
    with pytest.raises(ValueError, match="lengths"):
        greedy_rollout(trunk, ids, 2, lengths=[12, 1, 1])


def test_snapshot_rule_and_loop_figures():
    from specfire.train.select import Candidate, choose, completion_figures, summarize

    c = [Candidate(10, 0.30, 1.01), Candidate(20, 0.22, 1.07), Candidate(30, 0.24, 1.04), Candidate(40, 0.24, 1.02)]
    assert choose(c, 0.05).step == 40                      # step 20 is over budget; tie on rep -> lower ppl
    assert choose(c, 0.10).step == 20
    assert choose([Candidate(5, 0.1, 1.2)], 0.05) is None
    a = completion_figures("def f():\n", "    x = 1\n    x = 1\n    y = 2\n    x = 1\n    par", ended=False)
    b = completion_figures("def g():\n", "    return 1\n", ended=True)     # one line, then end-of-text
    assert (a["lines"], a["repeated"], a["g_lines"], a["g_repeated"]) == (4, 2, 4, 2)
    assert (b["lines"], b["repeated"], b["g_lines"], b["g_repeated"]) == (1, 0, 2, 2)
    s = summarize([a, b])
    assert s["repeated_line_frac"] == 2 / 5 and s["repeated_line_frac_guarded"] == 4 / 6 and s["ended"] == 1
    c = completion_figures("def h():\n", '    """all of it all of it"""\n    return 1\n', ended=True)
    assert c["phrase_loops"] == 1 and summarize([a, c])["phrase_loop_line_frac"] == 1 / 6


def test_line_repeat_continuations_match_their_definition():
    """Brute force: at i, ban seq[j] when seq[i-m:i] == seq[j-m:j] (j < i) and no line-break token
    lies in positions j-m .. i-1; with edges, never a token that continues a word."""
    from specfire.train.unlikelihood import line_repeat_continuations

    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 5, (3, 40), generator=g)                  # id 0 ends a line
    newline = torch.tensor([True, False, False, False, False, False])
    n, start, v = 3, 5, 6
    ban = line_repeat_continuations(seq, start, n, v, newline)
    m = n - 1
    want = torch.zeros_like(ban)
    for b in range(3):
        s = seq[b].tolist()
        for i in range(max(m, start), 40):
            for j in range(m, i):
                if s[i - m:i] == s[j - m:j] and 0 not in s[j - m:i]:
                    want[b, i, s[j]] = True
    assert torch.equal(ban, want) and want.any()
    starts = torch.tensor([False, True, True, False, False, False])  # ids 1, 2 are word pieces
    ends = torch.tensor([False, True, False, False, False, False])
    word = line_repeat_continuations(seq, start, n, v, newline, (starts, ends))
    cont = ends[seq][:, :, None] & starts[None, None, :]              # [B, i+1, c]: c continues a word at i+1
    assert torch.equal(word[:, 1:], ban[:, 1:] & ~cont[:, :-1])


def test_phrase_loop_lines_counts_loops_inside_a_line():
    from specfire.train.unlikelihood import phrase_loop_lines

    text = ("the directory of the directory of the root\nall all all all\nself.a = self.a + b\n"
            "x[0], x[1], x[2]\n\n    return the value of the value of x\ncut of the cut of the")
    assert phrase_loop_lines(text) == (5, 3)                 # blank line skipped, cut tail dropped
    assert phrase_loop_lines(text, cut=False) == (6, 4)
    assert phrase_loop_lines("a b a b", cut=False, n=2) == (1, 1) and phrase_loop_lines("a b c", cut=False) == (1, 0)


def test_ul_schedule_fit():
    from specfire.train.phase import fit_schedule

    assert fit_schedule(11, 0.5, 20.0, 1000) == 51          # 40 more steps fit in 20 s
    assert fit_schedule(11, 0.5, 20.0, 30) == 30            # capped by ul_steps
    assert fit_schedule(11, 0.5, -3.0, 1000) == 12          # over time: one more step, then the phase stops


def test_unlikelihood_phase_from_a_checkpoint(tiny_trained, tmp_path):
    """`init` + a UL phase: the checkpoint's tokenizer and shape are kept, snapshots are packed, the
    metrics hold the before/after evaluations and repetition logs, and greedy MTP == AR on it."""
    src, kw, _ = tiny_trained
    kw = dict(kw, ul_steps=3, ul_pool=4, ul_batch=2, ul_data_batch=2, ul_new_tokens=16, ul_prompt_min=6,
              ul_prompt_max=8, ul_eval_prompts=2, ul_eval_prompt_tokens=6, ul_snapshots=1, ul_probe_steps=1,
              hidden_size=32)                                             # the checkpoint's shape wins
    out = str(tmp_path / "ul")
    m = run(TrainConfig(out=out, device="cpu", init=src, pack_dir=str(tmp_path / "pack"), **kw),
            log=lambda *_: None)
    assert m["train_config"]["hidden_size"] == 64 and m["ul"]["steps_done"] == 3
    assert {"held_out", "before_ul", "ul"} <= set(m) and "held_out" in m["before_ul"]
    assert set(m["ul"]["repetition_before"]) >= {"repeated_line_frac", "distinct_4gram_frac", "lines"}
    assert [s["step"] for s in m["ul"]["snapshots"]] == [2]
    assert sorted(os.listdir(tmp_path / "pack")) == ["model.tar.part00", "ul-1.tar.part00"]
    with open(os.path.join(src, "tokenizer.json")) as a, open(os.path.join(out, "tokenizer.json")) as b:
        assert a.read() == b.read()
    with LLM(out, device="cpu", progress=False) as llm:
        sp = SamplingParams(max_tokens=10, ignore_eos=True)
        assert (llm.generate("def f(x):", sp, spec="off").token_ids
                == llm.generate("def f(x):", sp, spec={"mode": "mtp", "k": 3}).token_ids)


def test_unlikelihood_phase_keeps_the_chosen_snapshot(tiny_trained, tmp_path):
    """ul_select + the KL term + the anneal phase: every snapshot of both phases is scored on the
    validation files (set aside from the phase's text), the rule picks one, and the exported
    weights are that snapshot's (their greedy figures are the chosen candidate's)."""
    from tokenizers import Tokenizer

    from specfire.train import select as sel
    from specfire.train.export import load_checkpoint

    src, kw, _ = tiny_trained
    kw = dict(kw, ul_steps=4, ul_pool=4, ul_batch=2, ul_data_batch=2, ul_new_tokens=12, ul_prompt_min=6,
              ul_prompt_max=8, ul_eval_prompts=2, ul_eval_prompt_tokens=6, ul_snapshots=2, ul_probe_steps=1,
              ul_lr=5e-3, ul_kl_weight=1.0, ul_select=1, ul_select_tokens=12, ul_ppl_every=40, ul_word_bans=1,
              ul_val_permille=300, ul_val_prompts=3, ul_anneal_steps=2, ul_anneal_snapshots=2, ul_anneal_lr=1e-3,
              ul_select_phrase=0.5, ul_line_ngram=4)
    out = str(tmp_path / "ul")
    lines: list[str] = []
    m = run(TrainConfig(out=out, device="cpu", init=src, pack_dir=str(tmp_path / "pack"), **kw), log=lines.append)
    s = m["ul"]["selection"]
    assert [r["step"] for r in s["candidates"]] == [1, 3, 4, 5, 6] and all(h["kl"] >= 0 for h in m["ul"]["history"])
    assert m["ul"]["anneal"]["steps_done"] == 2
    assert all(set(r) >= {"val", "bench", "held_out"} and r["rep"] == r["val"]["repeated_line_frac_guarded"]
               + 0.5 * r["val"]["phrase_loop_line_frac"] for r in s["candidates"])
    # the validation files are out of the phase's text and are not held-out text
    val_line = next(x for x in lines if x.startswith("validation set"))
    assert int(val_line.split(": ")[1].split()[0]) > 0 and len(s["prompt_text"]["val"]) == 3
    cands = [sel.Candidate(r["step"], r["rep"], r["ppl_ratio"]) for r in s["candidates"]]
    chosen = sel.choose(cands, kw.get("ul_ppl_budget", 0.05))
    assert s["chosen_step"] == (chosen.step if chosen else None)
    packs = sorted(os.listdir(tmp_path / "pack"))
    assert packs == (["last.tar.part00"] if chosen and chosen.step != 6 else []) + ["model.tar.part00"]
    row = next(r for r in s["candidates"] if r["step"] == (chosen.step if chosen else 6))
    _, trunk, _ = load_checkpoint(out, "cpu")
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    eos = (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))
    again = sel.loop_figures(trunk, tok, {"bench": [tok.encode(p, add_special_tokens=False).ids
                                                    for p in sel.LOOP_PROMPTS]}, 12, eos)
    assert again["bench"] == row["bench"]


# ---- definition snippets (snippets.py) and the snippet fine-tune phase ---------------------------

_SNIP_SRC = """import os


@decorator(1,
           2)
@other
def f(x):
    \"\"\"Doc.

not indented in the string
\"\"\"
    return x  # trailing comment
# a comment after the block


class A(Base):
    x = 1

    def m(self):
        def inner():
            pass
        return inner

    class B:
        y = 2
if True:
    def g(): return 1
async def h(): await z
"""


def test_definition_blocks_cut_exact_ends():
    from specfire.train.snippets import corpus_blocks, definition_blocks, import_header

    top = definition_blocks(_SNIP_SRC)
    assert top == ['@decorator(1,\n           2)\n@other\ndef f(x):\n    """Doc.\n\nnot indented in the string\n"""\n'
                   '    return x  # trailing comment\n',
                   "class A(Base):\n    x = 1\n\n    def m(self):\n        def inner():\n            pass\n"
                   "        return inner\n\n    class B:\n        y = 2\n",
                   "async def h(): await z\n"]
    nested = definition_blocks(_SNIP_SRC, nested=True)
    # methods, nested defs and the def under `if` come dedented; f's docstring holds a line indented less
    # than nothing, so f is only taken at the top level
    assert nested == [top[0], top[1], "def m(self):\n    def inner():\n        pass\n    return inner\n",
                      "def inner():\n    pass\n", "class B:\n    y = 2\n", "def g(): return 1\n", top[2]]
    assert definition_blocks(_SNIP_SRC.replace("\n", "\r\n")) == top          # CRLF text
    assert definition_blocks("def broken(:\n    pass\n") == []                 # does not parse
    assert definition_blocks("") == [] and definition_blocks("x = 1\n") == []
    assert definition_blocks("def last(): return 0") == ["def last(): return 0\n"]   # no final newline
    assert definition_blocks("class T:\n\tdef m(self):\n\t\treturn 1\n", nested=True)[1] == "def m(self):\n\treturn 1\n"
    # a method whose multi-line string has a line indented less than the method is not dedented
    odd = 'class C:\n    def m(self):\n        s = """\nflush left\n"""\n        return s\n'
    assert definition_blocks(odd, nested=True) == [odd]
    # a snippet after its file's imports, and the same blocks from a process pool
    assert import_header(_SNIP_SRC) == "import os\n" and import_header("def f(): pass\nimport x\n") == ""
    docs = [("m.py", _SNIP_SRC)] * 70
    one = corpus_blocks(docs, nested=True, import_frac=0.5, seed=3)
    assert one == corpus_blocks(docs, nested=True, import_frac=0.5, seed=3, workers=2)
    assert {b for b in one if b.startswith("import")} <= {"import os\n\n\n" + b for b in top}
    assert 0 < sum(b.startswith("import") for b in one) < 3 * 70
    assert corpus_blocks(docs[:1], max_chars=30) == [top[2]]


def test_snippet_rows_start_at_a_definition_and_end_with_end_of_text(tiny_trained):
    from tokenizers import Tokenizer

    from specfire.train.snippets import SnippetRows, definition_prompts

    tok = Tokenizer.from_file(os.path.join(tiny_trained[0], "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    blocks = ["def a(x):\n    return x\n", "class K:\n    pass\n", "def long():\n" + "    y = 1\n" * 200]
    rows = SnippetRows(tok, blocks, eot, 48, seed=0, blank_frac=0.5)
    assert len(rows.seqs) == 2                              # the block that cannot end in a row is dropped
    texts = {tok.decode(s[:-1]) for s in rows.seqs}
    assert all(s[-1] == eot for s in rows.seqs) and texts <= {b + e for b in blocks[:2] for e in ("", "\n\n")}
    batch = rows.batch(5, "cpu")
    assert batch.shape == (5, 48)
    for r in batch.tolist():
        first = next(s for s in rows.seqs if r[:len(s)] == s)   # position 0 holds a whole block + end-of-text
        after = r[len(first):]
        assert any(after[:len(s)] == s[:len(after)] for s in rows.seqs)   # then a block after the separator
    prompts = definition_prompts([("m.py", _SNIP_SRC)], 5, 0, tok, max_lines=2)
    assert prompts and all(tok.decode(p).startswith(("@", "def", "class", "async")) and tok.decode(p).endswith("\n")
                           for p in prompts)


def test_snippet_phase_from_a_checkpoint(tiny_trained, tmp_path):
    """`init` + the snippet phase in two arms (mixes) with the rule on top-level validation prompts: each
    arm runs its steps on mixed batches from the same start and scores its snapshots; the rule's pick
    over both arms is exported (the other arm's as alt.tar), and greedy MTP == AR on it."""
    from tokenizers import Tokenizer

    from specfire.train import select as sel
    from specfire.train.export import load_checkpoint

    src, kw, _ = tiny_trained
    kw = dict(kw, snip_steps=4, snip_rows=2, snip_data_rows=2, snip_rows2=3, snip_snapshots=2, snip_lr=5e-3,
              snip_warmup=1, snip_import_frac=0.5, ul_select=1, ul_select_tokens=12, ul_ppl_every=40,
              ul_val_permille=300, ul_val_prompts=3, ul_eval_prompts=2, ul_eval_prompt_tokens=6,
              ul_select_phrase=2.0, ul_ppl_budget=0.5)
    out = str(tmp_path / "snip")
    m = run(TrainConfig(out=out, device="cpu", init=src, pack_dir=str(tmp_path / "pack"), **kw),
            log=lambda *_: None)
    arms = m["snip"]["arms"]
    assert [a["rows"] for a in arms] == [{"snippet": 2, "corpus": 2}, {"snippet": 3, "corpus": 1}]
    for ph in arms:
        assert ph["steps_done"] == 4 and ph["snippets"]["blocks"] > 0
        h = ph["history"][0]
        assert h["step"] == 0 and math.isfinite(h["nll_end_of_text"]) and h["lm_snippets"] > 0
        assert [r["step"] for r in ph["selection"]["candidates"]] == [1, 3, 4]
        assert all(p.startswith(("@", "def", "class", "async")) for p in ph["selection"]["prompt_text"]["val"])
    same = [{k: v for k, v in a["repetition_before"].items() if k != "seconds"} for a in arms]
    assert same[0] == same[1]                                                  # the same start
    picks = [(sel.Candidate(r["step"], r["rep"], r["ppl_ratio"]), i) for i, ph in enumerate(arms)
             for r in ph["selection"]["candidates"] if r["step"] == ph["selection"]["chosen_step"]]
    best = sel.choose([c for c, _ in picks], 0.5)
    win = m["snip"]["chosen_arm"]
    assert best is not None and next(i for c, i in picks if c is best) == win
    assert sorted(os.listdir(tmp_path / "pack")) == ["alt.tar.part00", "model.tar.part00"]
    # the exported weights are the winning arm's pick: its greedy figures on the bench prompts
    row = next(r for r in arms[win]["selection"]["candidates"] if r["step"] == best.step)
    _, trunk, _ = load_checkpoint(out, "cpu")
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    eos = (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))
    again = sel.loop_figures(trunk, tok, {"bench": [tok.encode(p, add_special_tokens=False).ids
                                                    for p in sel.LOOP_PROMPTS]}, 12, eos)
    assert again["bench"] == row["bench"]
    with LLM(out, device="cpu", progress=False) as llm:
        sp = SamplingParams(max_tokens=10, ignore_eos=True)
        assert (llm.generate("def f(x):", sp, spec="off").token_ids
                == llm.generate("def f(x):", sp, spec={"mode": "mtp", "k": 3}).token_ids)


def test_train_cli_rejects_bad_init(tmp_path):
    import argparse

    from specfire.train.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu"]))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="fine-tune phase"):
        config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu",
                                       "--preset", "bundled"]))
    with pytest.raises(ValueError, match="needs init"):
        config_from_args(p.parse_args(["--out", str(tmp_path), "--device", "cpu", "--preset", "bundled-snip"]))
    with pytest.raises(ValueError, match="snip_blank_frac"):
        config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu",
                                       "--preset", "bundled-snip", "--snip-blank-frac", "1.5"]))
    with pytest.raises(ValueError, match="snip_rows2"):
        config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu",
                                       "--preset", "bundled-snip", "--snip-rows2", "64"]))
    tc = config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu",
                                        "--preset", "bundled-snip", "--snip-time-s", "30"]))
    assert tc.snip_steps > 0 and tc.snip_time_s == 30.0 and tc.ul_select == 1 and tc.ul_ppl_budget == 0.03
    tc = config_from_args(p.parse_args(["--out", str(tmp_path), "--init", str(tmp_path), "--device", "cpu",
                                        "--preset", "bundled-ul", "--ul-time-s", "30"]))
    assert tc.init == str(tmp_path) and tc.ul_steps > 0 and tc.ul_time_s == 30.0


# ---- the site corpus: licences, deduplication, held-out packages, transfer packing ---------------

def _meta(**fields):
    from email.message import Message

    m = Message()
    for k, v in fields.items():
        for item in (v if isinstance(v, list) else [v]):
            m[k.replace("_", "-")] = item
    return m


def test_spdx_expressions():
    from specfire.train.licences import spdx_permissive

    assert spdx_permissive("MIT") and spdx_permissive("Apache-2.0 OR BSD-2-Clause")
    assert spdx_permissive("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-3-Clause")
    assert spdx_permissive("(MIT OR GPL-3.0-only) AND BSD-3-Clause")
    assert not spdx_permissive("MPL-2.0 AND MIT") and not spdx_permissive("GPL-2.0-or-later")
    assert not spdx_permissive("LicenseRef-NVIDIA-Proprietary") and not spdx_permissive("MIT AND (")
    assert not spdx_permissive("GPL-2.0 WITH Classpath-exception-2.0")


def test_licence_classification_reads_every_metadata_source():
    from specfire.train.licences import classify

    assert classify(_meta(License_Expression="BSD-3-Clause")).permissive
    assert not classify(_meta(License_Expression="MPL-2.0")).permissive
    assert classify(_meta(License="Apache 2.0 License")).name == "Apache-2.0"
    assert classify(_meta(License="BSD 3-Clause License\n\nCopyright (c) someone\nRedistribution ...")).permissive
    bsd = "License :: OSI Approved :: BSD License"
    gpl = "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"
    assert classify(_meta(Classifier=[bsd])).permissive
    assert not classify(_meta(Classifier=[bsd, gpl])).permissive          # which one applies is unknown
    assert not classify(_meta(License="MIT", Classifier=[gpl])).permissive
    assert not classify(_meta(License="LGPL")).permissive
    assert not classify(_meta()).permissive                                # nothing known: refused
    mit_text = "Permission is hereby granted, free of charge, to any person obtaining a copy"
    assert classify(_meta(), [mit_text]).name == "MIT"


def test_deduper_drops_exact_and_near_copies():
    from specfire.train.sources import Deduper

    body = "".join(f"    value_{i} = compute_something(argument_{i}, {i})\n" for i in range(30))
    d = Deduper()
    assert d.seen("def a():\n" + body) == ""
    assert d.seen("def a():\n" + body + "\n\n") == "exact_dup"
    renamed = "def b():\n" + body.replace("value_3 ", "other_3 ").replace("value_7 ", "other_7 ")
    assert d.seen(renamed) == "near_dup"
    fresh = "".join(f"    total_{i} += weights[{i}] * inputs[{i}]\n" for i in range(30))
    assert d.seen("def c():\n" + fresh) == ""


def test_site_corpus_holds_out_whole_packages_and_refuses_unknown_licences():
    from specfire.train.corpus import build_site_corpus
    from specfire.train.sources import distributions

    held = ("jinja2", "packaging")
    c = build_site_corpus(held, max_files=3)
    by_name = {p.name: p for p in c.packages}
    train_pkgs = {r.split("/")[0] for r, _ in c.train if "/" in r}
    for name in held:
        if name in by_name:
            assert by_name[name].role == "held_out" and name not in train_pkgs
            assert any(r.startswith(name + "/") for r, _ in c.held_out)
    refused = {p.name for p, _ in distributions() if not p.permissive}
    assert not (train_pkgs & refused)
    assert c.held_out_stdlib and all(by_name[p].permissive for p in train_pkgs if p in by_name)
    assert by_name["python-stdlib"].licence == "PSF-2.0" and by_name["python-stdlib"].files > 0


def test_pack_splits_and_rejoins(tmp_path):
    import tarfile

    from specfire.train.evaluate import pack

    src = tmp_path / "ck"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2500))
    (src / "b.txt").write_text("hello")
    parts = pack(str(src), str(tmp_path / "out"), part_bytes=1000)
    assert len(parts) >= 3 and all(os.path.getsize(p) <= 1000 for p in parts)
    joined = tmp_path / "j.tar"
    joined.write_bytes(b"".join(open(p, "rb").read() for p in parts))
    with tarfile.open(joined) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    assert (tmp_path / "x" / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


def test_loop_bench_cut_at_block_end():
    """bench/bundled_loops.py --cut-block-end: a completion is cut before the next top-level statement
    (the same `def` again), not at closing brackets or quotes, and counts as ended there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bundled_loops", os.path.join(REPO, "bench", "bundled_loops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return type("E", (), {"ids": list(range(len(text.split())))})()

    text = "    x = f(\n)\n    return x\n\n\ndef g(a):\n    return x\n"
    got = mod.cut_block_end({"prompt": "def g(a):\n", "text": text, "ids": [1] * 20, "finish": "length"}, Tok())
    assert got["text"] == "    x = f(\n)\n    return x\n" and got["finish"] == "stop" and got["ids"] == list(range(6))
    same = {"prompt": "p", "text": "    a\n    b", "ids": [1], "finish": "length"}
    assert mod.cut_block_end(same, Tok()) == same


def test_training_and_inference_compute_gated_deltanet_alike(tiny_llm, monkeypatch):
    """One formulation: the training forward, the rollout step and the inference layer (its
    reference form) take the conv window, gates and q / k norms from kernels/gdn/ref.py, and the
    training forward's layer output equals the inference layer's prefill of the same rows."""
    from specfire.kernels import gdn
    from specfire.kernels.gdn import ref
    from specfire.layers import CUDA, GatedDeltaNet
    from specfire.model.state import SequenceState
    from specfire.train.rollout import _State, step_logits

    trunk = tiny_llm.engine.trunk.model
    m = next(layer.linear_attn for layer in trunk.layers if layer.kind != "full_attention")
    calls: dict[str, int] = {}
    for name in ("conv_window_ref", "gates_ref", "l2norm_ref"):
        real = getattr(ref, name)
        spy = lambda *a, _r=real, _n=name, **k: calls.__setitem__(_n, calls.get(_n, 0) + 1) or _r(*a, **k)  # noqa: E731
        for mod in (ref, gdn):                            # the family re-exports its references
            monkeypatch.setattr(mod, name, spy)

    def used() -> set[str]:
        got = set(calls)
        calls.clear()
        return got

    ids = torch.randint(0, trunk.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    want = {"conv_window_ref", "gates_ref", "l2norm_ref"}
    with torch.no_grad():
        tm.trunk_hidden(trunk, ids)
        assert used() == want
        step_logits(trunk, ids[:, 0], 0, _State(trunk, 1, 4, ids.device))
        assert used() == want
        layer = GatedDeltaNet(trunk.cfg, CUDA)            # the reference form (CPU tensors: the references)
        layer.load_state_dict(m.state_dict())
        x = torch.randn(1, 12, trunk.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
        st = SequenceState.allocate(trunk.cfg, ("linear_attention",), 16, torch.device("cpu"), torch.float32)
        got = layer(x[0], st.layers[0], rows=False)
        assert used() == want
        torch.testing.assert_close(got, tm._gdn(m, x, 64)[0], rtol=1e-5, atol=1e-6)
