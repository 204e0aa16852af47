"""``bench recall``: its conditions, the summary's arithmetic, resuming a results file, and a small cost run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from snapkv_sessions.bench import recall as bench
from snapkv_sessions.cli import main


def test_conditions_cover_hot_alone_and_each_recall():
    conds = bench.conditions([0.1, 0.2], [0.05], ("exact", "pages"))
    assert list(conds) == ["full", "hot0.1", "hot0.1+exact0.05", "hot0.1+pages0.05", "hot0.2", "hot0.2+exact0.05",
                           "hot0.2+pages0.05"]
    policy = bench.policy_for("hot0.2+pages0.05", conds["hot0.2+pages0.05"])
    assert policy.tiered and policy.memory.recall.selector == "pages" and policy.memory.recall.ratio == 0.05
    assert not bench.policy_for("full", conds["full"]).tiered


def _turn(tokens, correct=True, hot=100, cold=300, summary=0, recalled=None, repeat=None):
    return {"tokens": tokens, "correct": correct, "context": 400, "hot_bytes": hot, "cold_bytes": cold,
            "summary_bytes": summary, "recalled_per_step": recalled, "repeat_rate": repeat, "read_per_step": None}


def test_summary_compares_each_turn_with_the_full_cache():
    rows = [{"seed": 1, "condition": "full", "turns": [_turn([1, 2]), _turn([3])]},
            {"seed": 1, "condition": "hot0.2", "turns": [_turn([1, 2]), _turn([4], correct=False)]},
            {"seed": 1, "condition": "hot0.2+exact0.1", "turns": [_turn([1, 2], summary=0, recalled=8.0, repeat=0.5),
                                                                  _turn([3], summary=40, recalled=6.0, repeat=0.7)]}]
    out = bench.summarise(rows, ["full", "hot0.2", "hot0.2+exact0.1"])
    assert out["full"]["equal_to_full"] == 1.0
    assert out["hot0.2"] == {"sessions": 1, "turns": 2, "accuracy": 0.5, "equal_to_full": 0.5,
                             "device_bytes_share": 0.25, "recalled_per_step": None, "repeat_rate": None}
    assert out["hot0.2+exact0.1"]["equal_to_full"] == 1.0
    assert out["hot0.2+exact0.1"]["device_bytes_share"] == round((0.25 + 140 / 400) / 2, 3)
    assert out["hot0.2+exact0.1"]["recalled_per_step"] == 7.0 and out["hot0.2+exact0.1"]["repeat_rate"] == 0.6


def test_a_rerun_resumes_from_the_results_file(tmp_path, monkeypatch):
    ran = []

    def fake_session(runner, scenario, policy, max_new_tokens):
        ran.append(policy.name)
        return [{"correct": True, "tokens": [1], "context": 10, "tier": None}]

    monkeypatch.setattr(bench, "run_session", fake_session)
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps({"seed": 500, "condition": "full", "minutes": 0.1,
                                   "turns": [bench._turn({"correct": True, "tokens": [1], "context": 10})]}) + "\n")
    summary = bench.run_quality(None, [500], [0.2], [0.1], 4, str(results), selectors=("exact",), log=lambda m: None)
    assert ran == ["hot0.2", "hot0.2+exact0.1"]  # "full" was in the file already
    assert len(results.read_text().splitlines()) == 3
    assert set(summary) == {"full", "hot0.2", "hot0.2+exact0.1"}
    ran.clear()
    bench.run_quality(None, [500], [0.2], [0.1], 4, str(results), selectors=("exact",), log=lambda m: None)
    assert ran == []  # everything is done


def test_bad_options_are_clean_errors():
    res = CliRunner().invoke(main, ["bench", "recall", "--selectors", "exact,nope", "--sessions", "0"])
    assert res.exit_code == 2 and "nope" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["bench", "recall", "--hots", "2", "--sessions", "0"])
    assert res.exit_code == 2 and "[0, 1]" in res.output


@pytest.mark.slow
def test_cost_run_side_by_side(smollm2):
    res = CliRunner().invoke(main, ["bench", "recall", "--model", "smollm2-135m-instruct", "--sessions", "0",
                                    "--cost-lengths", "200", "--steps", "2", "--rounds", "2", "--dtype", "float32",
                                    "--json"])
    assert res.exit_code == 0, res.output
    cells = json.loads(res.output)["cost"]["200"]["cells"]
    for cell in cells.values():  # the median of two rounds, each round's figure kept
        assert len(cell["tpot_rounds_ms"]) == 2
        assert cell["tpot_ms"] == pytest.approx(sum(cell["tpot_rounds_ms"]) / 2, abs=0.01)
    assert list(cells) == ["full", "hot0.2", "hot0.2+exact0.1", "hot0.2+sparq0.1", "hot0.2+pages0.1",
                           "hot0.2+lowrank0.1"]
    assert cells["full"]["read_vs_full"] == 1.0
    assert cells["hot0.2"]["read_vs_full"] < 0.5  # the hot cache alone reads its budget's bytes
    # exact and sparq score the cold keys themselves; pages keeps 2 / page of them
    assert 0 < cells["hot0.2+pages0.1"]["summary_bytes"] < cells["hot0.2+exact0.1"]["summary_bytes"]
    # lowrank keeps r / D of them (16 of SmolLM2's 64 channels) and r x D per head: under half at ~160 cold slots
    assert 0 < cells["hot0.2+lowrank0.1"]["summary_bytes"] < cells["hot0.2+exact0.1"]["summary_bytes"] / 2


@pytest.mark.slow
def test_selection_scores_each_choice_against_the_exact_top_k(smollm2):
    """exact's choice is the oracle's, so it holds the same share; every share is a share; every selector is
    scored on the same layer-steps."""
    res = CliRunner().invoke(main, ["bench", "recall", "--model", "smollm2-135m-instruct", "--sessions", "1",
                                    "--hots", "0.2", "--recalls", "0.1", "--cost-lengths", "", "--selection",
                                    "--page", "8", "--max-new-tokens", "4", "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    sel = json.loads(res.output)["selection"]
    assert set(sel) == {"oracle", "page_oracle8", "exact", "sparq", "pages8", "lowrank", "lowrank (after RoPE)"}
    assert sel["exact"]["mass"] == sel["oracle"]["mass"] and sel["exact"]["of_oracle"] == 1.0
    assert len({c["layer_steps"] for c in sel.values()}) == 1 and sel["oracle"]["layer_steps"] > 0
    assert all(0.0 < c["mass"] <= 1.0 for c in sel.values())


def test_selector_specs_name_their_options_and_bad_ones_are_refused():
    conds = bench.conditions([0.2], [0.1], ("exact", "exact+mass+layer", "lowrank+mass"))
    assert list(conds) == ["full", "hot0.2", "hot0.2+exact0.1", "hot0.2+exact0.1+mass+layer", "hot0.2+lowrank0.1+mass"]
    shared = bench.policy_for("x", conds["hot0.2+exact0.1+mass+layer"]).memory.recall
    assert (shared.selector, shared.reduce, shared.share, shared.ratio) == ("exact", "mass", "layer", 0.1)
    plain = bench.policy_for("x", conds["hot0.2+exact0.1"]).memory.recall
    assert (plain.reduce, plain.share, plain.tail) == ("max", "head", "drop")
    tail = bench.policy_for("x", bench.conditions([0.2], [0.1], ("lowrank+mass+tail16",))[
        "hot0.2+lowrank0.1+mass+tail16"]).memory.recall
    assert (tail.selector, tail.reduce, tail.tail, tail.tail_page) == ("lowrank", "mass", "pages", 16)
    for bad, said in (("exact+foo", "unknown option 'foo'"), ("pages+mass", "ranks pages"),
                      ("pages+tail", "ranks pages"), ("exact+tailx", "unknown option 'tailx'"),
                      ("exact+layer", "needs reduce: mass"), ("nope", "unknown selector")):
        out = CliRunner().invoke(main, ["bench", "recall", "--selectors", bad, "--sessions", "0", "--json"])
        assert out.exit_code == 2 and said in out.output and "Traceback" not in out.output, (bad, out.output)


def test_reply_start_finds_the_last_copy_of_the_reply_past_the_floor():
    from snapkv_sessions.bench.recall import _reply_start

    seq = [1, 2, 3, 9, 9, 4, 9, 9, 5]
    assert _reply_start(seq, [9, 9], 0) == 6  # the reply is the last copy
    assert _reply_start(seq, [9, 9, 5], 0) == 6
    assert _reply_start(seq, [9, 9, 4], 3) == 3
    with pytest.raises(ValueError):
        _reply_start(seq, [9, 9, 4], 4)  # not at or after the floor
