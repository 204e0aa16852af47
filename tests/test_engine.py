"""Core engine: equality with the uncompressed model, with masked full attention, and with a reference selection."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from reference import full_logits_masked, reference_selection, snapshot, visibility_masks

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.press import layer_budgets
from snapkv_sessions.scorers import word_ids


def prompt(n: int, seed: int = 1, vocab: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


GREEDY = GenerationConfig(max_new_tokens=12, eos_token_ids=())


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Uncompressed reference: transformers' own generate() with its default cache and sdpa."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    return out[0, len(ids) :].tolist()


def test_full_budget_generation_equals_uncompressed(tiny_kind):
    ref = build_tiny(tiny_kind)
    runner = ModelRunner(build_tiny(tiny_kind))
    cfg = CompressionConfig.make(budget=1000, window=8)
    state = runner.new_state()
    turn1 = prompt(40)
    got1 = runner.turn(state, turn1, cfg, GREEDY)
    assert got1.tokens == hf_greedy(ref, turn1, 12)
    assert not got1.report.compressed
    # Turn 2 on top of turn 1's cache equals one uncompressed greedy run over the whole transcript.
    turn2 = prompt(20, seed=2)
    got2 = runner.turn(state, turn2, cfg, GREEDY)
    transcript = turn1 + got1.tokens + turn2
    assert got2.tokens == hf_greedy(ref, transcript, 12)
    assert state.token_ids + state.pending == transcript + got2.tokens


@pytest.mark.parametrize("strategy", ["uniform", "pyramid"])
def test_compressed_decode_equals_masked_full_attention(tiny_kind, strategy):
    """Two compressed turns; every logit equals full eager attention with the evicted positions masked out."""
    model = build_tiny(tiny_kind, seed=3)
    runner = ModelRunner(model)
    cfg = CompressionConfig.make(budget=24, window=6, kernel=3, strategy=strategy, pyramid_beta=4)
    state = runner.new_state()
    got: dict[int, torch.Tensor] = {}  # position -> logits the compressed run computed there
    snaps = []

    def decode(logits: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            got[state.next_position - 1] = logits  # logits computed at the last fed position
            logits = runner.step(state, int(logits.argmax()))
        got[state.next_position - 1] = logits

    logits, probe = runner.prefill(state, prompt(50), window=6)
    runner.compress(state, cfg, probe)
    snaps.append(snapshot(state))
    decode(logits, 8)
    logits, probe = runner.prefill(state, prompt(18, seed=4), window=6)
    runner.compress(state, cfg, probe)
    snaps.append(snapshot(state))
    decode(logits, 8)
    assert all(r.compressed for r in state.reports)

    masks = visibility_masks(snaps, state.next_position, runner.num_layers, runner.num_kv_heads)
    runner.detach()
    ref = full_logits_masked(model, state.token_ids, masks)  # (T, V)
    checked = 0
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 18
    # Not vacuous: with nothing masked (no eviction) the decode logits differ.
    open_masks = visibility_masks([], state.next_position, runner.num_layers, runner.num_kv_heads)
    unmasked = full_logits_masked(model, state.token_ids, open_masks)
    assert max(float((got[p] - unmasked[p]).abs().max()) for p in got) > 1e-2


def test_positions_are_true_after_compression():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=16, window=4, kernel=1)
    runner.turn(state, prompt(40), cfg, GenerationConfig(max_new_tokens=5, eos_token_ids=()))
    # 40 prompt tokens and 4 decoded ones are in the cache; the 5th sampled token is pending.
    assert state.next_position == 44 and len(state.pending) == 1
    for pos in state.positions:
        assert pos.shape[-1] == 16 + 4
        assert pos[0, :, -4:].tolist() == [[40, 41, 42, 43]] * runner.num_kv_heads
        assert bool((pos.diff(dim=-1) > 0).all())  # sorted, no duplicates


@pytest.mark.parametrize(("pooling", "head_reduce"), [("avg", "mean"), ("max", "mean"), ("avg", "max")])
def test_selection_equals_reference(tiny_kind, pooling, head_reduce):
    window, kernel, budget, length = 5, 5, 17, 48
    ids = prompt(length, seed=7)
    eager = build_tiny(tiny_kind, seed=5, attn="eager")
    with torch.inference_mode():
        attn = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # per layer (1,Hq,T,T)
    runner = ModelRunner(build_tiny(tiny_kind, seed=5))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=budget, window=window, kernel=kernel, pooling=pooling,
                                 head_reduce=head_reduce)
    _, probe = runner.prefill(state, ids, window=window)
    runner.compress(state, cfg, probe)
    expected = reference_selection([a[0] for a in attn], window, kernel, pooling, head_reduce,
                                   budget - window, runner.num_kv_heads)
    for layer in range(runner.num_layers):
        for head in range(runner.num_kv_heads):
            assert state.kept_positions(layer, head) == expected[layer][head], (layer, head)


def test_window_scores_equal_eager_attention_rows(tiny_kind):
    ids = prompt(30, seed=9)
    eager = build_tiny(tiny_kind, seed=2, attn="eager")
    with torch.inference_mode():
        attn = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    runner = ModelRunner(build_tiny(tiny_kind, seed=2))
    _, probe = runner.prefill(runner.new_state(), ids, window=7)
    for layer, a in enumerate(attn):
        torch.testing.assert_close(probe.scores[layer][0], a[0, :, -7:, :].mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_len", [5, 12])
@pytest.mark.parametrize("masked", [False, True])
def test_window_rows_from_the_probe_equal_sdpa(q_len, masked):
    """The window rows' output taken from the probe's probabilities (a later turn's prefill: all of it the
    window; a longer one: SDPA for the rows before) equals causal SDPA over the same keys, GQA and a per-KV-head
    padding mask included."""
    from snapkv_sessions.attention import attention_with_window, causal_sdpa, window_probs

    g = torch.Generator().manual_seed(3)
    bsz, n_q, n_kv, t_len, dim, window = 1, 6, 2, 40, 8, 5
    query = torch.randn(bsz, n_q, q_len, dim, generator=g)  # (B, Hq, Q, D)
    key = torch.randn(bsz, n_kv, t_len, dim, generator=g)  # (B, Hkv, T, D)
    value = torch.randn(bsz, n_kv, t_len, dim, generator=g)
    key_mask = None
    if masked:  # a head keeping fewer slots: its padding slots, before the prefill's keys
        key_mask = torch.ones(bsz, n_kv, 1, t_len, dtype=torch.bool)
        key_mask[0, 1, 0, 3:9] = False
    probs = window_probs(query, key, window, 0.3, key_mask)  # (B, Hkv, G, W, T)
    got = attention_with_window(query, key, value, 0.3, probs, key_mask)  # (B, Q, Hq, D)
    torch.testing.assert_close(got, causal_sdpa(query, key, value, 0.3, key_mask), rtol=1e-5, atol=1e-6)


def test_prefill_observing_a_window_equals_one_that_does_not(tiny_kind):
    """A prefill with the probe (rows from the probe's probabilities) gives the logits and the cache of a prefill
    without it: a first turn more than ``EXTRA_ROWS`` longer than its window (the window's rows only), a later
    turn of a few more tokens than the window (every row) and one of exactly the window."""
    from snapkv_sessions.attention import EXTRA_ROWS

    runner = ModelRunner(build_tiny(tiny_kind, seed=4))
    seen, plain = runner.new_state(), runner.new_state()
    for ids, window in ((prompt(EXTRA_ROWS + 40, seed=5), 8), (prompt(12, seed=6), 8), (prompt(8, seed=7), 8)):
        la, _ = runner.prefill(seen, ids, window=window)
        lb, _ = runner.prefill(plain, ids)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for layer in range(runner.num_layers):
        torch.testing.assert_close(seen.cache.layers[layer].keys, plain.cache.layers[layer].keys)
        torch.testing.assert_close(seen.cache.layers[layer].values, plain.cache.layers[layer].values)


def test_chunked_prefill_is_exact():
    ids = prompt(70, seed=11)
    a = ModelRunner(build_tiny("qwen2"))
    b = ModelRunner(build_tiny("qwen2"), prefill_chunk=16)
    sa, sb = a.new_state(), b.new_state()
    la, pa = a.prefill(sa, ids, window=8)
    lb, pb = b.prefill(sb, ids, window=8)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
    for layer in range(a.num_layers):
        torch.testing.assert_close(pa.scores[layer], pb.scores[layer], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(sa.cache.layers[layer].keys, sb.cache.layers[layer].keys)


def test_five_turns_keep_pins_and_stay_at_budget(tiny_kind):
    runner = ModelRunner(build_tiny(tiny_kind, seed=4))
    cfg = CompressionConfig.make(budget=40, window=8, kernel=3)
    state = runner.new_state()
    gen = GenerationConfig(max_new_tokens=6, eos_token_ids=())
    system = prompt(20, seed=20)
    pinned_positions = set(range(20))
    runner.turn(state, system + prompt(24, seed=21), cfg, gen, pinned=[True] * 20 + [False] * 24)
    for turn in range(2, 6):
        ids = prompt(24, seed=21 + turn)
        flags = [False] * 24
        if turn == 3:  # a marker span inside a later message is pinned too
            flags[5:9] = [True] * 4
            pinned_positions |= set(range(state.next_position + len(state.pending) + 5,
                                          state.next_position + len(state.pending) + 9))
        runner.turn(state, ids, cfg, gen, pinned=flags)
        report = state.reports[-1]
        assert report.compressed
        # After the compression the cache is at the budget, in every layer; decoding then adds gen tokens.
        assert report.tokens_after == [40] * runner.num_layers
        assert report.pinned_kept == report.pinned_total == len(pinned_positions)
        for layer in range(runner.num_layers):
            for head in range(runner.num_kv_heads):
                assert pinned_positions <= set(state.kept_positions(layer, head))
    assert len(state.reports) == 5
    assert state.cache_lengths() == [40 + 5] * runner.num_layers  # 5 decoded tokens fed after turn 5


def test_pyramid_budgets_sum_and_shape():
    cfg = CompressionConfig.make(budget=100, window=10, strategy="pyramid", pyramid_beta=5)
    sizes = layer_budgets(cfg, 7, 1000)
    assert sum(s - 10 for s in sizes) == 90 * 7
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert sizes[-1] - 10 == pytest.approx(90 / 5, abs=1)


def test_pyramid_cache_sits_at_layer_budgets():
    runner = ModelRunner(build_tiny("llama", layers=4))
    cfg = CompressionConfig.make(budget=30, window=6, kernel=3, strategy="pyramid", pyramid_beta=4)
    state = runner.new_state()
    runner.turn(state, prompt(80), cfg, GenerationConfig(max_new_tokens=1, eos_token_ids=()))
    report = state.reports[-1]
    assert report.tokens_after == report.budgets
    assert sum(report.budgets) == 30 * 4


def test_ratio_budget_follows_context():
    runner = ModelRunner(build_tiny("llama"))
    cfg = CompressionConfig.make(budget_ratio=0.25, window=4, kernel=1)
    state = runner.new_state()
    runner.turn(state, prompt(80), cfg, GenerationConfig(max_new_tokens=1, eos_token_ids=()))
    assert state.reports[-1].tokens_after == [20] * runner.num_layers


def test_no_compression_when_cache_fits():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    _, probe = runner.prefill(state, prompt(30), window=8)
    report = runner.compress(state, CompressionConfig.make(budget=30, window=8), probe)
    assert not report.compressed and report.select_ms == 0.0
    assert report.kv_bytes_before == report.kv_bytes_after


def test_report_fields():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=20, window=4)
    first = runner.turn(state, prompt(60), cfg, GenerationConfig(max_new_tokens=3, eos_token_ids=()))
    rep = first.report
    assert rep.tokens_before == [60] * 3 and rep.tokens_after == [20] * 3
    per_token = 2 * runner.num_kv_heads * 16 * 4  # keys+values, Hkv, head_dim, fp32 bytes; per layer
    assert rep.kv_bytes_before == 60 * per_token * 3 and rep.kv_bytes_after == 20 * per_token * 3
    assert rep.kept == [[20, 20]] * 3
    assert all(k == [20, 20] for k in rep.kept_new)  # the first turn's tokens are all new
    assert rep.score_ms > 0 and rep.select_ms > 0 and rep.gather_ms > 0
    second = runner.turn(state, prompt(10, seed=3), cfg, GenerationConfig(max_new_tokens=3, eos_token_ids=()))
    # 3 decoded tokens were added after compression, then 1 pending + 10 new: 34 slots before, 20 after.
    assert second.report.tokens_before == [33] * 3
    assert all(4 <= n <= 11 for row in second.report.kept_new for n in row)
    assert second.report.to_dict()["compressed"] is True


def test_history_attention_is_a_share_of_the_window_attention():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=24, window=6)
    first = runner.turn(state, prompt(50), cfg, GenerationConfig(max_new_tokens=2, eos_token_ids=()))
    assert first.report.history_attention is None  # nothing predates the first prefill
    second = runner.turn(state, prompt(20, seed=5), cfg, GenerationConfig(max_new_tokens=2, eos_token_ids=()))
    assert 0.0 < second.report.history_attention < 1.0


def test_streaming_keeps_sinks_and_recent():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    _, probe = runner.prefill(state, prompt(50), window=4)
    runner.compress(state, CompressionConfig.make(budget=20, window=4, method="streaming", sinks=4), probe)
    for layer in range(runner.num_layers):
        for head in range(runner.num_kv_heads):
            assert state.kept_positions(layer, head) == [0, 1, 2, 3, *range(34, 50)]


def test_spread_over_words():
    from snapkv_sessions.press import spread_over_words

    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.9, 0.3]]])  # (1, 1, 5)
    words = torch.tensor([[[7, 7, 8, 9, 9]]])
    assert torch.equal(spread_over_words(scores, words), torch.tensor([[[0.5, 0.5, 0.2, 0.9, 0.9]]]))


def test_span_aware_keeps_whole_words(smollm2):
    model, tok = smollm2
    runner = ModelRunner(model, tok)
    try:
        ids = tok(" ".join(f"Parcel {1000 + i} goes to courier number {7 * i + 13}." for i in range(30)))["input_ids"]

        def partial_words(span_aware: bool) -> int:
            state = runner.new_state()
            _, probe = runner.prefill(state, ids, window=16)
            runner.compress(state, CompressionConfig.make(budget=96, window=16, span_aware=span_aware), probe)
            words = word_ids(tok, state.token_ids, runner.device)
            cut = 0
            for pos in state.positions:
                for head in pos[0]:
                    kept = set(head.tolist())
                    for w in set(words[head].tolist()):
                        members = (words == w).nonzero().flatten().tolist()
                        cut += 0 < len(kept & set(members)) < len(members)
            assert state.cache_lengths() == [96] * runner.num_layers
            return cut

        assert partial_words(True) < partial_words(False) / 3
    finally:
        runner.detach()
