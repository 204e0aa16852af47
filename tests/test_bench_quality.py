"""bench quality and knee: item construction exactly, and a small end-to-end run of each on SmolLM2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from snapkv_sessions.bench.quality import RULE, copy_score, items, method_policy, rule_followed
from snapkv_sessions.cli import main


def test_items_place_the_rule_in_each_role():
    built = items(2)
    assert len(built) == 2 * 8
    rules = [i for i in built[:8] if i["task"] == "rule"]
    assert [i["split"] for i in rules] == ["system", "developer", "tool_schema", "user", "document"]
    assert rules[0]["setup"][0] == {"role": "system", "content": RULE}
    assert rules[3]["turns"][0][0].startswith(RULE)
    assert rules[4]["setup"][0]["content"].startswith(RULE + "\nSTAFF DIRECTORY")
    assert [i["task"] for i in built[:4]] == ["lookup", "copy", "switch", "rule"]
    copy_item = built[1]
    assert copy_item["turns"][0][1][0] in copy_item["setup"][0]["content"].splitlines()


def test_scoring_rule_and_copy():
    assert rule_followed('{"answer": "B-12"}') and rule_followed('```json\n{"answer": "B-12"}\n```')
    assert not rule_followed("B-12") and not rule_followed('["answer"]') and not rule_followed('{"office": 1}')
    line = "Ada Moreau: office B-12, department Legal."
    assert copy_score(line, line) == 1.0 and copy_score("Sure: " + line, line) == 1.0
    assert copy_score("Ada Moreau: office B-12", line) == 0.5  # 3 of 6 words: "B-12" lacks its comma
    assert copy_score("", line) == 0.0 and copy_score("legal. department", line) == 1 / 6


def test_method_policies():
    assert method_policy("streaming", 0.3, 16).compression.method == "streaming"
    assert method_policy("snapkv", 0.3, 16).pins.roles == ()
    assert method_policy("session", 0.3, 16).pins.roles == ("system", "developer", "tool_schema")
    assert method_policy("full", 0.3, 16).compression.budget == 32768
    # the tiered method is the session with the tier; every other method runs without it
    assert method_policy("tiered", 0.3, 16).tiered and not method_policy("session", 0.3, 16).tiered
    assert method_policy("tiered", 0.3, 16).pins == method_policy("session", 0.3, 16).pins
    # AdaKV: the snapkv method's and the tiered session's budgets, shared among heads by Ada-KV
    assert method_policy("adakv", 0.3, 16).compression.allocator == "adakv"
    assert method_policy("adakv", 0.3, 16).pins == method_policy("snapkv", 0.3, 16).pins
    tiered_adakv = method_policy("tier-adakv", 0.3, 16)
    assert tiered_adakv.tiered and tiered_adakv.compression.allocator == "adakv"
    assert tiered_adakv.pins == method_policy("tiered", 0.3, 16).pins
    every = method_policy("every", 0.3, 16)  # re-prefill every turn: every drift score crosses the threshold
    assert every.drift.threshold == 0.0 and every.recovery.min_turns_between == 0 and not every.tiered


def test_quality_and_knee_small_runs(smollm2, tmp_path):
    res = CliRunner().invoke(main, ["bench", "quality", "--model", "smollm2-135m-instruct", "--items", "1",
                                    "--window", "16", "--max-new-tokens", "4", "--records", "8", "--json",
                                    "--plot", str(tmp_path / "quality.png")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["items"] == 8
    assert set(out["summary"]) == {"full", "session", "tiered", "every", "streaming", "snapkv", "adakv",
                                   "tier-adakv", "tier-recall"}
    assert out["summary"]["every"]["agreement_with_every_turn"] == 1.0
    assert out["summary"]["every"]["reprefills"] == 1  # the second turn of the one switch item; the rest are single-turn

    assert set(out["summary"]["full"]["by_task_split"]) == {"lookup/document", "copy/document", "switch/document",
                                                            *(f"rule/{r}" for r in ("system", "developer",
                                                                                     "tool_schema", "user",
                                                                                     "document"))}
    copies = [r for r in out["rows"]["full"] if r["task"] == "copy"]
    assert len(copies) == 1 and 0.0 <= copies[0]["copy_score"] <= 1.0
    assert (tmp_path / "quality.png").stat().st_size > 10_000
    png = tmp_path / "knee.png"
    res = CliRunner().invoke(main, ["bench", "knee", "--model", "smollm2-135m-instruct", "--items", "2",
                                    "--budgets", "0.1,0.5", "--window", "16", "--max-new-tokens", "4", "--lengths", "300",
                                    "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["rows"]) == 4 * 2 * 7  # 4 tasks x 2 items x (full + 2 budgets x 3 selections)
    assert set(out["cells"]) == {f"{t}@300/{s}" for t in ("lookup", "multihop", "copy", "rule")
                                 for s in ("snapkv", "lines", "adakv")}
    for cell in out["cells"].values():  # B* is a budget within 2 points of the full cache's accuracy, or None
        star = cell["b_star"]
        assert star is None or cell["accuracy"][str(star)] >= cell["full"] - 0.02
    assert all(r["same_as_full"] for r in out["rows"] if r["variant"] == "full")
    assert png.stat().st_size > 10_000


def test_b_star_and_its_interval():
    from snapkv_sessions.bench.knee import b_star, knee_cell

    budgets = [0.1, 0.5, 0.9]
    assert b_star({0.1: 0.5, 0.5: 0.99, 0.9: 1.0}, 1.0, budgets) == 0.5
    assert b_star({0.1: 0.0, 0.5: 0.0, 0.9: 0.0}, 0.0, budgets) is None  # the full cache fails: no knee
    assert b_star({0.1: 0.5, 0.5: 0.5, 0.9: 0.5}, 1.0, budgets) is None
    # every item right from 0.5 up, wrong at 0.1: B* is 0.5 in every resample
    by = {(i, v): {"correct": v != "snapkv@0.1", "same_as_full": v != "snapkv@0.1"}
          for i in range(5) for v in ("full", "snapkv@0.1", "snapkv@0.5", "snapkv@0.9")}
    cell = knee_cell(by, list(range(5)), "snapkv", budgets, resamples=50)
    assert cell["b_star"] == 0.5 and cell["b_star_90ci"] == [0.5, 0.5]
    assert cell["agreement_with_full"] == {"0.1": 0.0, "0.5": 1.0, "0.9": 1.0}


def test_quality_methods_option_is_checked():
    res = CliRunner().invoke(main, ["bench", "quality", "--methods", "snapkv,nope"])
    assert res.exit_code == 2 and "nope" in res.output and "adakv" in res.output and "Traceback" not in res.output


def test_tier_recall_is_the_tiered_session_with_decode_recall():
    from snapkv_sessions.bench.quality import RECALL, method_policy
    from snapkv_sessions.config import RecallConfig

    tiered, recall = method_policy("tiered", 0.2, 16), method_policy("tier-recall", 0.2, 16)
    assert recall.tiered and recall.memory.recall == RecallConfig.make(**RECALL)
    assert tiered.memory.recall is None
    assert recall.compression == tiered.compression and recall.pins == tiered.pins and recall.drift == tiered.drift


def test_a_tiered_method_takes_a_recall_spec_and_others_refuse_it():
    from snapkv_sessions.bench.quality import method_policy
    from snapkv_sessions.config import RecallConfig

    spec = method_policy("tiered+r0.1:lowrank+mass+tail32+esc1", 0.2, 16)
    assert spec.memory.recall == RecallConfig.make(ratio=0.1, selector="lowrank", reduce="mass", tail="pages",
                                                   tail_page=32, escalate=1.0)
    assert spec.compression == method_policy("tiered", 0.2, 16).compression
    assert method_policy("tier-adakv+r0.05", 0.2, 16).memory.recall == RecallConfig.make(ratio=0.05)
    with pytest.raises(ValueError, match="tiered method"):
        method_policy("snapkv+r0.1", 0.2, 16)
    for bad, says in (("tiered+r0.1:nope", "nope"), ("snapkv+r0.1", "tiered method"), ("tiered+r2", "ratio")):
        res = CliRunner().invoke(main, ["bench", "quality", "--methods", f"full,{bad}"])
        assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output, res.output
