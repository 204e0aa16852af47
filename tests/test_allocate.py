"""The allocation seam: AdaKV against a reference, uneven heads through decode, the tier, batching and a session,
and an allocator defined here alone."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny
from reference import full_logits_masked, reference_adakv, visibility_masks

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.allocate import ALLOCATORS, AdaKV, build_allocator, register_allocator
from snapkv_sessions.batch import decode_step
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.policy import Policy

GREEDY = GenerationConfig(max_new_tokens=6, eos_token_ids=())


def prompt(n: int, seed: int = 1, vocab: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def held_sets(kept: list[torch.Tensor]) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted real positions of ``state.held()`` (padding, -1, left out)."""
    return [[sorted({p for p in row if p >= 0}) for row in k[0].tolist()] for k in kept]


def adakv(**kw) -> CompressionConfig:
    return CompressionConfig.make(**{"budget": 24, "window": 6, "kernel": 3, "allocator": "adakv", **kw})


@pytest.mark.parametrize("kind", ["llama", "llama-mha"])
def test_adakv_kept_sets_equal_reference(kind):
    window, kernel, budget, floor = 5, 5, 17, 0.25
    ids = prompt(60, seed=7)
    eager = build_tiny(kind, seed=5, attn="eager")
    with torch.inference_mode():
        attn = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # per layer (1, Hq, T, T)
    runner = ModelRunner(build_tiny(kind, seed=5))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=budget, window=window, kernel=kernel, allocator="adakv",
                                 allocator_params={"floor": floor})
    _, probe = runner.prefill(state, ids, window=window)
    report = runner.compress(state, cfg, probe)
    expected = reference_adakv([a[0] for a in attn], window, kernel, budget - window, runner.num_kv_heads, floor)
    uneven = 0
    for layer in range(runner.num_layers):
        counts = [len(expected[layer][h]) for h in range(runner.num_kv_heads)]
        assert sum(counts) == runner.num_kv_heads * budget  # the layer's total is the even split's
        assert report.kept[layer] == counts
        uneven += len(set(counts)) > 1
        for head in range(runner.num_kv_heads):
            assert state.kept_positions(layer, head) == expected[layer][head], (layer, head)
        assert state.positions[layer].shape[-1] == max(counts)  # padded to the busiest head, not the context
    assert uneven  # not vacuous: some layer's heads kept different numbers


@pytest.mark.parametrize("strategy", ["uniform", "pyramid"])
def test_uneven_heads_decode_equals_masked_full_attention(tiny_kind, strategy):
    """Two AdaKV turns: every logit equals full eager attention with each head's evicted positions masked out."""
    model = build_tiny(tiny_kind, seed=3)
    runner = ModelRunner(model)
    cfg = adakv(strategy=strategy, pyramid_beta=4)
    state = runner.new_state()
    got: dict[int, torch.Tensor] = {}
    snaps = []

    def decode(logits: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            got[state.next_position - 1] = logits
            logits = runner.step(state, int(logits.argmax()))
        got[state.next_position - 1] = logits

    for ids in (prompt(50), prompt(18, seed=4)):
        logits, probe = runner.prefill(state, ids, window=6)
        runner.compress(state, cfg, probe)
        snaps.append((state.next_position, [[[p for p in row if p >= 0] for row in k[0].tolist()]
                                            for k in state.held()]))
        decode(logits, 8)
    assert any(len(set(counts)) > 1 for r in state.reports for counts in r.kept)
    masks = visibility_masks(snaps, state.next_position, runner.num_layers, runner.num_kv_heads)
    runner.detach()
    ref = full_logits_masked(model, state.token_ids, masks)  # (T, V)
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], rtol=1e-4, atol=1e-4)
    assert len(got) == 18


def test_tiered_adakv_equals_reprefill_every_turn():
    """A tiered session with AdaKV keeps, turn after turn, what a fresh prefill of the whole transcript keeps."""
    runner = ModelRunner(build_tiny("llama-mha", seed=3))
    cfg = adakv()
    state = runner.new_state(tiered=True)
    history: list[int] = []
    recalled = 0
    for turn in range(4):
        ids = prompt(30 if turn == 0 else 9, seed=turn + 1)
        tiered = runner.turn(state, ids, cfg, GREEDY)
        ref = runner.turn(runner.new_state(), history + ids, cfg, GREEDY)
        assert held_sets(tiered.kept) == held_sets(ref.kept), turn
        assert tiered.tokens == ref.tokens
        assert tiered.report.kept == ref.report.kept
        recalled += tiered.report.tier["recalled"]
        history += ids + tiered.tokens
    assert recalled > 0  # the tier gave slots back, under uneven heads


def test_batched_step_with_uneven_heads_equals_single_steps():
    runner = ModelRunner(build_tiny("llama", seed=3))
    uneven, even = runner.new_state(), runner.new_state()
    runner.turn(uneven, prompt(40, seed=9), adakv(), GREEDY)
    runner.turn(even, prompt(30, seed=8), CompressionConfig.make(budget=20, window=6), GREEDY)
    assert any(lay.visible is not None for lay in uneven.cache.layers)
    alone = [uneven.clone(), even.clone()]
    tokens = [uneven.pending[0], even.pending[0]]
    for s in (uneven, even, *alone):
        s.pending = []
    for _ in range(3):
        batched = decode_step(runner, [uneven, even], tokens)  # (2, V)
        for i, s in enumerate(alone):
            torch.testing.assert_close(batched[i], runner.step(s, tokens[i]), rtol=1e-5, atol=1e-5)
        tokens = [int(batched[0].argmax()), int(batched[1].argmax())]
    for a, b in zip(uneven.held(), alone[0].held(), strict=True):
        assert torch.equal(a, b)  # the padding came back from the slot unchanged


# ---------------------------------------------------------------- the seam


class FirstHeadHeavy:
    """A toy allocator, defined in this test file alone: head 0 keeps ``extra`` more than the even split, the last
    head ``extra`` fewer (at least one)."""

    def __init__(self, extra: int = 3) -> None:
        if not isinstance(extra, int) or extra < 0:
            raise ConfigError("allocator_params.extra", extra, "must be an int >= 0")
        self.extra = extra

    def counts(self, scores: torch.Tensor, keep: int) -> torch.Tensor:
        bsz, heads, hist = scores.shape
        shift = min(self.extra, keep - 1, hist - keep)
        counts = torch.full((bsz, heads), keep, dtype=torch.long, device=scores.device)
        counts[:, 0] += shift
        counts[:, -1] -= shift
        return counts


@pytest.fixture
def toy_allocator():
    register_allocator("toy-first-heavy", FirstHeadHeavy)
    yield "toy-first-heavy"
    ALLOCATORS.pop("toy-first-heavy", None)


def test_toy_allocator_sets_per_head_counts(toy_allocator):
    runner = ModelRunner(build_tiny("llama-mha", seed=3))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=20, window=4, allocator=toy_allocator, allocator_params={"extra": 5})
    result = runner.turn(state, prompt(40), cfg, GREEDY)
    assert result.report.kept == [[25, 20, 20, 15]] * runner.num_layers
    assert [len(s) for s in held_sets(result.kept)[0]] == [25, 20, 20, 15]


@pytest.mark.slow
def test_session_runs_with_a_toy_allocator(toy_allocator, smollm2, tmp_path):
    """A stored session whose policy names an allocator registered by this test: its turns keep the toy's counts,
    and replaying the store (Session.rebuild) gives the same kept sets."""
    from snapkv_sessions import Session, SessionStore

    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    policy = {"compression": {"budget": 48, "window": 8, "allocator": toy_allocator,
                              "allocator_params": {"extra": 4}}}
    session = Session.create(smollm2, policy=policy, store=store, system="You are brief.")
    for question in ("Name a colour.", "Name a fruit.", "Name a city."):
        session.chat(question, max_new_tokens=8)
    turns = store.turns(session.id, status="done")
    assert len(turns) == 3
    heads = session.runner.num_kv_heads
    compressed = [r for r in session.state.reports if r.compressed]
    assert compressed
    for report in compressed:  # 40 history slots per head, head 0 four more, the last four fewer, + the window
        assert all(row == [52] + [48] * (heads - 2) + [44] for row in report.kept)
    for rec in turns:  # the store's record says the same
        if rec.compression and rec.compression["compressed"]:
            assert rec.compression["kept"][0] == [52] + [48] * (heads - 2) + [44]
    rebuilt = Session.rebuild(session.id, smollm2, store)
    for a, b in zip(session.state.held(), rebuilt.state.held(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- configuration


def test_allocator_config_is_validated_and_keeps_stored_hashes():
    plain = Policy.from_dict({"compression": {"budget": 64}})
    assert "allocator" not in plain.model_dump()["compression"]  # the default is left unsaid: hashes unchanged
    assert "allocator_params" not in plain.model_dump()["compression"]
    named = Policy.from_dict({"compression": {"budget": 64, "allocator": "adakv", "allocator_params": {"floor": 0.5}}})
    assert named.model_dump()["compression"]["allocator"] == "adakv"
    assert named.sha256 != plain.sha256
    assert Policy.from_dict(named.model_dump()).sha256 == named.sha256
    with pytest.raises(ConfigError) as err:
        CompressionConfig.make(budget=64, allocator="adakv", allocator_params={"floor": 1.5})
    assert err.value.param == "allocator_params.floor" and err.value.value == 1.5
    with pytest.raises(ConfigError) as err:
        CompressionConfig.make(budget=64, allocator="adakv", allocator_params={"alpha": 0.2})
    assert err.value.param == "allocator_params" and "alpha" in str(err.value)
    with pytest.raises(ConfigError) as err:
        CompressionConfig.make(budget=64, allocator="nope")
    assert err.value.param == "allocator" and "registered" in str(err.value)
    with pytest.raises(ConfigError):
        register_allocator("adakv", AdaKV)  # taken: only replace=True overwrites


def test_adakv_counts_keep_the_total_and_the_floor():
    scores = torch.rand(2, 4, 30)
    scores[:, 0] *= 10  # head 0's scores dominate: it takes the shared slots
    counts = build_allocator("adakv", {"floor": 0.25}).counts(scores, 8)  # (B, Hkv)
    assert counts.sum(-1).tolist() == [32, 32]
    assert int(counts.min()) >= math.floor(8 * 0.25)
    assert counts[:, 0].tolist() == [8 + 3 * 6] * 2  # every other head at its floor of 2
    assert build_allocator("adakv", {"floor": 1.0}).counts(scores, 8).tolist() == [[8] * 4] * 2


def test_adakv_never_counts_a_slot_a_head_may_not_keep():
    scores = torch.rand(1, 2, 10)
    scores[0, 1, 3:] = float("-inf")  # head 1 holds 3 real slots (the rest: padding of an earlier uneven split)
    counts = build_allocator("adakv", {"floor": 1.0}).counts(scores, 4)  # a floor of 4 per head
    assert int(counts[0, 1]) <= 3 and int(counts.sum()) == 8  # head 0 takes what head 1 cannot hold
