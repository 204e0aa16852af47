"""The scorer seam: a toy key-norm scorer defined here alone runs through the engine and a Session with the
shared top-k; StreamingLLM and SpanAware(SnapKV) through the seam keep what the pre-seam code kept."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.policy import Policy, PolicyError
from snapkv_sessions.press import SnapKV, select_positions, spread_over_words, streaming_positions
from snapkv_sessions.runner import ModelRunner
from snapkv_sessions.scorers import (
    SCORERS,
    KeepRule,
    ScoreContext,
    SpanAware,
    StreamingLLM,
    register_scorer,
    select_layer,
    word_ids,
)
from snapkv_sessions.state import KVState

TOY = "keynorm-toy"


class KeyNorm:
    """Toy scorer: a history slot's score is the L2 norm of its key, per KV head."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.calls = 0

    def score(self, window_probs: torch.Tensor, state: KVState, layer: int) -> torch.Tensor:
        self.calls += 1
        keys = state.keys(layer)  # (B, Hkv, T, D)
        return keys.float().norm(dim=-1)[..., : keys.shape[-2] - self.window]  # (B, Hkv, T - W)


BUILT: list[KeyNorm] = []


def _keynorm(cfg: CompressionConfig, ctx: ScoreContext) -> KeyNorm:
    BUILT.append(KeyNorm(ctx.window))
    return BUILT[-1]


register_scorer(TOY, _keynorm, replace=True)


class WordTok:
    """A stand-in tokenizer: every third id starts a word."""

    @staticmethod
    def convert_ids_to_tokens(ids):
        return ["Ġw" if i % 3 == 0 else "x" for i in ids]


def prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=gen).tolist()


# ---------------------------------------------------------------- an independent reference for the toy


def keynorm_reference(keys: list[torch.Tensor], positions: list[torch.Tensor], keep: torch.Tensor, budget: int,
                      window: int) -> list[list[list[int]]]:
    """Per layer and head, the true positions a key-norm top-k keeps: every forced (pinned or protected)
    history position, the largest-norm others up to ``budget - window``, and the last ``window`` slots."""
    kept = []
    for k, pos in zip(keys, positions, strict=True):  # (1, Hkv, T, D), (1, Hkv, T)
        heads = []
        for h in range(pos.shape[1]):
            p = pos[0, h].tolist()
            if len(p) <= budget:
                heads.append(p)
                continue
            hist = len(p) - window
            norms = (k[0, h, :hist].double() ** 2).sum(-1).sqrt().tolist()
            forced = [i for i in range(hist) if keep[p[i]]]
            others = sorted((i for i in range(hist) if not keep[p[i]]), key=lambda i: -norms[i])
            slots = forced + others[: budget - window - len(forced)] + list(range(hist, len(p)))
            heads.append(sorted(p[i] for i in slots))
        kept.append(heads)
    return kept


def is_keynorm_top_k(keys: list[torch.Tensor], positions: list[torch.Tensor], keep: torch.Tensor, budget: int,
                     window: int, kept: list[torch.Tensor], tol: float = 1e-5) -> bool:
    """Whether ``kept`` is a key-norm top-k with the forced positions and the window, allowing either slot of
    a tie: every kept unforced history slot's norm is at least every dropped slot's norm (within ``tol``)."""
    for k, pos, got in zip(keys, positions, kept, strict=True):  # (1, Hkv, T, D), (1, Hkv, T), (1, Hkv, K)
        for h in range(pos.shape[1]):
            p, held = pos[0, h].tolist(), set(got[0, h].tolist())
            if len(p) <= budget:
                if held != set(p):
                    return False
                continue
            hist = len(p) - window
            norms = (k[0, h, :hist].double() ** 2).sum(-1).sqrt().tolist()
            chosen = [norms[i] for i in range(hist) if p[i] in held and not keep[p[i]]]
            dropped = [norms[i] for i in range(hist) if p[i] not in held]
            if (len(held) != budget or not set(p[hist:]) <= held or not all(p[i] in held for i in range(hist) if keep[p[i]])
                    or (chosen and dropped and min(chosen) < max(dropped) - tol * max(dropped))):
                return False
    return True


def snapshot(state: KVState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [lay.keys.detach().clone() for lay in state.cache.layers], [p.clone() for p in state.positions]


def test_toy_scorer_engine_equals_reference():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=32, window=8, scorer=TOY)
    # distinct tokens: layer 0's keys of a repeated token would tie in norm (RoPE keeps norms)
    ids = (torch.randperm(93, generator=torch.Generator().manual_seed(0)) + 3).tolist()
    _, probe = runner.prefill(state, ids[:60], pinned=[i < 4 or 40 <= i < 43 for i in range(60)], window=8)
    keys, positions = snapshot(state)
    report = runner.compress(state, cfg, probe)
    expected = keynorm_reference(keys, positions, state.pinned, 32, 8)
    assert [p[0].tolist() for p in state.positions] == expected
    assert is_keynorm_top_k(keys, positions, state.pinned, 32, 8, state.positions)
    assert report.tokens_after == [32] * runner.num_layers and report.pinned_kept == 7
    assert BUILT[-1].calls == runner.num_layers
    # a second turn onto the compressed cache, with a protected question
    _, probe = runner.prefill(state, ids[60:84], window=8)
    protect = torch.zeros(state.next_position, dtype=torch.bool)
    protect[66:72] = True
    keys, positions = snapshot(state)
    runner.compress(state, cfg, probe, protect=protect)
    assert [p[0].tolist() for p in state.positions] == keynorm_reference(keys, positions, state.pinned | protect, 32, 8)


def test_toy_scorer_runs_a_session(smollm2, monkeypatch):
    """A real Session with ``compression.scorer`` naming the toy: every compression keeps a key-norm top-k.

    Layer 0's keys of a repeated token differ only by their rotation (RoPE keeps norms), so their norms tie up
    to float rounding; the check allows either slot of such a tie (the exact equality is the engine test's)."""
    checked = []
    original = ModelRunner.compress

    def compress(self, state, cfg, probe, protect=None):
        keys, positions = snapshot(state)
        keep = state.pinned.clone() if protect is None else state.pinned | protect[: state.next_position].cpu()
        report = original(self, state, cfg, probe, protect)
        checked.append(is_keynorm_top_k(keys, positions, keep, cfg.budget, probe.window, state.positions))
        return report

    monkeypatch.setattr(ModelRunner, "compress", compress)
    policy = {"compression": {"budget": 64, "window": 16, "scorer": TOY},
              "pins": {"roles": ["system"], "sink_tokens": 4}, "drift": {"embedder": "none"}}
    session = Session.create(smollm2, policy=policy, store=SessionStore("sqlite://"), system="Be brief.")
    session.add_document(" ".join(f"Parcel {1000 + i} goes to shelf {i % 7}." for i in range(12)), name="doc")
    built = len(BUILT)
    for question in ("Where is parcel 1003?", "And parcel 1005?"):
        session.chat(question, max_new_tokens=4)
    assert len(checked) == 2 and all(checked) and len(BUILT) > built
    assert session.verify() == []


# ---------------------------------------------------------------- the built-in scorers through the seam


def _positions_state(length: int, heads: int = 2) -> KVState:
    return KVState(cache=None, positions=[torch.arange(length).expand(1, heads, length)])


@pytest.mark.parametrize(("length", "budget", "window", "sinks"),
                         [(50, 20, 4, 4), (100, 33, 32, 1), (64, 40, 8, 0), (300, 64, 16, 8), (41, 40, 8, 32)])
def test_streaming_scores_keep_streaming_positions(length, budget, window, sinks):
    state = _positions_state(length)
    rule = KeepRule(window, torch.zeros(length, dtype=torch.bool), n_pinned=0)
    got = select_layer(StreamingLLM(window, sinks), torch.rand(1, 4, length), state, 0, budget, rule)
    assert torch.equal(got, streaming_positions(length, budget, sinks, 1, 2, "cpu"))


def test_streaming_sinks_past_the_history_budget_keep_the_window():
    # the one case the seam changes: sinks > budget - window keeps the first sinks that fit and the whole window
    # (streaming_positions kept [0, 1, 2, 3, 44, ..., 49], cutting into the window)
    rule = KeepRule(8, torch.zeros(50, dtype=torch.bool), n_pinned=0)
    got = select_layer(StreamingLLM(8, sinks=4), torch.rand(1, 2, 50), _positions_state(50, heads=1), 0, 10, rule)
    assert got[0, 0].tolist() == [0, 1, *range(42, 50)]


def test_streaming_spellings_agree_and_keep_pins():
    runner = ModelRunner(build_tiny("llama"))
    kept = []
    for kw in ({"method": "streaming"}, {"scorer": "streaming"}, {"method": "streaming", "scorer": "streaming"}):
        state = runner.new_state()
        _, probe = runner.prefill(state, prompt(50), window=4)
        runner.compress(state, CompressionConfig.make(budget=20, window=4, sinks=4, **kw), probe)
        kept.append([p.tolist() for p in state.positions])
    assert kept[0] == kept[1] == kept[2]
    # pins are forced in by the shared top-k, for streaming too: 20 and 21 displace the two oldest recent slots
    state = runner.new_state()
    ids = prompt(50)
    _, probe = runner.prefill(state, ids, pinned=[i in (20, 21) for i in range(50)], window=4)
    runner.compress(state, CompressionConfig.make(budget=20, window=4, method="streaming", sinks=4), probe)
    for layer in range(runner.num_layers):
        assert state.kept_positions(layer, 0) == [0, 1, 2, 3, 20, 21, *range(36, 50)]


def test_span_aware_snapkv_equals_the_pre_seam_selection():
    """SpanAware(SnapKV) through the engine equals the pre-seam path written out with the press primitives."""
    runner = ModelRunner(build_tiny("qwen2"), WordTok())
    state = runner.new_state()
    ids = prompt(90, seed=3)
    _, probe = runner.prefill(state, ids, pinned=[i < 3 for i in range(90)], window=8)
    positions = [p.clone() for p in state.positions]
    cfg = CompressionConfig.make(budget=40, window=8, kernel=5, span_aware=True)
    words = torch.tensor([1 if t % 3 == 0 else 0 for t in ids]).cumsum(0)  # "Ġw" starts a word
    expected = []
    for layer, pos in enumerate(positions):
        scores = SnapKV(8, 5).score(probe.scores[layer], runner.num_kv_heads)  # the pre-seam call form
        hist = pos[..., :-8]
        scores = spread_over_words(scores, words[hist])
        expected.append(pos.gather(-1, select_positions(scores, 32, 8, state.pinned[hist], False, layer)))
    runner.compress(state, cfg, probe)
    assert all(torch.equal(a, b) for a, b in zip(state.positions, expected, strict=True))
    assert torch.equal(word_ids(runner.tokenizer, state.token_ids, runner.device), words)


def test_span_aware_wraps_any_scorer():
    state = _positions_state(30, heads=1)
    state.token_ids = [3, 1, 1] * 10  # words of 3 tokens (id 3 starts one)
    spread = SpanAware(StreamingLLM(window=6, sinks=0), WordTok()).score(torch.rand(1, 2, 30), state, 0)  # (1, 1, 24)
    assert spread[0, 0].tolist() == [float(3 * w + 2) for w in range(8) for _ in range(3)]  # a word's latest slot
    with pytest.raises(ConfigError, match="^span_aware=True: needs the runner to have a tokenizer"):
        SpanAware(StreamingLLM(window=6), None)


# ---------------------------------------------------------------- the registry and the config


def test_unknown_scorer_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        CompressionConfig.make(scorer="no-such-scorer")
    assert err.value.param == "scorer" and err.value.value == "no-such-scorer" and TOY in err.value.reason
    with pytest.raises(PolicyError) as err:
        Policy.from_dict({"compression": {"scorer": "no-such-scorer"}})
    assert err.value.param == "compression.scorer" and err.value.value == "no-such-scorer"
    with pytest.raises(PolicyError) as err:
        Policy.from_dict({"compression": {"scorer": TOY, "method": "streaming"}})
    assert err.value.param == "compression.scorer" and "conflicts with method='streaming'" in err.value.reason
    with pytest.raises(ConfigError, match="already registered"):
        register_scorer(TOY, _keynorm)


def test_a_scorer_unregistered_after_the_config_is_refused_at_use():
    register_scorer("short-lived", _keynorm)
    cfg = CompressionConfig.make(budget=20, window=4, scorer="short-lived")
    del SCORERS["short-lived"]
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    _, probe = runner.prefill(state, prompt(40), window=4)
    with pytest.raises(ConfigError) as err:
        runner.compress(state, cfg, probe)
    assert err.value.param == "compression.scorer" and err.value.value == "short-lived"


def test_a_scorer_of_the_wrong_shape_is_named():
    register_scorer("wrong-shape", lambda cfg, ctx: StreamingLLM(window=ctx.window + 1), replace=True)
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    _, probe = runner.prefill(state, prompt(40), window=4)
    with pytest.raises(ConfigError, match="returned scores of shape"):
        runner.compress(state, CompressionConfig.make(budget=20, window=4, scorer="wrong-shape"), probe)


def test_default_scorer_leaves_the_policy_hash_alone():
    default = json.loads(Policy().canonical_json())
    assert "scorer" not in default["compression"]  # policies stored before the seam keep their sha256
    toy = Policy.from_dict({"compression": {"scorer": TOY}})
    assert json.loads(toy.canonical_json())["compression"]["scorer"] == TOY
    assert Policy.from_yaml(toy.canonical_json()) == toy and toy.sha256 != Policy().sha256


class LineTok:
    """A stand-in tokenizer: id 5 is a newline, id 7 ends a sentence, ids divisible by 3 begin with a space."""

    @staticmethod
    def convert_ids_to_tokens(ids):
        return ["Ċ" if i == 5 else "." if i == 7 else "Ġw" if i % 3 == 0 else "x" for i in ids]


def test_span_ids_by_unit():
    from snapkv_sessions.scorers import span_ids

    ids = [1, 3, 1, 7, 3, 1, 5, 1, 3, 7, 1, 3]
    # words start at a spaced token or after a newline; lines after a newline; sentences also after a "." that
    # a spaced token follows
    assert span_ids(LineTok(), ids, "cpu", "word").tolist() == [0, 1, 1, 1, 2, 2, 3, 4, 5, 5, 5, 6]
    assert span_ids(LineTok(), ids, "cpu", "line").tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert span_ids(LineTok(), ids, "cpu", "sentence").tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    with pytest.raises(ConfigError, match="^span_unit='para'"):
        SpanAware(StreamingLLM(window=6), LineTok(), "para")


@pytest.mark.parametrize("unit", ["line", "sentence"])
def test_record_aware_snapkv_equals_a_reference(unit):
    """SpanAware(SnapKV) by lines or sentences through the engine equals the selection written out by hand:
    every history slot scored with its record's best SnapKV score, then the shared top-k."""
    runner = ModelRunner(build_tiny("llama"), LineTok())
    state = runner.new_state()
    ids = prompt(120, seed=5)
    _, probe = runner.prefill(state, ids, pinned=[i < 4 for i in range(120)], window=8)
    positions = [p.clone() for p in state.positions]
    pieces = LineTok.convert_ids_to_tokens(ids)
    record, records = 0, []
    for i, piece in enumerate(pieces):  # the record rule, spelled out
        prev = pieces[i - 1] if i else ""
        if i and (prev == "Ċ" or (unit == "sentence" and prev == "." and piece[0] in "ĠĊ")):
            record += 1
        records.append(record)
    records = torch.tensor(records)
    expected = []
    for layer, pos in enumerate(positions):
        scores = SnapKV(8, 5).score(probe.scores[layer], runner.num_kv_heads)  # (B, Hkv, P)
        hist = pos[..., :-8]
        best = torch.full((*scores.shape[:2], int(records.max()) + 1), float("-inf"))
        best = best.scatter_reduce(-1, records[hist], scores, reduce="amax")
        spread = best.gather(-1, records[hist])
        expected.append(pos.gather(-1, select_positions(spread, 40, 8, state.pinned[hist], False, layer)))
    runner.compress(state, CompressionConfig.make(budget=48, window=8, kernel=5, span_aware=True, span_unit=unit),
                    probe)
    assert all(torch.equal(a, b) for a, b in zip(state.positions, expected, strict=True))
