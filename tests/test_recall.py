"""Decode-time recall from the cold tier: equal to the full cache when it recalls everything, to the tiered decode
when it recalls nothing, to a masked-attention reference allowing exactly what each selector chose; batched rows
equal each session alone; the policy keys; a stored session through replay --verify."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import build_tiny
from reference import full_logits_masked

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.batch import decode_step
from snapkv_sessions.config import RecallConfig
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.policy import Policy, PolicyError

GREEDY = GenerationConfig(max_new_tokens=8, eos_token_ids=())
HOT = CompressionConfig.make(budget=16, window=4, kernel=3)
SELECTORS = [{"selector": "exact"}, {"selector": "sparq", "channels": 4}, {"selector": "pages", "page": 3},
             {"selector": "lowrank", "rank": 3},
             # ranked by the group's attention mass, per head and shared over a layer's heads
             {"selector": "exact", "reduce": "mass"}, {"selector": "sparq", "channels": 4, "reduce": "mass"},
             {"selector": "lowrank", "rank": 3, "reduce": "mass", "share": "layer"},
             {"selector": "exact", "reduce": "mass", "share": "layer"}]


def _name(select: dict) -> str:
    return "-".join(str(select[k]) for k in ("selector", "reduce", "share") if k in select)


def prompt(n: int, seed: int = 1, vocab: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def turns(runner: ModelRunner, state, cfg) -> list[list[int]]:
    """Three turns' greedy replies (the later turns feed each reply back, so every turn depends on the last)."""
    return [runner.turn(state, prompt(40 if t == 0 else 8, seed=t + 1), cfg, GREEDY).tokens for t in range(3)]


@pytest.mark.parametrize("select", SELECTORS, ids=_name)
def test_recalling_every_cold_slot_equals_the_full_cache(tiny_kind, select):
    runner = ModelRunner(build_tiny(tiny_kind, seed=3))
    full = runner.new_state()
    recall = runner.new_state(tiered=True, recall=RecallConfig.make(ratio=1.0, **select))
    assert turns(runner, recall, HOT) == turns(runner, full, CompressionConfig.make(budget=10_000, window=4))
    assert recall.reports[-1].compressed  # the hot cache held 16 of ~100 positions
    # the logits too: one more turn's prefill (its run leaves the turn's decode open), then step by step
    for state, cfg in ((recall, HOT), (full, None)):
        runner.run(state, *_plan(runner, state, prompt(6, seed=9), cfg))
    logits = [[runner.step(s, t) for t in (5, 7, 11)] for s in (recall, full)]
    for a, b in zip(*logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _plan(runner, state, ids, cfg):
    from snapkv_sessions.transcript import TurnPlan, observation_window

    first = state.next_position + len(state.pending)
    window = observation_window(4, len(state.pending) + len(ids), first + len(ids)) if cfg else None
    return TurnPlan(tokens=tuple(ids), first_position=first, pinned=(), window=window), cfg


def test_recall_of_nothing_equals_the_tiered_decode():
    runner = ModelRunner(build_tiny("qwen2", seed=3))
    zero = runner.new_state(tiered=True, recall=RecallConfig.make(budget=0))
    plain = runner.new_state(tiered=True)
    assert turns(runner, zero, HOT) == turns(runner, plain, HOT)
    assert zero.reports[-1].tier["recall"]["recalled_per_step"] == 0
    # and recall does change the replies here (the test is not vacuous)
    some = runner.new_state(tiered=True, recall=RecallConfig.make(budget=6))
    assert turns(runner, some, HOT) != turns(runner, runner.new_state(tiered=True), HOT)


@pytest.mark.parametrize("select", SELECTORS, ids=_name)
def test_each_selector_equals_masked_attention_over_what_it_chose(tiny_kind, select):
    """Every decode step's logits equal full eager attention where the step's row sees exactly: the hot set
    after the compression, this turn's decoded tokens, and the cold positions the selector recalled."""
    model = build_tiny(tiny_kind, seed=4)
    runner = ModelRunner(model)
    state = runner.new_state(tiered=True, recall=RecallConfig.make(budget=5, **select))
    ids = prompt(48, seed=5)
    logits, probe = runner.prefill(state, ids, window=4)
    runner.compress(state, HOT, probe)
    state.cache.prefill_done(state)
    hot = [[{p for p in row if p >= 0} for row in k[0].tolist()] for k in state.held()]
    recalled: dict[tuple[int, int], list[set[int]]] = {}  # (position, layer) -> per head, recalled positions
    got: dict[int, torch.Tensor] = {}
    # the step's query position is the state's next position while the step runs (appended after the forward)
    state.cache.current_recall.observer = lambda layer, pos: recalled.__setitem__(
        (state.next_position, layer), [{p for p in row if p >= 0} for row in pos[0].tolist()])
    for _ in range(6):
        at = state.next_position
        logits = runner.step(state, int(logits.argmax()))
        got[at] = logits
    report = state.cache.decode_done(state)
    assert report["steps"] == 6 and report["recalled_per_step"] > 0
    assert_steps_equal_masked_attention(runner, model, state, got, hot, recalled, len(ids))
    assert any(recalled[(at, 0)][0] for at in got)  # something was recalled


def assert_steps_equal_masked_attention(runner, model, state, got: dict, hot: list, recalled: dict,
                                        prompt_len: int) -> None:
    """Each decode step's logits ``got[at]`` equal full eager attention whose row ``at`` sees, per layer and KV head,
    exactly: the hot set ``hot[layer][h]``, what the step recalled ``recalled[(at, layer)][h]`` and the turn's
    tokens from ``prompt_len`` on (the decoded ones)."""
    total = state.next_position
    heads = runner.num_kv_heads
    masks = []
    for layer in range(runner.num_layers):
        mask = torch.ones(total, total, dtype=torch.bool).tril().expand(heads, total, total).clone()  # (Hkv, T, T)
        for at in got:
            for h in range(heads):
                row = torch.zeros(total, dtype=torch.bool)  # (T,)
                row[sorted(hot[layer][h] | recalled[(at, layer)][h] | set(range(prompt_len, at + 1)))] = True
                mask[h, at] = row
        masks.append(mask)
    runner.detach()
    ref = full_logits_masked(model, state.token_ids, masks)  # (T, V)
    for at, logits in got.items():
        torch.testing.assert_close(logits, ref[at], rtol=1e-4, atol=1e-4)


def step_together_and_alone(runner: ModelRunner, states: list, steps: int = 3) -> None:
    """Decode ``states`` (each a turn's state, its last token pending) in batched steps and copies of them one by
    one: every batched row's logits equal its copy's step alone."""
    alone = [s.clone() for s in states]
    tokens = [s.pending[0] for s in states]
    for s in states + alone:
        s.pending = []
        s.cache.prefill_done(s)  # a turn's decode: recall is on
    for _ in range(steps):
        batched = decode_step(runner, states, tokens)  # (n, V)
        for i, s in enumerate(alone):
            torch.testing.assert_close(batched[i], runner.step(s, tokens[i]), rtol=1e-5, atol=1e-5)
        tokens = [int(row.argmax()) for row in batched]


def test_batched_slots_recall_their_own_and_equal_each_alone():
    runner = ModelRunner(build_tiny("llama", seed=3))
    short = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    a = runner.new_state(tiered=True, recall=RecallConfig.make(budget=5))
    runner.turn(a, prompt(40), HOT, short)
    b = runner.new_state(tiered=True, recall=RecallConfig.make(budget=3, selector="pages", page=2))
    runner.turn(b, prompt(30, seed=3), HOT, short)
    c = runner.new_state()  # no tier at all, in the same batch
    runner.turn(c, prompt(25, seed=4), HOT, short)
    step_together_and_alone(runner, [a, b, c])
    assert a.cache.decode_done(a)["recalled_per_step"] > 0


def test_recall_policy_is_validated_and_off_by_default():
    plain = Policy.from_dict({"memory": {"cold": True}})
    assert plain.memory.recall is None
    assert plain.sha256 == Policy.from_dict({"memory": {"cold": True, "recall": None}}).sha256
    on = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "selector": "pages", "page": 8}}})
    assert on.memory.recall == RecallConfig.make(ratio=0.1, selector="pages", page=8)
    assert on.sha256 != Policy.from_dict({"memory": {}}).sha256
    for bad, field in (({"ratio": 1.5}, "memory.recall.ratio"), ({"budget": 2, "ratio": 0.1}, "memory.recall"),
                       ({"ratio": 0.1, "selector": "nope"}, "memory.recall.selector"),
                       ({"ratio": 0.1, "page": 0}, "memory.recall.page"), ({"ratio": 0.1, "x": 1}, "memory.recall.x"),
                       ({"ratio": 0.1, "rank": 0}, "memory.recall.rank")):
        with pytest.raises(PolicyError) as err:
            Policy.from_dict({"memory": {"recall": bad}})
        assert err.value.param == field, (bad, err.value)
    with pytest.raises(ConfigError):
        ModelRunner(build_tiny("llama"), cache="dynamic").new_state(recall=RecallConfig.make(budget=1))
    # the low-rank selector's rank came later: at its default a recall policy's JSON (and hash) is as before
    assert '"rank"' not in on.canonical_json()
    ranked = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "selector": "pages", "page": 8, "rank": 8}}})
    assert '"rank":8' in ranked.canonical_json() and ranked.sha256 != on.sha256


@pytest.mark.slow
def test_a_stored_session_with_recall_equals_the_full_cache_and_verifies(smollm2, tmp_path):
    """SmolLM2: a tiered session recalling every cold slot answers as a session whose budget holds everything;
    its turn records carry the recall figures, and replay --verify re-executes it identically."""
    from snapkv_sessions import Session, SessionStore
    from snapkv_sessions.audit import verify

    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    questions = ("Name three colours.", "Which of them is the warmest?", "Say the first one again.")
    replies = {}
    for name, memory, budget in (("recall", {"cold": True, "recall": {"ratio": 1.0}}, 40),
                                 ("full", {"cold": False}, 100_000)):
        policy = {"compression": {"budget": budget, "window": 8}, "memory": memory}
        session = Session.create(smollm2, policy=policy, store=store, system="You are brief.")
        replies[name] = [session.chat(q, max_new_tokens=12).token_ids for q in questions]
        replies[name + "_id"] = session.id
    assert replies["recall"] == replies["full"]
    recs = store.turns(replies["recall_id"], status="done")
    figures = [r.compression["tier"]["recall"] for r in recs if r.compression and r.compression.get("tier")
               and "recall" in r.compression["tier"]]
    assert figures and all(f["steps"] > 0 and f["recalled_per_step"] > 0 for f in figures)
    assert verify(store, replies["recall_id"], smollm2).ok
    # the audit: --find names the evicted tokens decode recalled (here every cold slot, so every evicted one)
    from snapkv_sessions.audit import find

    found = find(store, replies["recall_id"], "colours", model=smollm2)
    checked = 0
    for occ in found["occurrences"]:
        for t in occ["turns"]:
            evicting = sum(bool(h["evicted"]) for lay in t["layers"] for h in lay["heads"])
            if evicting and "decode_recalled" in t:
                assert t["decode_recalled"]["pairs_recalling_every_evicted"] == evicting
                checked += 1
    assert checked
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    db = ["--db", f"sqlite:///{tmp_path / 's.db'}"]
    table = CliRunner().invoke(main, ["replay", replies["recall_id"], *db])
    assert table.exit_code == 0 and "decode recall" in table.output, table.output
    last = recs[-1].turn
    detail = CliRunner().invoke(main, ["replay", replies["recall_id"], "--turn", str(last), *db])
    assert detail.exit_code == 0 and "decode recalled from the tier per step" in detail.output, detail.output


def test_page_bounds_bound_every_key_of_their_page():
    """Quest's bound sum_d max(q_d min_d, q_d max_d) is at least every q.k of the page (padding left out)."""
    from snapkv_sessions.recall import Pages

    torch.manual_seed(0)
    query, keys = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 95, 16)  # (B, Hkv, G, D), (B, Hkv, C, D)
    real = torch.rand(1, 2, 95) > 0.2
    low, high = Pages(page=10).bounds(keys, real)  # (B, Hkv, 10, D)
    bound = torch.maximum(query[:, :, :, None] * low[:, :, None], query[:, :, :, None] * high[:, :, None]).sum(-1)
    scores = torch.einsum("bhgd,bhcd->bhgc", query, keys).masked_fill(~real[:, :, None], float("-inf"))
    padded = torch.cat([scores, scores.new_full((1, 2, 3, 5), float("-inf"))], dim=-1)  # (B, Hkv, G, 100)
    best = padded.view(1, 2, 3, 10, 10).amax(-1)  # (B, Hkv, G, pages)
    assert bool((bound >= best - 1e-5).all())


def test_rotary_undoes_the_models_rope_on_cached_keys(tiny_kind):
    """The cached keys with their rotation undone at their true positions equal the layer's key projection
    before RoPE (what the low-rank selector fits)."""
    model = build_tiny(tiny_kind, seed=6)
    runner = ModelRunner(model)
    assert runner.rotary is not None
    seen: list[torch.Tensor] = []
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out))
    state = runner.new_state(tiered=True)
    runner.prefill(state, prompt(23, seed=2), window=4)
    hook.remove()
    heads = runner.num_kv_heads
    pre = seen[0].view(1, 23, heads, -1).transpose(1, 2)  # (B, Hkv, T, D) before RoPE
    keys = state.cache.layers[1].keys[:, :, :23]  # (B, Hkv, T, D) as cached, after RoPE
    positions = torch.arange(23).expand(1, heads, 23)  # (B, Hkv, T)
    torch.testing.assert_close(runner.rotary.apply(keys, positions, inverse=True), pre, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runner.rotary.apply(pre, positions), keys, rtol=1e-4, atol=1e-5)


def test_rotary_scores_equal_the_query_against_the_rotated_keys(tiny_kind):
    """``Rotary.scores`` (the rotation moved onto the query) equals the query against the keys rotated to their
    positions, for the model's halves layout and through the fallback for any other."""
    import dataclasses

    rotary = ModelRunner(build_tiny(tiny_kind, seed=6)).rotary
    assert rotary.halves  # Llama-family modules repeat cos and sin across the halves
    torch.manual_seed(3)
    dim = rotary.module.inv_freq.shape[0] * 2
    query, keys = torch.randn(1, 2, 3, dim), torch.randn(1, 2, 40, dim)  # (B, Hkv, G, D), (B, Hkv, C, D)
    positions = torch.arange(7, 167, 4).expand(1, 2, 40)  # (B, Hkv, C)
    ref = query @ rotary.apply(keys, positions).transpose(-1, -2)  # (B, Hkv, G, C)
    torch.testing.assert_close(rotary.scores(query, keys, positions), ref, rtol=1e-5, atol=1e-5)
    other = dataclasses.replace(rotary, halves=False)
    torch.testing.assert_close(other.scores(query, keys, positions), ref, rtol=1e-5, atol=1e-5)


def test_slot_mask_counts_a_repeated_slot_once_attended():
    """A short last page repeats the last slot, not attended: the mask still holds the slot where any copy of it is
    attended, and the flat-view gather returns each slot's row."""
    from snapkv_sessions.recall import gather_slots, slot_mask

    idx = torch.tensor([[[5, 9, 9, 9], [9, 9, 2, 0]]])  # (B, Hkv, K): slot 9 repeated
    attend = torch.tensor([[[True, True, False, False], [False, True, False, True]]])
    got = slot_mask(idx, attend, 10)  # (B, Hkv, C)
    want = torch.zeros(1, 2, 10, dtype=torch.bool)
    want[0, 0, [5, 9]] = True
    want[0, 1, [9, 0]] = True
    assert torch.equal(got, want)
    x = torch.randn(1, 2, 10, 4)  # (B, Hkv, C, D)
    assert torch.equal(gather_slots(x, idx), x.gather(2, idx[..., None].expand(-1, -1, -1, 4)))
    strided = x.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, not contiguous
    assert torch.equal(gather_slots(strided, idx), gather_slots(x, idx))


def test_lowrank_at_full_rank_chooses_what_exact_chooses():
    """At rank D the fit is the keys themselves: the same slots as full dot products; a low rank differs."""
    from snapkv_sessions.recall import Exact, LowRank

    model = build_tiny("qwen2", seed=6)
    rotary = ModelRunner(model).rotary
    torch.manual_seed(0)
    dim = model.config.hidden_size // model.config.num_attention_heads
    query, keys = torch.randn(1, 2, 3, dim), torch.randn(1, 2, 60, dim)  # (B, Hkv, G, D), (B, Hkv, C, D)
    positions = torch.arange(5, 125, 2).expand(1, 2, 60)  # (B, Hkv, C) sorted true positions, with gaps
    real = torch.rand(1, 2, 60) > 0.1
    ref = Exact().choose(query, keys, real, 12, positions)[0].sort(-1).values
    full = LowRank(rank=dim, rotary=rotary).choose(query, keys, real, 12, positions)[0].sort(-1).values
    assert torch.equal(full, ref)
    low = LowRank(rank=1, rotary=rotary)
    assert not torch.equal(low.choose(query, keys, real, 12, positions)[0].sort(-1).values, ref)
    assert low.summary_bytes(keys) == 2 * (60 * 1 + 1 * dim) * 4  # A and V per head, fp32


def test_attention_mass_is_the_groups_softmax_over_hot_and_cold():
    """Each cold slot's mass equals, summed over its group's query heads, the softmax probability it gets in one
    softmax over the (visible) hot keys and every real cold slot; SparQ over all channels estimates it exactly."""
    from snapkv_sessions.recall import Exact, HotKeys, SparQ, attention_mass

    torch.manual_seed(1)
    query = torch.randn(2, 2, 3, 8)  # (B, Hkv, G, D)
    cold, hot = torch.randn(2, 2, 30, 8), torch.randn(2, 2, 12, 8)  # (B, Hkv, C, D), (B, Hkv, T, D)
    real = torch.rand(2, 2, 30) > 0.2
    visible = torch.rand(2, 2, 1, 12) > 0.3  # (B, Hkv, 1, T)
    scale = 8 ** -0.5
    logits = Exact().logits(query, cold, real, None)
    got = attention_mass(query, logits, real, HotKeys(hot, visible, scale))  # (B, Hkv, C)
    both = torch.cat([torch.einsum("bhgd,bhtd->bhgt", query, hot).masked_fill(~visible, float("-inf")),
                      torch.einsum("bhgd,bhcd->bhgc", query, cold).masked_fill(~real[:, :, None], float("-inf"))],
                     dim=-1) * scale  # (B, Hkv, G, T + C)
    ref = both.softmax(-1)[..., 12:].sum(dim=2)  # (B, Hkv, C)
    torch.testing.assert_close(got, ref)
    assert bool((got[~real] == 0).all())
    sparq = SparQ(channels=8).logits(query, cold, real, None)
    torch.testing.assert_close(attention_mass(query, sparq, real, HotKeys(hot, visible, scale)), ref)
    assert SparQ(channels=8).choose(query, cold, real, 5, None)[0].shape == (2, 2, 5)


def test_a_layer_shares_its_recall_by_mass():
    """share: layer takes the k x heads most massive slots over all heads together: a head whose mass is spread
    gets more than k, padding is never chosen, and per-head top-k is what share: head takes."""
    from snapkv_sessions.recall import _top, _top_shared

    mass = torch.tensor([[[0.50, 0.30, 0.01, 0.00, 0.00],  # head 0: two slots hold it
                          [0.20, 0.19, 0.18, 0.17, 0.16]]])  # head 1: spread out; (B, Hkv, C)
    real = torch.tensor([[[True] * 5, [True, True, True, True, False]]])
    idx, attend = _top_shared(mass, real, 2)  # 4 slots in all
    chosen = [sorted(i for i, a in zip(row, ok, strict=True) if a) for row, ok in zip(idx[0].tolist(), attend[0].tolist(),
                                                                                     strict=True)]
    assert chosen == [[0, 1], [0, 1]]
    idx, attend = _top_shared(mass, real, 3)  # 6 slots: 0.5, 0.3, 0.2, 0.19, 0.18, 0.17 (not head 1's padding)
    chosen = [sorted(i for i, a in zip(row, ok, strict=True) if a) for row, ok in zip(idx[0].tolist(), attend[0].tolist(),
                                                                                     strict=True)]
    assert chosen == [[0, 1], [0, 1, 2, 3]]
    per_head = _top(mass, real, 3)[0].sort(-1).values
    assert per_head.tolist() == [[[0, 1, 2], [0, 1, 2]]]


def test_mass_recall_in_batched_slots_equals_each_alone():
    runner = ModelRunner(build_tiny("qwen2", seed=3))
    short = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    a = runner.new_state(tiered=True, recall=RecallConfig.make(budget=4, reduce="mass", share="layer"))
    runner.turn(a, prompt(40), HOT, short)
    b = runner.new_state(tiered=True, recall=RecallConfig.make(budget=3, selector="lowrank", rank=2, reduce="mass"))
    runner.turn(b, prompt(33, seed=3), HOT, short)
    step_together_and_alone(runner, [a, b])
    figures = a.cache.decode_done(a)
    assert figures["recalled_per_step"] > 0
    # the hot keys read for the normalisers count in the selector's bytes: more than the cold keys alone
    plain = runner.new_state(tiered=True, recall=RecallConfig.make(budget=4))
    runner.turn(plain, prompt(40), HOT, short)
    assert figures["read_bytes_per_step"]["select"] > plain.reports[-1].tier["recall"]["read_bytes_per_step"]["select"]


def test_mass_options_are_validated_and_keep_stored_hashes():
    before = Policy.from_dict({"memory": {"recall": {"ratio": 0.1}}})
    same = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "reduce": "max", "share": "head"}}})
    assert before.sha256 == same.sha256 and '"reduce"' not in before.canonical_json()
    mass = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "reduce": "mass", "share": "layer"}}})
    assert mass.sha256 != before.sha256 and mass.memory.recall.share == "layer"
    for bad, field in (({"ratio": 0.1, "selector": "pages", "reduce": "mass"}, "memory.recall.reduce"),
                       ({"ratio": 0.1, "share": "layer"}, "memory.recall.share"),
                       ({"ratio": 0.1, "reduce": "sum"}, "memory.recall.reduce"),
                       ({"ratio": 0.1, "share": "model"}, "memory.recall.share")):
        with pytest.raises(PolicyError) as err:
            Policy.from_dict({"memory": {"recall": bad}})
        assert err.value.param == field, (bad, err.value)


# ------------------------------------------------------------------ the tail: what a step leaves out, estimated


@pytest.mark.parametrize("budget", [0, 2])
def test_an_exact_tail_of_one_slot_pages_equals_the_full_cache(tiny_kind, budget):
    """With exact logits and each slot its own page, the estimate of what is not recalled is exact: the step
    equals full attention whatever the recall budget."""
    runner = ModelRunner(build_tiny(tiny_kind, seed=3))
    full = runner.new_state()
    tail = runner.new_state(tiered=True, recall=RecallConfig.make(budget=budget, tail="pages", tail_page=1))
    assert turns(runner, tail, HOT) == turns(runner, full, CompressionConfig.make(budget=10_000, window=4))
    assert tail.reports[-1].compressed
    for state, cfg in ((tail, HOT), (full, None)):
        runner.run(state, *_plan(runner, state, prompt(6, seed=9), cfg))
    logits = [[runner.step(s, t) for t in (5, 7, 11)] for s in (tail, full)]
    for a, b in zip(*logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and dropping the same tail does not (the test is not vacuous)
    drop = runner.new_state(tiered=True, recall=RecallConfig.make(budget=budget))
    assert turns(runner, drop, HOT) != turns(runner, runner.new_state(), CompressionConfig.make(budget=10_000, window=4))


class _Cold:
    """One layer's cold part, as the tier hands it to a Recall."""

    def __init__(self, keys, values, real, positions):
        self.keys, self.values, self.real, self.positions = keys, values, real, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("select", [{"selector": "lowrank", "rank": 2}, {"selector": "sparq", "channels": 3,
                                                                           "reduce": "mass"}], ids=_name)
def test_the_tail_equals_its_formula(select, dtype):
    """One decode step's attention output, computed slot by slot in float64: the hot and recalled slots with their
    exact logits and values, every other real cold slot with the selector's logit and its page's mean value."""
    from types import SimpleNamespace

    from snapkv_sessions.attention import causal_sdpa, with_recalled
    from snapkv_sessions.recall import Recall, RecallStats

    g = torch.Generator().manual_seed(0)
    bsz, n_kv, group, dim, hot_n, cold_n, page = 1, 2, 3, 8, 5, 11, 4
    query = torch.randn(bsz, n_kv * group, 1, dim, generator=g)
    hot_k, hot_v = torch.randn(2, bsz, n_kv, hot_n, dim, generator=g)
    cold_k, cold_v = torch.randn(2, bsz, n_kv, cold_n, dim, generator=g)
    real = torch.ones(bsz, n_kv, cold_n, dtype=torch.bool)
    real[0, 1, -3:] = False  # head 1 keeps fewer cold slots: its last three are padding
    positions = torch.arange(cold_n).expand(bsz, n_kv, cold_n)
    cfg = RecallConfig.make(budget=3, tail="pages", tail_page=page, **select)
    recall = Recall(cfg, SimpleNamespace(layers=[_Cold(cold_k, cold_v, real, positions)]), RecallStats())
    chosen: list[torch.Tensor] = []
    recall.observer = lambda layer, pos: chosen.append(pos)
    scale = 0.3
    q, hk, hv = (t.to(dtype) for t in (query, hot_k, hot_v))
    key, value, bias = with_recalled(recall, 0, q, hk, hv, None, scale)
    got = causal_sdpa(q, key, value, scale, bias)[0, 0]  # (Hq, D)
    grouped = query.view(bsz, n_kv, group, dim)
    estimate = recall.selector.logits(grouped, cold_k, real, positions)  # (B, Hkv, G, C)
    for h in range(n_kv):
        picked = {int(p) for p in chosen[0][0, h] if p >= 0}
        means = {}
        for p0 in range(0, cold_n, page):
            rows = [i for i in range(p0, min(p0 + page, cold_n)) if real[0, h, i]]
            means[p0 // page] = cold_v[0, h, rows].double().mean(0) if rows else torch.zeros(dim, dtype=torch.float64)
        for j in range(group):
            qh = query[0, h * group + j, 0].double()
            weights, vals = [], []
            for i in range(hot_n):
                weights.append(float(qh @ hot_k[0, h, i].double()) * scale)
                vals.append(hot_v[0, h, i].double())
            for i in range(cold_n):
                if not real[0, h, i]:
                    continue
                if i in picked:
                    weights.append(float(qh @ cold_k[0, h, i].double()) * scale)
                    vals.append(cold_v[0, h, i].double())
                else:
                    weights.append(float(estimate[0, h, j, i]) * scale)
                    vals.append(means[i // page])
            p = torch.tensor(weights, dtype=torch.float64).softmax(0)
            want = (p[:, None] * torch.stack(vals)).sum(0)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got[h * group + j].double(), want, rtol=tol, atol=tol)
    assert all(len({int(p) for p in chosen[0][0, h] if p >= 0}) == 3 for h in range(n_kv))


def test_tail_recall_in_batched_slots_equals_each_alone():
    runner = ModelRunner(build_tiny("qwen2", seed=3))
    short = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    a = runner.new_state(tiered=True, recall=RecallConfig.make(budget=4, selector="lowrank", rank=2, reduce="mass",
                                                                tail="pages", tail_page=3))
    runner.turn(a, prompt(40), HOT, short)
    b = runner.new_state(tiered=True, recall=RecallConfig.make(budget=3))  # no tail, in the same batch
    runner.turn(b, prompt(33, seed=3), HOT, short)
    step_together_and_alone(runner, [a, b])
    figures = a.cache.decode_done(a)
    # the page means count where the selector scores: more than the same recall without a tail
    plain = runner.new_state(tiered=True, recall=RecallConfig.make(budget=4, selector="lowrank", rank=2,
                                                                    reduce="mass"))
    runner.turn(plain, prompt(40), HOT, short)
    assert figures["summary_bytes"] > plain.reports[-1].tier["recall"]["summary_bytes"]


def test_tail_options_are_validated_and_keep_stored_hashes():
    before = Policy.from_dict({"memory": {"recall": {"ratio": 0.1}}})
    same = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "tail": "drop", "tail_page": 32}}})
    assert before.sha256 == same.sha256 and '"tail' not in before.canonical_json()
    tail = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "tail": "pages"}}})
    assert tail.sha256 != before.sha256
    for bad, field in (({"ratio": 0.1, "selector": "pages", "tail": "pages"}, "memory.recall.tail"),
                       ({"ratio": 0.1, "tail": "pages", "tail_page": 0}, "memory.recall.tail_page"),
                       ({"ratio": 0.1, "tail": "mean"}, "memory.recall.tail")):
        with pytest.raises(PolicyError) as err:
            Policy.from_dict({"memory": {"recall": bad}})
        assert err.value.param == field, (bad, err.value)


# ------------------------------------------------------------------ escalation: a near-tie taken again with every slot


ALWAYS = 1e9  # every step's two best logits are within this margin: every step is taken again


@pytest.mark.parametrize("select", [{"selector": "exact"}, {"selector": "lowrank", "rank": 3, "reduce": "mass",
                                                              "tail": "pages", "tail_page": 3}],
                         ids=_name)
def test_escalating_every_step_equals_the_full_cache(tiny_kind, select):
    """A retaken step attends to every cold slot: with every step retaken, a recall of 1 slot decodes what the
    full cache does (tokens and logits), and the retakes are counted."""
    runner = ModelRunner(build_tiny(tiny_kind, seed=3))
    full = runner.new_state()
    esc = runner.new_state(tiered=True, recall=RecallConfig.make(budget=1, escalate=ALWAYS, **select))
    assert turns(runner, esc, HOT) == turns(runner, full, CompressionConfig.make(budget=10_000, window=4))
    figures = esc.reports[-1].tier["recall"]
    assert figures["escalated"] == figures["steps"] > 0
    # the retakes read the whole tier: more per step than the hot cache and the selection together
    reads = figures["read_bytes_per_step"]
    assert reads["escalated"] > reads["hot"] + reads["select"] + reads["recalled"]
    for state, cfg in ((esc, HOT), (full, None)):
        runner.run(state, *_plan(runner, state, prompt(6, seed=9), cfg))
    logits = [[runner.step(s, t) for t in (5, 7, 11)] for s in (esc, full)]
    for a, b in zip(*logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and without the retakes the same recall does not (the test is not vacuous)
    once = runner.new_state(tiered=True, recall=RecallConfig.make(budget=1, **select))
    assert turns(runner, once, HOT) != turns(runner, runner.new_state(), CompressionConfig.make(budget=10_000, window=4))


def test_escalate_zero_never_retakes_and_equals_no_escalation():
    runner = ModelRunner(build_tiny("qwen2", seed=3))
    zero = runner.new_state(tiered=True, recall=RecallConfig.make(budget=2, escalate=0.0))
    plain = runner.new_state(tiered=True, recall=RecallConfig.make(budget=2))
    assert turns(runner, zero, HOT) == turns(runner, plain, HOT)
    assert zero.reports[-1].tier["recall"]["escalated"] == 0
    assert "escalated" not in plain.reports[-1].tier["recall"]  # records without escalation keep their fields


def test_a_step_is_retaken_exactly_when_its_margin_is_under_the_threshold():
    """Steps whose two best logits (under the selector's recall) are closer than ``escalate`` are taken again, the
    others are not; a retaken step feeds the turn's tokens since the last retake again with its own, over the whole
    history, so its logits are the full cache's over the same tokens, exactly (fp32)."""
    model = build_tiny("llama", seed=4)
    runner = ModelRunner(model)

    def decode(escalate):
        state = runner.new_state(tiered=True, recall=RecallConfig.make(budget=2, escalate=escalate))
        logits, probe = runner.prefill(state, prompt(48, seed=5), window=4)
        runner.compress(state, HOT, probe)
        state.cache.prefill_done(state)
        rec = state.cache.current_recall
        margins, retaken = [], []
        asked = rec.retake

        def watch(step_logits):
            top = step_logits.float().topk(2).values
            margins.append(float(top[0] - top[1]))
            retaken.append(asked(step_logits))
            return retaken[-1]

        rec.retake = watch
        got = {}
        for _ in range(10):
            at = state.next_position
            logits = runner.step(state, int(logits.argmax()))
            got[at] = logits
        return state, got, margins, retaken

    _, _, margins, _ = decode(None)
    threshold = sorted(margins)[len(margins) // 2]  # about half the steps fall under it
    state, got, margins, retaken = decode(threshold)
    assert retaken == [m < threshold for m in margins] and any(retaken) and not all(retaken)
    figures = state.cache.decode_done(state)
    assert figures["escalated"] == sum(retaken) and figures["steps"] == len(got)
    # each retake fed the tokens decoded since the previous one (or since the prefill) and its own
    steps = list(got)
    exact, refed = 48, 0
    for at, again in zip(steps, retaken, strict=True):
        if again:
            refed += at - exact + 1
            exact = at + 1
    assert figures["refed"] == refed
    runner.detach()
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([state.token_ids])).logits[0]  # (T, V): the full cache, every position
    for at, again in zip(steps, retaken, strict=True):
        if again:
            torch.testing.assert_close(got[at], full[at], rtol=1e-4, atol=1e-4)
    assert any(not torch.allclose(got[at], full[at], rtol=1e-4, atol=1e-4)
               for at, again in zip(steps, retaken, strict=True) if not again)  # the others are recall's own


def test_escalating_slots_in_a_batch_equal_each_alone():
    """Two slots that retake every step around one that never does, then slots that retake on some steps only:
    every row equals its session stepped alone."""
    runner = ModelRunner(build_tiny("qwen2", seed=3))
    short = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    a = runner.new_state(tiered=True, recall=RecallConfig.make(budget=1, escalate=ALWAYS))
    runner.turn(a, prompt(40), HOT, short)
    b = runner.new_state(tiered=True, recall=RecallConfig.make(budget=3, selector="lowrank", rank=2, reduce="mass"))
    runner.turn(b, prompt(33, seed=3), HOT, short)
    c = runner.new_state(tiered=True, recall=RecallConfig.make(budget=2, reduce="mass", escalate=ALWAYS))
    runner.turn(c, prompt(36, seed=4), HOT, short)
    step_together_and_alone(runner, [a, b, c])
    assert a.cache.decode_done(a)["escalated"] == 3 and c.cache.decode_done(c)["escalated"] == 3
    assert "escalated" not in b.cache.decode_done(b)
    # near-ties only: some rows retake at some steps (a retake's prefill in its session's cache, the slot refilled)
    states = []
    for seed, escalate in ((5, 0.2), (6, 0.2), (7, None)):
        s = runner.new_state(tiered=True, recall=RecallConfig.make(budget=1, escalate=escalate))
        runner.turn(s, prompt(38, seed=seed), HOT, short)
        states.append(s)
    step_together_and_alone(runner, states, steps=6)
    counts = [s.cache.decode_done(s).get("escalated") for s in states]
    assert counts[2] is None and 0 < counts[0] + counts[1] < 12, counts


def test_escalate_is_validated_and_keeps_stored_hashes():
    before = Policy.from_dict({"memory": {"recall": {"ratio": 0.1}}})
    same = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "escalate": None}}})
    assert before.sha256 == same.sha256 and '"escalate"' not in before.canonical_json()
    esc = Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "escalate": 1.0}}})
    assert esc.sha256 != before.sha256 and esc.memory.recall.escalate == 1.0
    for bad in (-0.5, float("nan"), float("inf"), "wide"):
        with pytest.raises(PolicyError) as err:
            Policy.from_dict({"memory": {"recall": {"ratio": 0.1, "escalate": bad}}})
        assert err.value.param == "memory.recall.escalate", (bad, err.value)


@pytest.mark.slow
def test_a_stored_session_that_escalates_verifies_and_shows_its_retakes(smollm2, tmp_path):
    """SmolLM2: a session whose every step is retaken answers as the full cache; one retaking only its near-ties
    records how many, replay shows them, and --verify re-executes both identically (the margin is recomputed
    from the same logits, so the same steps are retaken)."""
    from click.testing import CliRunner

    from snapkv_sessions import Session, SessionStore
    from snapkv_sessions.audit import verify
    from snapkv_sessions.cli import main

    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    questions = ("Name three colours.", "Which of them is the warmest?", "Say the first one again.")
    ran = {}
    for name, memory, budget in (("always", {"cold": True, "recall": {"budget": 1, "escalate": ALWAYS}}, 40),
                                 ("near", {"cold": True, "recall": {"ratio": 0.05, "escalate": 2.0}}, 40),
                                 ("full", {"cold": False}, 100_000)):
        policy = {"compression": {"budget": budget, "window": 8}, "memory": memory}
        session = Session.create(smollm2, policy=policy, store=store, system="You are brief.")
        ran[name] = ([session.chat(q, max_new_tokens=12).token_ids for q in questions], session.id)
    assert ran["always"][0] == ran["full"][0]
    for name in ("always", "near"):
        recs = store.turns(ran[name][1], status="done")
        figures = [r.compression["tier"]["recall"] for r in recs if r.compression and r.compression.get("tier")
                   and "recall" in r.compression["tier"]]
        assert figures
        if name == "always":
            assert all(f["escalated"] == f["steps"] > 0 for f in figures)
        else:
            assert all(0 <= f["escalated"] <= f["steps"] for f in figures)
        assert verify(store, ran[name][1], smollm2).ok
    db = ["--db", f"sqlite:///{tmp_path / 's.db'}"]
    table = CliRunner().invoke(main, ["replay", ran["always"][1], *db])
    assert table.exit_code == 0, table.output
    assert re.search(r" esc (\d+)/\1 read ", " ".join(table.output.split())), table.output  # every step retaken
    detail = CliRunner().invoke(main, ["replay", ran["always"][1], "--turn", str(recs[-1].turn), *db])
    assert detail.exit_code == 0 and "taken again over the whole history" in detail.output, detail.output
