"""The engine on a real model: SmolLM2-135M-Instruct from the offline bundle (converted once, cached)."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import full_logits_masked, reference_selection, snapshot, visibility_masks

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.generation import stream_text

DOC = " ".join(f"Record {i}: the courier for parcel {1000 + i} is agent {chr(65 + i % 26)}{i * 7 % 13}." for i in range(24))
SYSTEM = "You are a precise assistant."


def chat(tok, text: str, system: str = SYSTEM) -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture
def smol(smollm2):
    """A runner over the shared SmolLM2 model, detached (attention restored) after the test."""
    model, tok = smollm2
    runner = ModelRunner(model, tok)
    yield runner, model, tok
    runner.detach()


def test_full_budget_equals_uncompressed_generate(smol):
    runner, model, tok = smol
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids = chat(tok, DOC + "\nWho is the courier for parcel 1005?")
    gen = GenerationConfig(max_new_tokens=16, eos_token_ids=())
    got = runner.turn(runner.new_state(), ids, CompressionConfig.make(budget=4096, window=16), gen)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    assert got.tokens == want[0, len(ids):].tolist()


def test_compressed_decode_equals_masked_full_attention(smol):
    runner, model, tok = smol
    state = runner.new_state()
    ids = chat(tok, DOC + "\nWho is the courier for parcel 1005?")
    logits, probe = runner.prefill(state, ids, window=16)
    report = runner.compress(state, CompressionConfig.make(budget=96, window=16), probe)
    assert report.tokens_before[0] == len(ids) > 96 and report.tokens_after == [96] * runner.num_layers
    snaps = [snapshot(state)]
    got = {}
    for _ in range(10):
        got[state.next_position - 1] = logits
        logits = runner.step(state, int(logits.argmax()))
    got[state.next_position - 1] = logits
    masks = visibility_masks(snaps, state.next_position, runner.num_layers, runner.num_kv_heads)
    runner.detach()
    ref = full_logits_masked(model, state.token_ids, masks)
    for pos, lg in got.items():
        torch.testing.assert_close(lg, ref[pos], rtol=1e-3, atol=2e-3)


def test_selection_equals_reference(smol):
    runner, model, tok = smol
    ids = chat(tok, DOC[:600] + "\nWho is the courier for parcel 1003?")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        attn = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    state = runner.new_state()
    _, probe = runner.prefill(state, ids, window=16)
    runner.compress(state, CompressionConfig.make(budget=64, window=16), probe)
    expected = reference_selection([a[0] for a in attn], 16, 7, "avg", "mean", 48, runner.num_kv_heads)
    mismatched = [(layer, h) for layer in range(runner.num_layers) for h in range(runner.num_kv_heads)
                  if state.kept_positions(layer, h) != expected[layer][h]]
    assert mismatched == []


def test_five_turn_chat_keeps_pins_and_budget(smol):
    runner, _, tok = smol
    cfg = CompressionConfig.make(budget=80, window=16)
    gen = GenerationConfig(max_new_tokens=8)
    state = runner.new_state()
    sys_ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=True, return_dict=False)
    first = chat(tok, DOC[:500] + "\nWho is the courier for parcel 1002?")
    assert first[: len(sys_ids)] == sys_ids
    runner.turn(state, first, cfg, gen, pinned=[i < len(sys_ids) for i in range(len(first))])
    for q in ["And parcel 1004?", "And parcel 1006?", "Which parcel has agent C2?", "Thanks. Anything else?"]:
        ids = tok(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                  add_special_tokens=False)["input_ids"]
        if state.last_stop_reason == "eos":  # the pending end token already closes the reply
            ids = ids[1:]
        runner.turn(state, ids, cfg, gen)
    assert len(state.reports) == 5
    for report in state.reports:
        assert report.tokens_after == [80] * runner.num_layers
        assert report.pinned_kept == report.pinned_total == len(sys_ids)
    for layer in range(runner.num_layers):
        for head in range(runner.num_kv_heads):
            assert set(range(len(sys_ids))) <= set(state.kept_positions(layer, head))


def test_stop_string_and_stream_text(smol):
    runner, _, tok = smol
    state = runner.new_state()
    logits, _ = runner.prefill(state, chat(tok, "Count from 1 to 20, separated by commas."))
    gen = GenerationConfig(max_new_tokens=60, stop=("7",))
    pieces = list(stream_text(tok, runner.generate(state, logits, gen)))
    text = "".join(pieces)
    assert state.last_stop_reason == "stop" and text.rstrip().endswith("7") and "8" not in text
    assert len(pieces) > 3
