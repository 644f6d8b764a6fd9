"""bench/batch.py --smoke: c = 1 and 2 requests at once on the bundled model (CPU), each level's
verifies packed into shared forwards, mixed requests at once equal to each alone, one JSON line last and its file under --out; a long prompt joining running streams (--join)."""
import json
import sys

from bench import batch


def test_batch_smoke_packs_each_level(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["batch", "--smoke", "--join", "1", "--out", str(tmp_path)])
    assert batch.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "batch" and last["ok"] is True
    assert [len(c["equal"]) for c in last["exact"]] == [8] and all(last["exact"][0]["equal_reversed"])
    got = [(r["route"], r["c"]) for r in last["levels"]]
    assert got == [("off", 1), ("off", 2), ("mtp", 1), ("mtp", 2)]
    for r in last["levels"]:
        assert r["tokens"] == 8 * r["c"] and r["agg_tok_s"] > 0
        assert r["round_ms_median"] > 0 and r["prefill_s"] > 0          # decode rounds timed, prefills apart
        # rounds held several requests' verifies (one ends earlier where its drafts were accepted more)
        assert r["verifies_per_forward"] == 1.0 if r["c"] == 1 else r["verifies_per_forward"] > 1.5
    # a 48-token prompt joined the two streams: its prefill ran between their steps (gaps recorded)
    assert [j["prefill_piece"] for j in last["join"]] == [1024]     # one join at the default piece
    j = last["join"][0]
    assert j["c"] == 2 and j["join_tokens"] == 48 and j["gaps_during"] >= 1 and j["gap_ms_median_before"] > 0
    assert j["join_cached_tokens"] == 0
    assert json.loads((tmp_path / "batch.json").read_text())["levels"] == last["levels"]


def test_closed_loop_offers_requests_as_the_serving_clients_do(monkeypatch, capsys):
    """--requests 5: per level five requests of fresh prompts, at most c in flight; every one ran
    to its length, and with c = 2 two shared rounds."""
    from specfire.runtime import scheduler as sch

    submitted = []
    real = sch.Scheduler.submit
    monkeypatch.setattr(sch.Scheduler, "submit", lambda self, r: submitted.append(tuple(r.ids)) or real(self, r))
    monkeypatch.setattr(sys, "argv", ["batch", "--smoke", "--no-exact", "--requests", "5", "--spec", "off"])
    assert batch.main() == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["c"], r["tokens"]) for r in last["levels"]] == [(1, 40), (2, 40)]
    assert last["levels"][1]["verifies_per_forward"] > 1.3
    assert len(set(submitted[-5:])) == 5            # fresh prompts, none the warm-up's
