"""``bench ruler``: RULER's generators on a tiny tokenizer, RULER's scoring, the results file and the command."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("long_context_eval", reason="the ruler extra (nvidia-long-context-eval) is not installed")

from click.testing import CliRunner  # noqa: E402

from snapkv_sessions.bench import ruler  # noqa: E402
from snapkv_sessions.bench import ruler_data as rd  # noqa: E402
from snapkv_sessions.cli import main  # noqa: E402
from tests.conftest import build_tiny, word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def runner(tok):
    from snapkv_sessions.runner import ModelRunner

    return ModelRunner(build_tiny("llama"), tok)


def test_items_are_deterministic_with_the_answer_prefix_after_the_assistant_tag(tok):
    a, b = rd.generate("niah_single_2", tok, 2048, 3), rd.generate("niah_single_2", tok, 2048, 3)
    assert [(i.user, i.answer_prefix, i.outputs) for i in a] == [(i.user, i.answer_prefix, i.outputs) for i in b]
    assert len({i.user for i in a}) == 3  # three different items
    for item in a:
        prompt = rd.render(tok, item.user, item.answer_prefix)
        assert prompt.endswith("<|assistant|>\n" + item.answer_prefix)
        assert item.answer_prefix.startswith(" The special magic number for ")
        assert "provided text is" in item.answer_prefix and "provided text is" not in item.user
        assert item.outputs[0] in item.context and item.outputs[0] not in item.question
        assert item.question.startswith("\nWhat is the special magic number for ")


@pytest.mark.parametrize(("task", "length", "step"), [("niah_single_2", 2048, 700), ("vt", 1024, 250)])
def test_requested_length_is_respected(tok, task, length, step):
    """RULER's length: prompt tokens (as the model sees them) + the task's tokens to generate <= the request, and
    within one of the generator's increments (500 essay words, 10 noise lines) of it."""
    budget = rd.task_table()[task]["tokens_to_generate"]
    for item in rd.generate(task, tok, length, 2):
        n = len(rd.encode(tok, rd.render(tok, item.user, item.answer_prefix)))
        assert length - step <= n + budget <= length
        assert n + budget <= item.ruler_length <= length  # RULER's own count (vt counts its example apart)


def test_query_agnostic_split_feeds_the_same_tokens(tok):
    item = rd.generate("vt", tok, 1024, 1)[0]
    ctx, question = ruler.prompt_ids(tok, item)
    assert rd.encode(tok, rd.render(tok, item.user, item.answer_prefix)) == ctx + question
    assert item.question.startswith("\nQuestion: Find all variables")
    assert item.answer_prefix.startswith(" Answer: According to the chain(s)")


def test_scoring_is_rulers():
    # string_match_all: the share of references found (case-insensitive), 0-100; string_match_part: any of them
    assert rd.metric("niah_multivalue") == "string_match_all" and rd.metric("vt") == "string_match_all"
    assert rd.metric("qa_1") == "string_match_part" and rd.metric("qa_2") == "string_match_part"
    assert rd.score("niah_multivalue", " 123, 789 and 456", ["123", "456", "000", "999"]) == 50.0
    assert rd.score("vt", "VAR abcde, FGHIJ", ["ABCDE", "FGHIJ"]) == 100.0
    assert rd.score("vt", "", ["ABCDE"]) == 0.0
    assert rd.score("qa_1", "It is in france.", ["Paris", "France"]) == 100.0
    assert rd.score("qa_1", "Lyon", ["Paris", "France"]) == 0.0
    assert rd.score("string_match_all", "\x00 a b", ["a", "b", "c"]) == pytest.approx(200 / 3)
    from long_context_eval.eval.synthetic.constants import string_match_all, string_match_part

    preds, refs = ["x 1 2", "nothing", "Y"], [["1", "2", "3"], ["z"], ["y", "w"]]
    assert string_match_all(preds, refs) == round(sum(rd.score("string_match_all", p, r)
                                                      for p, r in zip(preds, refs, strict=True)) / 3, 2)
    assert string_match_part(preds, refs) == round(sum(rd.score("string_match_part", p, r)
                                                       for p, r in zip(preds, refs, strict=True)) / 3, 2)


def test_niah_extra_questions_ask_other_needles(tok):
    item = rd.generate("niah_multikey_1", tok, 2048, 1)[0]
    assert len(item.extra) == 2
    for question, values in item.extra:
        key = question.split(" for ")[1].split(" mentioned")[0]
        assert key not in item.question and all(f"for {key} is: {v}." in item.context for v in values)


def _run(runner, path, **kw):
    args = {"tasks": ["vt"], "lengths": [1024], "n": 2, "budgets": [0.5], "settings": ["query-aware"],
            "methods": ["snapkv"], "window": 8, "max_new_tokens": 3, "results": str(path), "dtype": "float32"}
    return ruler.run(runner, "tiny", **{**args, **kw}, log=lambda *_: None)


def test_resume_continues_a_partial_file(runner, tmp_path):
    path = tmp_path / "r.jsonl"
    first = _run(runner, path)
    assert first["computed"] == 4 and first["reused"] == 0  # 2 items x (full, snapkv@0.5)
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][:25])  # one row kept, the next cut short as by a kill
    second = _run(runner, path)
    assert second["computed"] == 3 and second["reused"] == 1
    rows = ruler.load_rows(str(path))
    assert len(rows) == 4 and len({ruler.row_key(r) for r in rows}) == 4
    assert second["cells"] == first["cells"]
    assert _run(runner, path)["computed"] == 0
    grown = _run(runner, path, budgets=[0.5, 0.25])  # a new budget: only its rows
    assert grown["computed"] == 2 and grown["reused"] == 4


def test_rows_hold_reply_score_and_timings(runner, tmp_path):
    result = _run(runner, tmp_path / "r.jsonl", n=1, settings=["query-agnostic", "multi-turn"])
    rows = ruler.load_rows(str(tmp_path / "r.jsonl"))
    assert result["computed"] == len(rows) == 6  # 3 settings (agnostic, untiered, tiered) x 2 variants
    for r in rows:
        assert {"reply", "tokens", "score", "metric", "references", "same_as_full"} <= set(r)
        assert r["metric"] == "string_match_all" and 0 <= r["score"] <= 100
    single = [r for r in rows if r["setting"] == "query-agnostic"]
    assert all("decode_ms" in r and "prefill_ms" in r for r in single)
    assert {r["setting"] for r in rows} == {"query-agnostic", "multi-turn/untiered", "multi-turn/tiered"}
    assert all(r["same_as_full"] for r in rows if r["variant"] == "full")


def test_cli_end_to_end(tok, tmp_path):
    folder = tmp_path / "model"
    build_tiny("llama").save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "r.jsonl"
    args = ["bench", "ruler", "--model", str(folder), "--tasks", "vt", "--lengths", "1024", "--items", "1",
            "--budgets", "0.3", "--methods", "snapkv,streaming", "--window", "8", "--max-new-tokens", "3",
            "--dtype", "float32", "--results", str(out), "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.output)
    assert result["computed"] == 12  # 4 settings x (full, snapkv@0.3, streaming@0.3)
    assert set(result["cells"]) == {f"vt@1024/{s}/{m}" for s in ("query-aware", "query-agnostic",
                                                                  "multi-turn/untiered", "multi-turn/tiered")
                                    for m in ("snapkv", "streaming")}
    cell = result["cells"]["vt@1024/query-aware/snapkv"]
    assert {"full", "accuracy", "agreement_with_full", "b_star", "b_star_90ci", "items"} <= set(cell)
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and json.loads(again.output)["computed"] == 0
    bad = CliRunner().invoke(main, ["bench", "ruler", "--settings", "nope", "--json"])
    assert bad.exit_code != 0 and "--settings" in bad.output


def test_a_shared_prefix_equals_one_prefill_of_the_whole_prompt():
    """The two single-turn settings share their context's prefill: prefilling the rest onto a copy of the prefix
    gives the same next-token logits and the same compressed cache as prefilling the whole prompt at once (fp32)."""
    import torch

    from snapkv_sessions.bench.variants import Prefix, compressed_variants
    from snapkv_sessions.config import CompressionConfig
    from snapkv_sessions.runner import ModelRunner

    runner = ModelRunner(build_tiny("qwen2"), None)
    ids = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    configs = [None, CompressionConfig.make(budget_ratio=0.3, window=8)]
    whole = list(compressed_variants(runner, ids, 8, configs))
    prefix = Prefix.of(runner, ids[:70])
    shared = list(compressed_variants(runner, ids[70:], 8, configs, prefix))
    twice = list(compressed_variants(runner, ids[70:], 8, configs, prefix))  # the prefix is copied, never changed
    for a, b, c in zip(whole, shared, twice, strict=True):
        torch.testing.assert_close(a.logits, b.logits)
        torch.testing.assert_close(b.logits, c.logits)
        assert a.state.cache_lengths() == b.state.cache_lengths()
        assert [p.tolist() for p in a.state.positions] == [p.tolist() for p in b.state.positions]
    assert prefix.state.next_position == 70 and whole[1].state.cache_lengths()[0] < 90


def test_recall_methods_parse_and_bad_ones_are_named():
    assert ruler.split_recall("snapkv") == ("snapkv", None)
    assert ruler.split_recall("adakv+r0.1:lowrank+mass") == ("adakv", {"ratio": 0.1, "selector": "lowrank",
                                                                        "reduce": "mass"})
    assert ruler.split_recall("snapkv+r0.05") == ("snapkv", {"ratio": 0.05, "selector": "exact"})
    for ok in ("snapkv", "snapkv+r0:exact", "pyramid+r0.1:exact+mass+layer"):
        ruler.check_method(ok)
    for bad, said in (("nope", "one of"), ("full+r0.1", "not on full"), ("snapkv+r2", "ratio"),
                      ("snapkv+rx", "could not convert"), ("snapkv+r0.1:pages+mass", "ranks pages")):
        with pytest.raises(ValueError, match=said):
            ruler.check_method(bad)
    res = CliRunner().invoke(main, ["bench", "ruler", "--methods", "snapkv+r0.1:nope", "--json"])
    assert res.exit_code == 2 and "--methods" in res.output and "Traceback" not in res.output


def test_recalling_every_cold_slot_answers_as_the_full_cache(runner, tmp_path):
    """Query-agnostic on a tier, the question's prefill attends to hot and cold and each decode step recalls
    every cold slot: full attention throughout, so the reply equals the full cache's (fp32); the tier alone
    (recall 0) differs from SnapKV only in that prefill. Multi-turn/tiered sessions take recall from the policy;
    multi-turn/untiered has no tier and runs no recall variant."""
    result = _run(runner, tmp_path / "r.jsonl", n=2, budgets=[0.2], max_new_tokens=6,
                  settings=["query-agnostic", "multi-turn"], methods=["snapkv", "snapkv+r1.0:exact", "snapkv+r0:exact"])
    rows = ruler.load_rows(str(tmp_path / "r.jsonl"))
    by = {(r["setting"], r["variant"], r["item"]): r for r in rows}
    assert result["computed"] == len(rows) == 2 * (4 + 4 + 2)  # agnostic and tiered: 4 variants; untiered: 2
    for item in range(2):
        agn = by[("query-agnostic", "snapkv+r1.0:exact@0.2", item)]
        assert agn["same_as_full"] and agn["recall"]["steps"] > 0 and agn["recall"]["recalled_per_step"] > 0
        assert by[("query-agnostic", "snapkv+r0:exact@0.2", item)]["recall"]["recalled_per_step"] == 0
        assert by[("multi-turn/tiered", "snapkv+r1.0:exact@0.2", item)]["same_as_full"]
        assert ("multi-turn/untiered", "snapkv+r1.0:exact@0.2", item) not in by
    assert by[("query-agnostic", "snapkv@0.2", 0)]["kept"] < by[("query-agnostic", "full", 0)]["prompt_tokens"]
