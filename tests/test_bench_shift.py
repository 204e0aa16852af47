"""bench shift: scoring helpers exactly, and one small run end to end on SmolLM2."""

from __future__ import annotations

import json

from click.testing import CliRunner

from snapkv_sessions.bench.shift import (
    CONDITIONS,
    calibrate_threshold,
    condition_policy,
    detector_quality,
    is_correct,
    is_degenerate,
    make_scenario,
)
from snapkv_sessions.cli import main


def test_scenario_is_deterministic_and_labelled():
    a, b = make_scenario(3), make_scenario(3)
    assert a == b and a != make_scenario(4)
    assert [t.label for t in a.turns] == ["first", "follow", "shift", "follow", "shift", "follow", "shift", "follow",
                                          "shift", "follow"]
    line = a.turns[6].expect[0]
    assert line in a.document.splitlines()  # the copy turn expects a real directory line
    assert a.document.splitlines()[1].startswith("RULE:")


def test_scoring_helpers():
    assert is_correct("The office is  c-155.", ["C-155"]) and not is_correct("B-155", ["C-155"])
    assert is_degenerate([5, 6] * 10, "length") and not is_degenerate([5, 6] * 10, "eos")
    assert not is_degenerate(list(range(20)), "length")
    rows = [{"label": lab, "decision": dec} for lab, dec in
            [("first", "n/a"), ("follow", "kept"), ("shift", "reprefill"), ("follow", "reprefill"),
             ("shift", "kept"), ("shift", "reprefill")]]
    rows[2].update(embedding_drift=0.8, threshold=0.7, new_terms=["Ada"])
    rows[5].update(missing_terms=["1010"], new_terms=["1010"])
    assert detector_quality(rows) == {"labelled_turns": 5, "tp": 2, "fp": 1, "fn": 1, "precision": 0.667,
                                      "recall": 0.667,
                                      "caught_by": {"embedding": 1, "evidence": 1, "new_subject": 2}}


def test_condition_policies():
    full = condition_policy("a_full", 0.3, 16)
    assert full.compression.budget == 32768 and full.drift.embedder == "none"
    every = condition_policy("d_every_turn", 0.3, 16)
    assert every.compression.budget_ratio == 0.3 and every.drift.threshold == 0.0
    assert set(CONDITIONS) == {"a_full", "b_snapkv", "c_drift", "d_every_turn", "e_tiered", "f_tiered_keep_reply"}


def test_bench_shift_runs_on_smollm2(smollm2):
    res = CliRunner().invoke(main, ["bench", "shift", "--model", "smollm2-135m-instruct", "--sessions", "1",
                                    "--ratio", "0.3", "--calibration", "4", "--window", "16", "--max-new-tokens", "6",
                                    "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["budget_ratio"] == 0.3 and set(out["conditions"]) == set(CONDITIONS)
    assert all(len(rows) == 10 for rows in out["turns"].values())
    assert out["conditions"]["a_full"]["reprefills"] == 0 and out["conditions"]["b_snapkv"]["reprefills"] == 0
    # re-prefill every turn: every turn after the first re-prefills once something was evicted
    assert out["conditions"]["d_every_turn"]["reprefills"] == 9
    # the tiered memory serves every turn without one, and its turns record the hot and cold bytes
    assert out["conditions"]["e_tiered"]["reprefills"] == 0
    assert all(r["tier"]["cold_bytes"] > 0 for r in out["turns"]["e_tiered"])
    assert out["conditions"]["d_every_turn"]["agreement_with_every_turn"] == 1.0
    assert out["detector"]["labelled_turns"] == 9
    assert out["threshold_calibration"] == calibrate_threshold(range(1000, 1004))
    assert out["drift_threshold"] == out["threshold_calibration"]["threshold"]


def test_auc_and_second_signal():
    from snapkv_sessions.bench.shift import auc, second_signal

    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.5, 0.5], [True, False]) == 0.5 and auc([1.0], [True]) is None
    b = [{"label": "first", "history_attention": None}, {"label": "follow", "history_attention": 0.6},
         {"label": "shift", "history_attention": 0.2}, {"label": "shift", "history_attention": 0.5}]
    c = [{"label": "first", "decision": "n/a", "drift": None}, {"label": "follow", "decision": "kept", "drift": 0.1},
         {"label": "shift", "decision": "reprefill", "drift": 0.9}, {"label": "shift", "decision": "kept", "drift": 0.3}]
    out = second_signal(b, c)
    assert out["turns"] == 3 and out["auc_history_attention"] == 1.0 and out["auc_detector_score"] == 1.0
    assert out["detector_f1"] == 0.667
    assert out["best_combined_with_attention"] == {"cut": 0.5, "f1": 1.0, "tp": 2, "fp": 0, "fn": 0}


def test_calibrated_threshold_separates_heldout_scenarios():
    """The threshold chosen on seeds 1000+ gives the text-side detector perfect labels on seeds 0-5."""
    from snapkv_sessions.bench.shift import detect
    from snapkv_sessions.drift import make_embedder

    calib = calibrate_threshold(range(1000, 1010))
    assert calib["best_f1"] == 1.0 and calib["best_range"][0] <= calib["threshold"] <= calib["best_range"][1]
    emb = make_embedder("minilm")
    for seed in range(6):
        sc = make_scenario(seed)
        flags = detect(sc, emb.embed([t.question for t in sc.turns]), calib["threshold"])
        assert flags == [t.label == "shift" for t in sc.turns]
    # at the default threshold, without the new-subject signal, "the office of another employee" is missed by the
    # embedding alone (it sits 0.56 from the working set)
    sc = make_scenario(0)
    flags = detect(sc, emb.embed([t.question for t in sc.turns]), 0.75, subjects=False)
    assert flags[2] is False and sc.turns[2].label == "shift"
