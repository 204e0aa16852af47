"""The attention shift signal of the tiered memory (issue 31): what a turn's window reached for that was cold.

The function is checked against a brute-force loop over positions; on SmolLM2, for every kind and shape of the
detector bench, each turn's recalled shares are rebuilt from the turn records' kept positions and its decision
from the recorded score and the policy's threshold."""

from __future__ import annotations

import statistics

import pytest
import torch

from snapkv_sessions.attention import WindowProbe
from snapkv_sessions.bench.detector import KINDS, SHAPES, scenario
from snapkv_sessions.cache import History
from snapkv_sessions.reach import SINKS, Before, Reach, cold_reach
from snapkv_sessions.store.blobs import unpack_positions


def _reference(scores, hot, history, turn_start, kept, kv_heads):
    """Per layer and KV head, by loops: (cold mass share, recalled share)."""
    old_end = min(turn_start, history)
    out = []
    for layer, s in enumerate(scores):  # (Hq, N)
        group = s.shape[0] // kv_heads
        row = []
        for h in range(kv_heads):
            mass = s[h * group : (h + 1) * group].mean(0)  # (N,)
            was = {int(p) for p in hot[layer][h] if p >= 0}
            old = [p for p in range(SINKS, old_end)]
            cold = [p for p in old if p not in was]
            share = float(sum(mass[p] for p in cold) / sum(mass[p] for p in old))
            kept_old = [int(p) for p in kept[layer][h] if SINKS <= p < old_end]
            back = [p for p in kept_old if p not in was]
            row.append((share, len(back) / len(kept_old)))
        out.append(row)
    return out


def test_cold_reach_equals_a_loop_over_positions():
    g = torch.Generator().manual_seed(3)
    layers, kv_heads, group, n, history, turn_start, k_hot, k_new = 4, 2, 3, 60, 48, 44, 20, 24
    scores = [torch.rand(kv_heads * group, n, generator=g).softmax(-1) for _ in range(layers)]  # (Hq, N) each
    # what was hot: random per head, one head padded with -1 (uneven counts)
    hot = [torch.stack([torch.randperm(history, generator=g)[:k_hot].sort().values for _ in range(kv_heads)])
           for _ in range(layers)]  # (Hkv, K)
    hot[1][0, -3:] = -1
    kept = [torch.stack([torch.randperm(n, generator=g)[:k_new].sort().values for _ in range(kv_heads)])
            for _ in range(layers)]  # (Hkv, K') slot indices = true positions on a tiered cache
    positions = [torch.arange(n).expand(1, kv_heads, n) for _ in range(layers)]
    hist = History(positions, list(range(n)), torch.zeros(n, dtype=torch.bool), n, lambda layer: None, 0)
    probe = WindowProbe(window=8, turn_start=turn_start, scores={i: s[None] for i, s in enumerate(scores)})
    got = cold_reach(hist, probe, Before([h[None] for h in hot], history), {i: k[None] for i, k in enumerate(kept)})
    assert got.shape == (2, layers, kv_heads)
    ref = _reference(scores, hot, history, turn_start, kept, kv_heads)
    for layer in range(layers):
        for h in range(kv_heads):
            assert got[0, layer, h].item() == pytest.approx(ref[layer][h][0], rel=1e-5)
            assert got[1, layer, h].item() == pytest.approx(ref[layer][h][1], rel=1e-6)
    reach = Reach.of(got.flatten().tolist(), layers, kv_heads)  # the turn's figure: the upper half's median
    assert reach.score == round(statistics.median(ref[layer][h][0] for layer in (2, 3) for h in range(2)), 4)
    # nothing held before (a first turn), or nothing older than the sinks: no reading
    assert cold_reach(hist, probe, Before([], history), {}) is None
    assert cold_reach(hist, WindowProbe(8, SINKS, probe.scores), Before([h[None] for h in hot], history), {}) is None


def _kept(rec) -> list[list[list[int]]]:
    return [[[p for p in head if p >= 0] for head in k.tolist()] for k in unpack_positions(rec.kept_positions)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_attention_decision_follows_the_recalled_positions_of_the_record(smollm2, kind, shape):
    """Each turn's recalled share, per layer and KV head, is what the turn records' kept positions say came back
    from cold (kept now, in the earlier history, not kept by the turn before); the decision is the recorded score
    against the policy's threshold, with the text signals' decision recorded beside it."""
    from snapkv_sessions import Session, SessionStore

    sc = scenario(0, kind, shape)
    threshold = 0.04
    policy = {"compression": {"budget_ratio": 0.3},
              "drift": {"signal": "attention", "attention_threshold": threshold, "embedder": "none"}}
    session = Session.create(smollm2, policy=policy, store=SessionStore("sqlite://"))
    if shape == "message":
        session.add_document(sc.document, name="document")
    for turn in sc.turns[:4]:
        session.chat(turn.question, max_new_tokens=6)
    records = session.store.turns(session.id, status="done")
    decisions = []
    for prev, rec in zip(records, records[1:], strict=False):
        reach = rec.compression["reach"]
        old_end = reach["earlier"]  # where this turn's prefill began: at most where the last reply began
        assert SINKS < old_end <= prev.compression["context_tokens"]
        before, now = _kept(prev), _kept(rec)
        for layer, heads in enumerate(now):
            for h, kept in enumerate(heads):
                old = [p for p in kept if SINKS <= p < old_end]
                back = [p for p in old if p not in set(before[layer][h])]
                assert reach["recalled_share"][layer][h] == round(len(back) / len(old), 3), (layer, h)
        expected = "tiered" if reach["score"] > threshold else "kept"
        assert rec.drift_decision == expected
        events = [e for e in session.store.events(session.id) if e.turn == rec.turn and e.kind == "attention_shift"]
        assert len(events) == 1 and events[0].payload["score"] == reach["score"]
        assert events[0].payload["text_decision"] == "n/a"  # no embedder: the text side had nothing to say
        decisions.append(expected)
    assert len(decisions) == 3
