"""Tiered KV memory (issue 14): with the host tier, every turn equals a fresh full prefill compressed with that
turn's window ("re-prefill every turn"), the hot cache stays within its budget, pins stay hot, and a tier
evicted by the byte cap makes its session re-prefill exactly, with an event saying why."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.audit import verify
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.policy import Policy
from snapkv_sessions.runner import ModelRunner
from snapkv_sessions.store.blobs import unpack_positions
from snapkv_sessions.tier import ColdKV, ColdLayer
from snapkv_sessions.tierpool import POOL, TierPool

TURN_LENGTHS = (50, 20, 5, 12, 25)  # the third turn is shorter than the window: it reaches back into the reply
PINNED = range(10, 16)  # tokens of the first turn pinned, as a system prompt's would be


def _turns(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in TURN_LENGTHS]


@pytest.mark.parametrize(("kind", "reply"), [("llama", 6), ("qwen2", 6), ("llama", 1), ("qwen2", 2)])
def test_tiered_turns_equal_reprefill_every_turn(kind, reply):
    """Five turns with pins: kept sets, the hot keys and values, and greedy replies equal those of a fresh full
    prefill compressed with each turn's window; the hot cache never exceeds the budget plus the turn's tokens
    while decoding; the transient buffer is at most one layer's history; pins are always hot.

    With replies of 1 or 2 tokens the third turn feeds fewer tokens than the window (5 and a reply against 8):
    its window reaches back into the previous turn's tokens, as a full prefill's does."""
    runner = ModelRunner(build_tiny(kind, layers=3))
    budget, window = 40, 8
    comp = CompressionConfig.make(budget=budget, window=window)
    gen = GenerationConfig(max_new_tokens=reply, eos_token_ids=())
    tiered, history, history_pins = runner.new_state(tiered=True), [], []
    heads, dim = runner.num_kv_heads, 16
    held: list[int] = []
    step = runner.step

    def watched(state, token):  # the hot cache at every decode step
        held.append(max(state.cache_lengths()))
        return step(state, token)

    runner.step = watched
    for i, ids in enumerate(_turns()):
        # the first turn's pins, as a system prompt's; the second turn's last two tokens, which the short third
        # turn feeds again: their pins must come back with them
        pins = [(i == 0 and j in PINNED) or (i == 1 and j >= len(ids) - 2) for j in range(len(ids))]
        held.clear()
        got = runner.turn(tiered, ids, comp, gen, pinned=pins)
        assert len(held) == len(got.tokens) - 1  # every decode step was watched (the last token stays pending)
        assert max(held, default=budget) <= budget + len(got.tokens)  # budget + this turn's reply, at every step
        ref_state = runner.new_state()
        ref = runner.turn(ref_state, history + ids, comp, gen, pinned=history_pins + pins)
        assert got.tokens == ref.tokens, f"turn {i}"
        assert all(torch.equal(a, b) for a, b in zip(got.kept, ref.kept, strict=True)), f"turn {i}"
        for a, b in zip(tiered.cache.layers, ref_state.cache.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)
        # the pins are hot in every layer and head
        pinned_at = {p for p, flag in enumerate(history_pins + pins) if flag}
        assert torch.equal(tiered.pinned[: got.prefill_end], torch.tensor(history_pins + pins))
        for kept in got.kept:
            assert all(pinned_at <= set(head.tolist()) for head in kept[0])
        # hot and cold together hold every position once; the transient union is one layer's history
        for layer, cold in enumerate(tiered.cold.layers):
            hot = tiered.positions[layer][0]
            both = torch.cat([hot, cold.positions[0]], dim=-1) if cold is not None else hot
            assert torch.equal(both.sort(-1).values, torch.arange(tiered.next_position).expand(heads, -1))
        one_layer = 2 * heads * got.prefill_end * dim * 4  # keys and values, fp32
        assert 0 < got.report.tier["peak_transient_bytes"] <= one_layer
        # cold parts come to the compute device one layer ahead: the one in use and the next, never more
        assert got.report.tier["peak_cold_layers"] == (0 if i == 0 else 2)
        per_slot = 3 * 2 * heads * dim * 4  # all layers, keys and values, fp32
        assert got.report.tier["hot_bytes"] == budget * per_slot  # what decode reads: the budget
        assert got.report.tier["cold_bytes"] == (got.prefill_end - budget) * per_slot  # the rest of the history
        history = history + ids + got.tokens  # the last reply token is pending: fed first by the next turn
        history_pins = history_pins + pins + [False] * len(got.tokens)
    runner.step = step


def test_the_last_reply_is_fed_again():
    """Its KV was decoded against the hot cache alone; the next prefill recomputes it over the whole history."""
    runner = ModelRunner(build_tiny("llama", layers=2))
    comp = CompressionConfig.make(budget=24, window=4)
    gen = GenerationConfig(max_new_tokens=5, eos_token_ids=())
    state = runner.new_state(tiered=True)
    first = runner.turn(state, _turns()[0], comp, gen)
    decoded = state.next_position - first.prefill_end
    assert decoded == len(first.tokens) - 1  # the last token is pending
    second = runner.turn(state, _turns()[1], comp, gen)
    assert second.prompt_tokens == len(_turns()[1])
    assert second.report.context_tokens == first.prefill_end + len(first.tokens) + len(_turns()[1])


def _policy(**memory) -> dict:
    return {"compression": {"budget": 96, "window": 16}, "pins": {"roles": ["system"], "sink_tokens": 4},
            "drift": {"embedder": "none"}, "memory": memory}


SYSTEM = "You are a parcel clerk. Answer with the courier's name only."
DOC = " ".join(f"Parcel {1000 + i} goes to {n}." for i, n in enumerate(
    ["Ada", "Bob", "Cyd", "Dee", "Eve", "Fay", "Gus", "Hal", "Ida", "Jon", "Kim", "Lee", "Max", "Ned", "Oli"]))
QUESTIONS = ["Who gets parcel 1003?", "Who gets parcel 1011?", "Now write a haiku about the sea.",
             "Who gets parcel 1001?", "Who gets parcel 1014?"]


def _kept(store: SessionStore, sid: str) -> list[list]:
    return [[k.tolist() for k in unpack_positions(t["kept_positions"])] for t in store.turns(sid)]


@pytest.mark.slow
def test_tiered_session_equals_reprefill_every_turn(smollm2, tmp_path):
    """SmolLM2, five turns with a system pin and a task shift: a tiered session's replies and kept sets equal
    those of a session that re-prefills every turn; it never re-prefills, and replay --verify re-executes it."""
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    every = {**_policy(cold=False), "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill",
                                              "follow_ups": False},
             "recovery": {"min_turns_between": 0}}
    sessions = {}
    for name, policy in (("tiered", _policy()), ("every", every)):
        s = Session.create(smollm2, policy=policy, store=store, system=SYSTEM)
        s.add_document(DOC, name="parcels")
        for q in QUESTIONS:
            s.chat(q, max_new_tokens=8)
        sessions[name] = s
    tiered, every_turn = (store.turns(sessions[n].id) for n in ("tiered", "every"))
    assert [t["drift_decision"] for t in every_turn][1:] == ["reprefill"] * 4
    assert all(t["drift_decision"] != "reprefill" for t in tiered)
    assert [t["decode_tokens"] for t in tiered] == [t["decode_tokens"] for t in every_turn]
    assert _kept(store, sessions["tiered"].id) == _kept(store, sessions["every"].id)
    assert all(t["compression"]["tier"]["cold_bytes"] > 0 for t in tiered[1:])
    # replay --turn lists the positions that came back from cold: as many as the turn's record counts
    from snapkv_sessions.audit import turn_detail

    for t in tiered[1:]:
        detail = turn_detail(store, sessions["tiered"].id, t["turn"])
        assert sum(len(h["recalled"]) for layer in detail["layers"] for h in layer) == t["compression"]["tier"]["recalled"]
    result = verify(store, sessions["tiered"].id, smollm2)
    assert result.ok and result.turns_checked == len(QUESTIONS), result


@pytest.mark.slow
@pytest.mark.parametrize("spill", [False, True])
def test_a_small_cap_evicts_the_least_recent_tier(smollm2, tmp_path, spill):
    """Two sessions under a cap that holds one tier: the least recently used one is evicted. Without a spill
    directory its next turn re-prefills, with an event saying why, and stays exact; with one, the tier is read
    back from disk and the turn needs no re-prefill."""
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    memory = {"spill_dir": str(tmp_path / "spill") if spill else None}
    try:
        a = Session.create(smollm2, policy=_policy(**memory), store=store, system=SYSTEM)
        b = Session.create(smollm2, policy=_policy(**memory), store=store, system=SYSTEM)
        for s in (a, b):
            s.add_document(DOC, name="parcels")
        a.chat(QUESTIONS[0], max_new_tokens=8)
        POOL.configure(a.state.cold.nbytes * 3 // 2, memory["spill_dir"])  # room for one session's tier
        b.chat(QUESTIONS[0], max_new_tokens=8)  # b is the most recent: a's tier goes
        assert b.state.cold.lost is None
        if spill:
            assert a.state.cold.spilled is not None and a.state.cold.lost is None
        else:
            assert a.state.cold.lost.startswith("evicted by the cold tier's byte cap")
        reply = a.chat(QUESTIONS[1], max_new_tokens=8)
        decision = store.turns(a.id)[-1]["drift_decision"]
        if spill:  # read back: no re-prefill; now b is the least recent, and on disk
            assert decision != "reprefill" and a.state.cold.spilled is None and a.state.cold.nbytes > 0
            assert b.state.cold.spilled is not None and len(list((tmp_path / "spill").glob("*.safetensors"))) == 1
        else:
            assert decision == "reprefill"
            assert any(kind == "tier_lost" and p["reason"].startswith("evicted by the cold tier's byte cap")
                       for kind, p in reply.events)
        result = verify(store, a.id, smollm2)
        assert result.ok, result
    finally:
        POOL.reset()


def test_policy_memory_is_stated_at_creation_and_old_hashes_stay():
    """A policy that does not state memory hashes as before the section existed; a new session states it."""
    old = Policy.from_dict({"compression": {"budget": 64, "window": 8}})
    assert "memory" not in json.loads(old.canonical_json()) and old.memory is None and not old.tiered
    stated = old.stated()
    assert stated.tiered and stated.memory.on_shift == "tier" and stated.sha256 != old.sha256
    assert Policy.from_yaml(stated.canonical_json()).sha256 == stated.sha256
    off = Policy.from_dict({"memory": {"cold": False}})
    assert off.stated().memory is off.memory and not off.stated().tiered


def test_dynamic_cache_refuses_the_tier():
    runner = ModelRunner(build_tiny("llama", layers=2), cache="dynamic")
    with pytest.raises(Exception, match="compact"):
        runner.new_state(tiered=True)


def test_keeping_the_reply_is_a_policy_choice():
    """memory.refeed_reply: false keeps the reply's decoded KV: the next prefill feeds only the pending token and
    the new tokens, and its result differs from the exact (re-fed) turn's only through the reply's KV."""
    runner = ModelRunner(build_tiny("llama", layers=2))
    comp = CompressionConfig.make(budget=24, window=4)
    gen = GenerationConfig(max_new_tokens=5, eos_token_ids=())
    fed = []
    forward = runner._forward

    def counting(state, ids, probe, **kw):
        fed.append(len(ids))
        return forward(state, ids, probe, **kw)

    runner._forward = counting
    for refeed in (True, False):
        state = runner.new_state(tiered=True)
        state.cold.refeed_reply = refeed
        first = runner.turn(state, _turns()[0], comp, gen)
        fed.clear()
        runner.turn(state, _turns()[1], comp, gen)
        reply_decoded = len(first.tokens) - 1  # the last token was pending
        assert fed[0] == (reply_decoded if refeed else 0) + 1 + len(_turns()[1])


def _cold(n_bytes_per_layer: int = 64) -> ColdKV:
    n = n_bytes_per_layer // 8  # keys and values of n float32 slots of one dim
    layer = ColdLayer(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), torch.arange(n).view(1, 1, n))
    return ColdKV(layers=[layer])


def test_the_pool_never_evicts_a_tier_in_use(tmp_path):
    """The least recently used idle tier goes first; one a running turn holds stays, whatever its age. A spill
    that fails drops the tier with the reason instead of raising."""
    pool = TierPool(max_bytes=100)
    a, b = _cold(), _cold()
    pool.touch(a)  # a's turn starts, and is still running
    pool.touch(b)
    pool.done(b)
    assert pool.enforce() == [b] and b.lost.startswith("evicted by the cold tier's byte cap") and a.lost is None
    pool.done(a)
    c = _cold()
    pool.touch(c)
    pool.done(c)
    assert pool.enforce() == [a]  # now idle, and the least recent
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    pool.reset(max_bytes=10, spill_dir=blocked / "spill")
    assert pool.enforce() == [c] and "its spill failed" in c.lost and c.spilled is None


def test_the_pool_forgets_dropped_sessions():
    pool = TierPool(max_bytes=10_000)
    pool.touch(_cold())  # nobody keeps it
    kept = _cold()
    pool.touch(kept)
    assert len(pool._tiers) == 1 and pool.nbytes == kept.nbytes


def test_chunked_prefill_feeds_every_token_once():
    """A window longer than the last chunk moves the last cut back over earlier cuts, never before them."""
    model = build_tiny("llama", layers=2)
    ids = _turns()[0][:10]
    whole, chunked = ModelRunner(model), ModelRunner(model, prefill_chunk=4)
    a, b = whole.new_state(), chunked.new_state()
    logits_a, probe_a = whole.prefill(a, ids, window=6)
    logits_b, probe_b = chunked.prefill(b, ids, window=6)
    assert a.next_position == b.next_position == 10 and a.token_ids == b.token_ids
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-5)
    for layer in range(2):
        torch.testing.assert_close(probe_a.scores[layer], probe_b.scores[layer], rtol=1e-4, atol=1e-6)
