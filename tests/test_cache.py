"""CompactCache: the same logits as transformers' DynamicCache, no reallocation per decode step."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import CompressionConfig, GenerationConfig, ModelRunner
from snapkv_sessions.cache import CompactCache


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_logits(runner: ModelRunner, steps: int) -> tuple[list[torch.Tensor], list[int], object]:
    state = runner.new_state()
    cfg = CompressionConfig.make(budget=24, window=6, kernel=3)
    logits, probe = runner.prefill(state, prompt(60), window=6)
    runner.compress(state, cfg, probe)
    out, ptrs = [logits], []
    if isinstance(state.cache, CompactCache):
        state.cache.reserve(steps)
    for _ in range(steps):
        logits = runner.step(state, int(logits.argmax()))
        out.append(logits)
        if isinstance(state.cache, CompactCache):
            ptrs.append(tuple(layer._k.data_ptr() for layer in state.cache.layers))
    return out, ptrs, state


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compact_equals_dynamic_over_50_steps(kind):
    compact = ModelRunner(build_tiny(kind, seed=8), cache="compact")
    dynamic = ModelRunner(build_tiny(kind, seed=8), cache="dynamic")
    got, ptrs, state = decode_logits(compact, 50)
    want, _, ref_state = decode_logits(dynamic, 50)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(set(ptrs)) == 1  # one buffer per layer for all 50 steps: no reallocation
    for layer, ref in zip(state.cache.layers, ref_state.cache.layers, strict=True):
        assert torch.equal(layer.keys, ref.keys) and layer.length == 24 + 50


def test_resident_kv_is_exactly_the_budget():
    runner = ModelRunner(build_tiny("llama"), cache="compact")
    state = runner.new_state()
    logits, probe = runner.prefill(state, prompt(80), window=6)
    runner.compress(state, CompressionConfig.make(budget=20, window=6), probe)
    per_token = 2 * runner.num_kv_heads * 16 * 4  # keys + values, Hkv, head_dim, fp32
    assert state.cache.allocated_bytes() == 20 * per_token * runner.num_layers
    list(runner.generate(state, logits, GenerationConfig(max_new_tokens=7, eos_token_ids=())))
    assert state.cache.allocated_bytes() == (20 + 7) * per_token * runner.num_layers  # one reserve for the reply


def test_turns_on_compact_and_dynamic_agree(smollm2):
    model, tok = smollm2
    runs = {}
    for kind in ("compact", "dynamic"):
        runner = ModelRunner(model, tok, cache=kind)
        state = runner.new_state()
        cfg = CompressionConfig.make(budget=80, window=16)
        ids = tok("Parcel 1001 goes to Ada. " * 30 + "Who gets parcel 1001?")["input_ids"]
        first = runner.turn(state, ids, cfg, GenerationConfig(max_new_tokens=20, eos_token_ids=()))
        second = runner.turn(state, tok(" And parcel 1002?")["input_ids"], cfg,
                             GenerationConfig(max_new_tokens=20, eos_token_ids=()))
        runs[kind] = (first.tokens, second.tokens, [p.tolist() for p in state.positions])
        runner.detach()
    assert runs["compact"] == runs["dynamic"]
