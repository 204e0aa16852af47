"""The decode step run from the model's parts (:mod:`snapkv_sessions.decode`) gives the bits of the step through
transformers' modules: one session, batched slots with padding and uneven heads, recall from a tier; and it steps
aside where it cannot promise that."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_KINDS, build_tiny

from snapkv_sessions import decode
from snapkv_sessions.batch import decode_step
from snapkv_sessions.config import CompressionConfig, RecallConfig
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.packed import available, exact, pack_linears
from snapkv_sessions.runner import ModelRunner

GEN = GenerationConfig(max_new_tokens=6, eos_token_ids=())


def _prompts(seed: int, lengths=(40, 9, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]


def _session(runner: ModelRunner, path: str, monkeypatch, cfg: CompressionConfig, **state_kw):
    """Three turns and four more steps with every decode step on ``path`` ("" the parts, "modules" transformers');
    returns the replies, the last steps' logits and the state."""
    monkeypatch.setenv(decode.ENV, path)
    state = runner.new_state(**state_kw)
    replies = [runner.turn(state, ids, cfg, GEN).tokens for ids in _prompts(1)]
    logits = []
    for tok in (5, 7, 11, 13):
        logits.append(runner.step(state, tok))
    monkeypatch.delenv(decode.ENV)
    return replies, logits, state


def _assert_same(a, b) -> None:
    (replies_a, logits_a, state_a), (replies_b, logits_b, state_b) = a, b
    assert replies_a == replies_b
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))
    for la, lb in zip(state_a.cache.layers, state_b.cache.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_a_session_decodes_the_same_bits_from_the_parts(kind, dtype, monkeypatch):
    model = build_tiny(kind, layers=2).to(dtype)
    runner = ModelRunner(model)
    assert decode.for_model(model) is not None
    cfg = CompressionConfig.make(budget=24, window=4)
    calls = []
    real = decode.DecodeStep.__call__
    monkeypatch.setattr(decode.DecodeStep, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    parts = _session(runner, "", monkeypatch, cfg)
    assert len(calls) == 3 * (GEN.max_new_tokens - 1) + 4  # every decode step ran from the parts
    modules = _session(runner, "modules", monkeypatch, cfg)
    assert len(calls) == 3 * (GEN.max_new_tokens - 1) + 4  # and none on transformers' path
    _assert_same(parts, modules)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_uneven_heads_and_recall_from_the_tier_decode_the_same_bits(kind, monkeypatch):
    """AdaKV's uneven heads (padding masks) and a tier's per-step recall ride through the same attention call."""
    runner = ModelRunner(build_tiny(kind, layers=2))
    cfg = CompressionConfig.make(budget=24, window=4, allocator="adakv")
    kw = {"tiered": True, "recall": RecallConfig.make(budget=5)}
    parts, modules = (_session(runner, p, monkeypatch, cfg, **kw) for p in ("", "modules"))
    assert parts[2].reports[-1].tier["recall"]["recalled_per_step"] > 0  # recall ran
    _assert_same(parts, modules)


def test_a_batched_step_from_the_parts_equals_the_modules_one_bit_for_bit(monkeypatch):
    runner = ModelRunner(build_tiny("qwen2", layers=2))
    g = torch.Generator().manual_seed(3)

    def sessions():
        states = []
        for length, budget in ((17, None), (60, 40), (45, 24)):
            state = runner.new_state()
            cfg = CompressionConfig.make(budget=budget, window=4) if budget else None
            runner.turn(state, torch.randint(3, 90, (length,), generator=g).tolist(), cfg, GEN)
            state.pending = []
            states.append(state)
        return states

    g.manual_seed(3)
    a = sessions()
    g.manual_seed(3)
    b = sessions()
    tokens = [5, 6, 7]
    for _ in range(4):
        monkeypatch.setenv(decode.ENV, "modules")
        want = decode_step(runner, a, tokens)  # (S, V)
        monkeypatch.delenv(decode.ENV)
        got = decode_step(runner, b, tokens)
        assert torch.equal(got, want)
        tokens = want.argmax(-1).tolist()


@pytest.mark.skipif(not (available() and exact(torch.bfloat16)), reason="packed bf16 linears are exact only with "
                    "native bf16 (AVX-512 BF16 or AMX)")
def test_packed_and_fused_linears_decode_the_same_bits_and_packing_rebuilds_the_step(monkeypatch):
    model = build_tiny("qwen2", layers=2).to(torch.bfloat16)
    runner = ModelRunner(model)
    plain = decode.for_model(model)
    pack_linears(model)
    fused = decode.for_model(model)
    assert fused is not None and fused is not plain  # packing changed how the linears run: built again
    assert decode.for_model(model) is fused  # and kept
    assert all(layer.joined is not None for layer in fused.layers)  # q and k rotated together from the one matmul
    cfg = CompressionConfig.make(budget=24, window=4)
    _assert_same(*(_session(runner, p, monkeypatch, cfg) for p in ("", "modules")))


def test_it_steps_aside_where_the_bits_would_differ_or_it_cannot_see_everything(monkeypatch):
    model = build_tiny("llama", layers=2)
    ModelRunner(model)
    monkeypatch.setattr(decode, "_rotate", lambda x, cos, sin: x * cos)  # a step that is not the model's
    assert decode.for_model(model) is None  # the check at first use found other bits
    monkeypatch.undo()
    assert decode.for_model(model) is None  # decided once per model and packing
    model = build_tiny("llama", layers=2)
    ModelRunner(model)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert decode.for_model(model) is None  # a hook would not run from the parts
    handle.remove()
    monkeypatch.setenv(decode.ENV, "modules")
    assert decode.for_model(model) is None
    monkeypatch.delenv(decode.ENV)
    assert decode.for_model(model) is not None
    gpt2 = build_tiny("llama", layers=1)
    monkeypatch.setattr(decode, "ARCHITECTURES", ())
    assert decode.for_model(gpt2) is None  # an architecture whose layers it does not know
