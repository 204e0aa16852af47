"""``bench pointing`` (issue 31): single window rows read per line of the document, lifted, and decided.

The probe's rows seam hands the rows that its scores average; the capture's per-line reading equals a loop over
slots; the lift, the head choice and the decisions are checked on readings built by hand; on SmolLM2 every turn
of a tiered session is read, over every layer and query head and the document's lines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapkv_sessions.attention import WindowProbe, window_mean
from snapkv_sessions.bench.pointing import (
    RowCapture,
    TurnReading,
    choose_heads,
    decide,
    document_lines,
    lifted,
    session_readings,
    summarise,
)
from snapkv_sessions.compress import Selection
from snapkv_sessions.reach import SINKS


def test_the_rows_seam_hands_the_rows_the_scores_average():
    torch.manual_seed(0)
    seen = {}
    probe = WindowProbe(3, rows=lambda layer, probs: seen.setdefault(layer, probs.clone()))
    query, key = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8)  # (B, Hq, Q, D), (B, Hkv, T, D)
    probe.record(5, query, key, 8**-0.5)
    rows = seen[5]  # (B, Hkv, G, W, T)
    assert rows.shape == (1, 2, 2, 3, 7)
    torch.testing.assert_close(window_mean(rows), probe.scores[5])
    torch.testing.assert_close(rows.sum(-1), torch.ones(1, 2, 2, 3))


def test_the_capture_reads_each_row_per_line_as_a_loop_over_slots():
    torch.manual_seed(1)
    hkv, group, window, n = 2, 2, 3, 14
    line_of = np.array([-1] * 6 + [0, 0, 1, 1, 1, 2, -1, -1])  # (n,) the document is positions 6-11
    # each KV head holds its own slots, in its own order of true positions (a tiered union is sorted per head)
    positions = torch.stack([torch.randperm(n)[:12].sort().values for _ in range(hkv)]).unsqueeze(0)  # (1, Hkv, T)
    probs = torch.rand(1, hkv, group, window, 12).softmax(-1)  # (B, Hkv, G, W, T)
    earlier = n - window + 1  # the window: the last 3 of 15 ids (ids beyond n: this turn's, not in line_of)
    capture = RowCapture(lambda: list(range(n + 1)), lambda ids: line_of[: len(ids)], documents=3)
    capture.begin()
    capture.on_rows(0, probs)
    capture.on_selection(Selection(0, positions, torch.zeros(1), torch.zeros(1), torch.zeros(1)))
    got = capture.reading("shift", [1]).lines[0]  # (Hq, D)
    want = np.zeros((hkv * group, 3))
    for h in range(hkv * group):
        for r in range(window):
            mass = np.zeros(3)
            total = 0.0
            for slot in range(12):
                p = int(positions[0, h // group, slot])
                if SINKS <= p < earlier:
                    total += float(probs[0, h // group, h % group, r, slot])
                    if line_of[p] >= 0:
                        mass[line_of[p]] += float(probs[0, h // group, h % group, r, slot])
            want[h] = np.maximum(want[h], mass / total)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_document_lines_start_at_the_documents_first_line():
    texts = ["<sys>\n", "Hi\n", "TITLE", "\n", "a: 1", "\n", "b: 2", "\n", "q?"]
    ids = list(range(len(texts)))
    got = document_lines(ids, lambda t: texts[t], "TITLE\na: 1\nb: 2")
    assert got.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, -1]
    assert document_lines(ids, lambda t: texts[t], "ABSENT\nx").tolist() == [-1] * len(texts)


def _reading(label: str, point: dict[tuple[int, int], int], targets: list[int], base: float = 0.1) -> TurnReading:
    lines = np.full((2, 2, 5), base)  # (L, Hq, D): every line a little
    for (layer, head), line in point.items():
        lines[layer, head, line] += 0.8
    return TurnReading(label, lines, targets)


def test_lift_takes_off_what_earlier_turns_read():
    a, b = _reading("first", {(0, 0): 1}, [1]), _reading("shift", {(0, 0): 1}, [1])
    first, second = lifted([a, b])
    np.testing.assert_allclose(first, a.lines)
    np.testing.assert_allclose(second, b.lines - a.lines)  # the same line again lifts to nothing


def test_heads_chosen_by_the_record_line_and_decisions_by_new_lines():
    # head (1, 0) points at each turn's record; head (0, 1) always at line 0 (a header every window reads)
    turns = [_reading("first", {(1, 0): 1, (0, 1): 0}, [1]),
             _reading("follow", {(0, 1): 0}, [1]),  # a pronoun: points at nothing new
             _reading("shift", {(1, 0): 3, (0, 1): 0}, [3]),
             _reading("follow", {(1, 0): 3, (0, 1): 0}, [3]),  # names the same record again
             _reading("shift", {(1, 0): 2, (0, 1): 0}, [2])]
    assert choose_heads([turns], 1) == [(1, 0)]
    decisions = decide(turns, [(1, 0)], floor=0.2)
    assert [d.shift for d in decisions] == [False, False, True, False, True]
    assert [d.line for d in decisions][2:] == [3, 3, 2]
    assert [d.on_target for d in decisions] == [None, None, True, None, True]
    assert decisions[3].score < 0 < decisions[2].score  # the follow-up's line was pointed at already


def test_summarise_leaves_each_seed_out():
    def session(record: int) -> list[TurnReading]:
        return [_reading("first", {(1, 1): 0}, [0]), _reading("shift", {(1, 1): record}, [record]),
                _reading("follow", {}, [record])]

    cells = {"k/message": {0: [session(2)], 1: [session(3)], 2: [session(4)]}}
    result = summarise(cells, [1], floor=0.2)
    by = result["by_k"]["1"]
    assert by["pointing"] == {"on_target": 3, "of": 3}
    assert by["cells"]["k/message"]["tp"] == 3 and by["cells"]["k/message"]["fp"] == 0
    assert by["auc"] == 1.0 and by["heads_all_seeds"] == [(1, 1)]


def test_summarise_names_the_seeds_when_no_heads_can_be_chosen():
    from snapkv_sessions.errors import ConfigError

    cells = {"k/message": {0: [[_reading("first", {}, [])]], 1: [[_reading("follow", {}, [])]]}}
    with pytest.raises(ConfigError, match="no shift turn with exactly one record line"):
        summarise(cells, [1], floor=0.2)


@pytest.mark.parametrize("shape", ["message", "pasted"])
def test_every_turn_of_a_tiered_session_is_read(smollm2, shape):
    from snapkv_sessions.bench.detector import scenario
    from snapkv_sessions.runner import ModelRunner

    runner = ModelRunner(*smollm2)
    sc = scenario(0, "items", shape)
    sc.turns[:] = sc.turns[:3]
    readings = session_readings(runner, sc, shape, 0.3, 4)
    layers = runner.model.config.num_hidden_layers
    heads = runner.model.config.num_attention_heads
    assert [r.label for r in readings] == ["first", "follow", "shift"]
    assert all(r.lines.shape == (layers, heads, len(sc.document.split("\n"))) for r in readings)
    assert all(((r.lines >= 0) & (r.lines <= 1 + 1e-5)).all() for r in readings)
    assert readings[2].targets and all(r.lines[..., 2:].max() > 0 for r in readings)  # the records were read
    assert runner.rows_observer is None and runner.observer is None  # the seams are left as found


@pytest.mark.parametrize("args, named", [(["--seeds", "1"], "--seeds"), (["--kinds", "bogus,people"], "--kinds"),
                                         (["--shapes", "inline"], "--shapes"), (["--heads", "x"], "--heads")])
def test_the_command_names_a_bad_option_before_loading_anything(args, named):
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    res = CliRunner().invoke(main, ["bench", "pointing", "--model", "/nonexistent", *args])
    assert res.exit_code == 2 and named in res.output and "Traceback" not in res.output
