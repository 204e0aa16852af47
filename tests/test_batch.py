"""Batched decode (issue 17, first part): one forward for several sessions gives each the logits it would get
alone, whatever their lengths, budgets and compressions."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions.batch import decode_step
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.runner import ModelRunner


def _sessions(runner: ModelRunner, tiered: bool = False) -> list:
    """Three states of different lengths: uncompressed, compressed at two budgets (one of them twice)."""
    g = torch.Generator().manual_seed(3)
    gen = GenerationConfig(max_new_tokens=3, eos_token_ids=())
    states = []
    for length, budget, turns in ((17, None, 1), (60, 40, 1), (45, 24, 2)):
        state = runner.new_state(tiered=tiered)
        comp = CompressionConfig.make(budget=budget, window=4) if budget else None
        for _ in range(turns):
            runner.turn(state, torch.randint(3, 90, (length,), generator=g).tolist(), comp, gen)
        states.append(state)
    return states


@pytest.mark.parametrize(("kind", "tiered"), [("llama", False), ("qwen2", False), ("llama", True)])
def test_a_batched_step_equals_each_session_alone(kind, tiered):
    runner = ModelRunner(build_tiny(kind, layers=3))
    together, alone = _sessions(runner, tiered), _sessions(runner, tiered)
    assert len({s.next_position for s in together}) == 3  # different lengths and positions
    tokens = [s.pending[0] for s in together]
    for s in together + alone:
        s.pending = []
    for _ in range(5):  # greedy, five steps
        batch_logits = decode_step(runner, together, tokens)  # (S, V)
        single = torch.stack([runner.step(s, t) for s, t in zip(alone, tokens, strict=True)])  # (S, V)
        torch.testing.assert_close(batch_logits, single, rtol=1e-4, atol=1e-5)
        assert batch_logits.argmax(-1).tolist() == single.argmax(-1).tolist()
        tokens = single.argmax(-1).tolist()
    for a, b in zip(together, alone, strict=True):  # each cache advanced exactly as alone
        assert a.token_ids == b.token_ids and a.cache_lengths() == b.cache_lengths()
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
        assert all(torch.equal(pa, pb) for pa, pb in zip(a.positions, b.positions, strict=True))


def test_one_token_per_state():
    runner = ModelRunner(build_tiny("llama", layers=2))
    with pytest.raises(ValueError, match="one token per state"):
        decode_step(runner, [runner.new_state()], [1, 2])


def test_slots_grow_as_replies_outrun_their_room_and_stay_equal():
    """Slots are admitted with little room (a long max_new_tokens never allocates its whole reply up front) and
    widen as they fill; every step still equals the sessions stepped alone."""
    from snapkv_sessions.batch import SlotPool

    runner = ModelRunner(build_tiny("llama", layers=2))
    together, alone = _sessions(runner), _sessions(runner)
    tokens = [s.pending[0] for s in together]
    for s in together + alone:
        s.pending = []
    pool = SlotPool(runner.num_layers, 3)
    for state in together:
        pool.admit(state, 1)
    first_width = pool.width
    for _ in range(first_width + 5):  # past the first width
        batch_logits = pool.step(runner, tokens)  # (S, V)
        single = torch.stack([runner.step(s, t) for s, t in zip(alone, tokens, strict=True)])  # (S, V)
        torch.testing.assert_close(batch_logits, single, rtol=1e-4, atol=1e-5)
        tokens = single.argmax(-1).tolist()
    assert pool.width > first_width
    while pool.slots:
        pool.release(0)
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.cache_lengths() == b.cache_lengths()


@pytest.mark.parametrize("static", [False, True])
def test_slots_are_allocated_as_replies_join_and_stepping_between_joins_stays_equal(static):
    """A non-static pool allocates rows as replies join, in powers of two up to its size (one reply alone zeroes
    one slot, not all of them); a static one holds all of them from the first. A reply joining a running batch
    (rows grown under it) leaves every row's logits as each session's alone."""
    from snapkv_sessions.batch import SlotPool

    runner = ModelRunner(build_tiny("llama", layers=2))
    together, alone = _sessions(runner), _sessions(runner)
    tokens = [s.pending[0] for s in together]
    for s in together + alone:
        s.pending = []
    pool = SlotPool(runner.num_layers, 4, static=static)
    rows, held = [], []
    for i, state in enumerate(together):
        pool.admit(state, 1)
        rows.append(pool.rows)
        held.append(pool.nbytes())
        for _ in range(2):  # the admitted so far step together
            batch_logits = pool.step(runner, tokens[: i + 1])  # (i + 1, V)
            single = torch.stack([runner.step(s, t) for s, t in zip(alone[: i + 1], tokens, strict=False)])
            torch.testing.assert_close(batch_logits, single, rtol=1e-4, atol=1e-5)
            tokens[: i + 1] = single.argmax(-1).tolist()
    assert rows == ([4, 4, 4] if static else [1, 2, 4])
    assert held == ([held[0]] * 3 if static else [held[0], 2 * held[0], 4 * held[0]])  # same width throughout
    while pool.slots:
        pool.release(0)
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.cache_lengths() == b.cache_lengths()


@pytest.mark.parametrize("static", [False, True])
def test_an_idle_pool_gives_its_memory_back_and_decodes_the_same_after(static):
    """A long reply widens the slots; once every slot is released a (non-static) pool frees its buffers, and the
    next reply, in a fresh allocation, still gets the logits of a session stepped alone. A static pool keeps its
    buffers (fixed shapes)."""
    from snapkv_sessions.batch import SlotPool

    runner = ModelRunner(build_tiny("llama", layers=2))
    pool = SlotPool(runner.num_layers, 3, static=static)

    def run(steps: int) -> int:
        """``steps`` batched steps of three sessions, checked against each alone; the pool's bytes at the end."""
        together, alone = _sessions(runner), _sessions(runner)
        tokens = [s.pending[0] for s in together]
        for s in together + alone:
            s.pending = []
        for state in together:
            pool.admit(state, 1)
        for _ in range(steps):
            batch_logits = pool.step(runner, tokens)  # (S, V)
            single = torch.stack([runner.step(s, t) for s, t in zip(alone, tokens, strict=True)])  # (S, V)
            torch.testing.assert_close(batch_logits, single, rtol=1e-4, atol=1e-5)
            tokens = single.argmax(-1).tolist()
        held = pool.nbytes()
        while pool.slots:
            pool.release(len(pool.slots) - 1)
        for a, b in zip(together, alone, strict=True):
            assert a.token_ids == b.token_ids and a.cache_lengths() == b.cache_lengths()
        return held

    small = run(1)
    assert pool.nbytes() == (small if static else 0)
    large = run(150)  # widens well past the first width
    assert large > small
    assert pool.nbytes() == (large if static else 0)  # static: fixed shapes, kept; otherwise freed once idle
    assert run(3) == (large if static else small)  # after the shrink (or in the kept buffers): as alone
    assert pool.nbytes() == (large if static else 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_slot_steps_with_no_key_mask_and_the_bits_of_the_step_alone(kind, monkeypatch):
    """A slot that sees every key it spans needs no mask: the step reads what a step alone reads, so one reply in
    the pool (the server's single stream) gets the logits of :meth:`ModelRunner.step` bit for bit."""
    from snapkv_sessions import batch

    runner = ModelRunner(build_tiny(kind, layers=2))
    pooled, alone = _sessions(runner)[1], _sessions(runner)[1]
    token = pooled.pending[0]
    pooled.pending, alone.pending = [], []
    recorded = []

    class Recording(batch.KeyMasks):
        def __setitem__(self, layer, mask):
            recorded.append(mask)
            super().__setitem__(layer, mask)

    monkeypatch.setattr(batch, "KeyMasks", Recording)
    pool = batch.SlotPool(runner.num_layers, 4)
    pool.admit(pooled, 1)
    for _ in range(4):
        got = pool.step(runner, [token])[0]  # (V,)
        want = runner.step(alone, token)
        assert torch.equal(got, want)
        token = int(want.argmax())
    assert len(recorded) == 4 * runner.num_layers and set(recorded) == {None}
