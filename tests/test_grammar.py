"""specfire.grammar on the tiny byte-level tokenizer: request fields to grammars, masks that keep
decoding inside the grammar, advance over drafts and roll back to the accepted prefix."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from specfire.grammar import GrammarCompiler, GrammarError, GrammarSpec, spec_from_fields

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["name", "n", "ok", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, [tok.tok.token_to_id("<|im_end|>")])


def sample(compiler, spec, rnd, limit=200):
    """Random decoding inside the mask until the grammar allows only EOS; the text."""
    m = compiler.matcher(spec)
    eos = compiler.eos_ids[0]
    ids = []
    for _ in range(limit):
        allowed = np.nonzero(m.allowed())[0].tolist()
        assert allowed
        if m.is_done():
            assert allowed == [eos]
            break
        choices = [t for t in allowed if t != eos] or allowed
        t = rnd.choice(choices)
        assert m.advance([t]) == 1
        ids.append(t)
    assert m.is_accepting()
    return compiler.tokenizer.decode(ids)


def test_json_schema_output_validates(compiler):
    rnd = random.Random(11)
    for _ in range(5):
        v = json.loads(sample(compiler, GrammarSpec("json_schema", SCHEMA), rnd))
        assert set(v) == {"name", "n", "ok", "kind"} and isinstance(v["name"], str) and len(v["name"]) <= 12
        assert type(v["n"]) is int and type(v["ok"]) is bool and v["kind"] in ("a", "b")


def test_json_object_regex_choice(compiler):
    rnd = random.Random(5)
    obj = compiler.tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}')
    m = compiler.matcher(GrammarSpec("json_object"))
    assert m.advance(obj) == len(obj) and m.is_accepting()
    assert compiler.matcher(GrammarSpec("json_object")).advance(compiler.tokenizer.encode("[1]")) == 0
    for _ in range(5):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]", sample(compiler, GrammarSpec("regex", r"[a-c]{2,5}-[0-9]"), rnd))
        assert sample(compiler, GrammarSpec("choice", ["yes", "no", "maybe"]), rnd) in ("yes", "no", "maybe")


def test_advance_stops_at_the_first_forbidden_draft_and_rolls_back(compiler, tok):
    m = compiler.matcher(GrammarSpec("json_schema", SCHEMA))
    start = m.allowed()
    good = tok.encode('{"name": "x", "n": 1')
    bad = tok.encode("zzz")
    assert m.advance(good + bad) == len(good)
    after = m.allowed()
    m.rollback(len(good))
    assert (m.allowed() == start).all()
    assert m.advance(good[:3]) == 3 and m.advance(good[3:]) == len(good) - 3
    assert (m.allowed() == after).all()


@pytest.mark.parametrize("held", [0, 0x5A5A5A5A])
def test_verify_masks_allow_every_token_after_a_forbidden_draft(compiler, tok, held):
    """A verify's rows past its first forbidden draft allow everything, whatever the buffer held
    before (zeros at first, an earlier step's masks later): a row masking every id would have no
    target in the vocabulary."""
    m = compiler.matcher(GrammarSpec("json_schema", SCHEMA))
    good, bad = tok.encode('{"name')[:2], tok.encode("zzz")[0]
    one = m.new_bitmask()
    for drafts, fresh in ((good + [bad, bad], len(good) + 1), ([bad, bad, bad], 1), (good, len(good) + 1)):
        into = torch.full((6, m.words), held, dtype=torch.int32)
        m.masks(into, drafts)
        for i in range(fresh):                       # row i: the mask after drafts[:i]
            m.advance(drafts[:i])
            m.mask(one)
            m.rollback(i)
            assert (into[i].numpy() == one).all(), (drafts, i)
        assert (into[fresh:len(drafts) + 1] == -1).all(), drafts
        assert (into[len(drafts) + 1:] == held).all()     # rows past the verify's are left alone
    assert (m.allowed() == compiler.matcher(GrammarSpec("json_schema", SCHEMA)).allowed()).all()


def test_mask_into_numpy_and_torch_agree(compiler):
    m = compiler.matcher(GrammarSpec("choice", ["alpha", "beta"]))
    a = m.new_bitmask()
    t = torch.zeros(m.words, dtype=torch.int32)
    m.mask(a)
    m.mask(t)
    assert (a == t.numpy()).all()
    bits = m.allowed()
    assert bits.sum() >= 2 and all(bool((int(a[i // 32]) >> (i % 32)) & 1) == bits[i] for i in range(len(bits)))
    with pytest.raises(ValueError, match="bytes"):
        m.mask(np.zeros(m.words + 1, dtype=np.int32))


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice"),
])
def test_fields_to_spec(fields, kind, param):
    spec = spec_from_fields(**fields)
    assert spec is not None and (spec.kind, spec.param) == (kind, param)


def test_no_constraint():
    assert spec_from_fields() is None and spec_from_fields(response_format={"type": "text"}) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": "json"}, "structured_outputs"),
])
def test_bad_fields_name_the_field(fields, param):
    with pytest.raises(GrammarError) as e:
        spec_from_fields(**fields)
    assert e.value.param == param


def test_uncompilable_schema_names_the_field(compiler):
    with pytest.raises(GrammarError, match="guided_json") as e:
        compiler.matcher(GrammarSpec("json_schema", {"type": "nope"}, "guided_json"))
    assert e.value.param == "guided_json"


@pytest.mark.parametrize("text, ok", [
    ('<think>\nhm, </think\n</think>\n\n{"name": "a", "n": 1, "ok": true, "kind": "b"}', True),
    ('{"name": "a", "n": 1, "ok": true, "kind": "b"}', True),
    ('<think>\nhm\n</think>\n\n{"name": "a", "n": 1, "ok": true, "kind": "c"}', False),
    ('<think>\nhm\n</think> x </think>\n{"name": "a", "n": 1, "ok": true, "kind": "b"}', False),
])
def test_an_optional_think_block_in_text(compiler, text, ok):
    """A vocabulary without think tokens: the tags are text, and the block's text ends at the first
    `</think>`; the schema after it holds as without the block."""
    assert compiler.tokenizer.tok.token_to_id("</think>") is None
    m = compiler.matcher(GrammarSpec("json_schema", SCHEMA, "guided_json", think=True))
    ids = compiler.tokenizer.encode(text)
    assert (m.advance(ids) == len(ids) and m.is_accepting()) is ok


def test_think_and_after_exclude_each_other():
    with pytest.raises(GrammarError, match="not both") as e:
        GrammarSpec("regex", "a", "guided_regex", after="</think>", think=True)
    assert e.value.param == "guided_regex"
