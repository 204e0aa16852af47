"""The engine on a real model: SmolLM2-135M-Instruct from the offline bundle (converted once, cached)."""

from __future__ import annotations

import copy

import torch
from reference import full_logits_masked, snapshot, visibility_masks

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.generation import stream_text

DOC = " ".join(f"Record {i}: the courier for parcel {1000 + i} is agent {chr(65 + i % 26)}{i * 7 % 13}." for i in range(24))


def chat(tok, text: str, system: str = "You are a precise assistant.") -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_full_budget_equals_uncompressed_generate(smollm2):
    model, tok = smollm2
    ref = copy.deepcopy(model)
    runner = ModelRunner(model, tok)
    try:
        ids = chat(tok, DOC + "\nWho is the courier for parcel 1005?")
        gen = GenerationConfig(max_new_tokens=16, eos_token_ids=())
        state = runner.new_state()
        got = runner.turn(state, ids, CompressionConfig.make(budget=4096, window=16), gen)
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        assert got.tokens == want[0, len(ids):].tolist()
    finally:
        runner.detach()


def test_compressed_decode_equals_masked_full_attention(smollm2):
    model, tok = smollm2
    runner = ModelRunner(model, tok)
    try:
        state = runner.new_state()
        ids = chat(tok, DOC + "\nWho is the courier for parcel 1005?")
        cfg = CompressionConfig.make(budget=96, window=16)
        logits, probe = runner.prefill(state, ids, window=16)
        report = runner.compress(state, cfg, probe)
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
    finally:
        runner.detach()


def test_stop_string_and_stream_text(smollm2):
    model, tok = smollm2
    runner = ModelRunner(model, tok)
    try:
        ids = chat(tok, "Count from 1 to 20, separated by commas.")
        state = runner.new_state()
        logits, _ = runner.prefill(state, ids)
        pieces = list(stream_text(tok, runner.generate(state, logits, GenerationConfig(max_new_tokens=60,
                                                                                       stop=("7",)))))
        text = "".join(pieces)
        assert state.last_stop_reason == "stop" and text.rstrip().endswith("7") and "8" not in text
        assert len(pieces) > 3
    finally:
        runner.detach()
