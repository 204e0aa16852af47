"""Linear weights stored in 16 bits with fp32 arithmetic (:mod:`snapkv_sessions.weights16`): the kernel against a
float64 reference, its fixed per-output arithmetic (a row equals itself alone, on any thread count, and joined
siblings equal each projection), tiny models against fp32 models holding the same rounded weights, sessions that
replay their own bits, and the refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_KINDS, build_tiny

from snapkv_sessions import decode, models, packed, weights16
from snapkv_sessions.batch import decode_step
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.models import ModelSpec, model_id_of, resolve_dtype
from snapkv_sessions.runner import ModelRunner

pytestmark = pytest.mark.skipif(not weights16.available(), reason="the 16-bit weights kernel does not run here "
                                                                   "(needs an AVX2 CPU and a C compiler)")
FORMATS = list(weights16.FORMATS)


def _operands(m: int, k: int, n: int, fmt: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)  # (M, K)
    w = (torch.randn(n, k, generator=g) * 0.1).to(fmt)  # (N, K) 16-bit
    b = torch.randn(n, generator=g) if bias else None  # (N,)
    return x, w, b


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 40), (3, 37, 13), (4, 8, 9), (5, 200, 70), (8, 896, 136),
                                           (32, 24, 17), (33, 40, 11), (70, 2048, 1000)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_linear_equals_a_float64_reference(name, m, k, n, bias):
    """Both paths (the kernel up to SMALL_ROWS rows, widened fp32 linear above, in blocks past WIDEN_BYTES),
    every row-group and output-block remainder, K not a multiple of 8."""
    fmt = weights16.FORMATS[name]
    x, w, b = _operands(m, k, n, fmt, seed=m * 1000 + k + n, bias=bias)
    linear = torch.nn.Linear(k, n, bias=bias)
    linear.weight = torch.nn.Parameter(w, requires_grad=False)
    linear.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)
    linear.forward = weights16._forward(linear)
    got = linear(x.view(1, m, k))  # (1, M, N)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())  # (M, N)
    assert got.dtype == torch.float32 and got.shape == (1, m, n)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n", [203, 208])
def test_a_row_gets_the_same_bits_in_any_batch_layout_and_thread_count(name, n):
    x, w, b = _operands(weights16.SMALL_ROWS, 136, n, weights16.FORMATS[name])
    every = weights16.small(x, w, b)  # (32, N)
    if n % 8 == 0:  # the blocked layout: another place to read from, the same arithmetic
        stored = weights16.blocked(w)  # (N/8, K/8, 8, 8)
        assert torch.equal(weights16.plain(stored), w)
        assert torch.equal(weights16.small(x, stored, b), every)
        assert torch.equal(weights16.large(x, stored, b), weights16.large(x, w, b))
        torch.testing.assert_close(weights16.large(x, stored, b), every, rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 3, 5, 8, 17):
        for start in (0, weights16.SMALL_ROWS - rows):
            part = weights16.small(x[start:start + rows], w, b)  # (rows, N)
            assert torch.equal(part, every[start:start + rows]), (rows, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = weights16.small(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, every)


@pytest.mark.parametrize("name", FORMATS)
def test_widening_is_exact_in_both_layouts(name):
    """What a prefill chunk's fp32 matmul reads: the stored rows widened, exactly, whatever the layout."""
    _, w, _ = _operands(1, 40, 48, weights16.FORMATS[name])
    for stored in (w, weights16.blocked(w)):
        for lo, hi in ((0, 48), (8, 24), (40, 48)):
            assert torch.equal(weights16.widened(stored, lo, hi), w[lo:hi].float())
    _, odd, _ = _operands(1, 37, 13, weights16.FORMATS[name])  # plain only: K and N not multiples of 8
    assert torch.equal(weights16.widened(odd, 3, 11), odd[3:11].float())
    with pytest.raises(ValueError, match="widen16 refused"):
        weights16.widened(weights16.blocked(w), 4, 12)  # a blocked weight widens whole blocks


def _rounded(model: torch.nn.Module, fmt: torch.dtype) -> torch.nn.Module:
    """An fp32 model whose linear weights hold the 16-bit values: the reference for a converted model."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.to(fmt).float())
    return model


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_a_converted_model_equals_fp32_over_the_rounded_weights(kind, name):
    fmt = weights16.FORMATS[name]
    ref = _rounded(build_tiny(kind), fmt)
    model = build_tiny(kind)
    assert weights16.convert(model, name) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert weights16.format_of(model) == name and model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.shape == (96 // 8, 64 // 8, 8, 8)  # stored blocked
    assert model_id_of(model, "tiny") == f"tiny@{name}"
    ids = torch.randint(3, 90, (2, 45), generator=torch.Generator().manual_seed(1))  # (2, 45): the large path
    with torch.inference_mode():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits  # (2, 45, V)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    gen = GenerationConfig(max_new_tokens=8, eos_token_ids=())
    prompt = ids[0, :20].tolist()
    replies = [ModelRunner(m).turn(ModelRunner(m).new_state(), prompt, None, gen).tokens for m in (model, ref)]
    assert replies[0] == replies[1]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_joined_siblings_give_each_projection_its_own_bits_and_decode_steps_from_the_parts(kind):
    model = build_tiny(kind)
    weights16.convert(model, "fp16-weights")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for first, parts in ((attn.q_proj, (attn.q_proj, attn.k_proj, attn.v_proj)), (mlp.gate_proj,
                                                                                 (mlp.gate_proj, mlp.up_proj))):
        group = weights16.sibling_group(first)
        assert group is not None and parts[0].weight.data_ptr() == group.weight.data_ptr()  # views, one copy
        x = torch.randn(6, first.in_features, generator=torch.Generator().manual_seed(2))  # (6, in)
        for joined, part in zip(group.run(x), parts, strict=True):
            assert torch.equal(joined, part(x))
    assert decode.for_model(model) is not None  # the parts' step gives transformers' bits here too


def _three_turns(runner: ModelRunner, cfg: CompressionConfig, tiered: bool):
    g = torch.Generator().manual_seed(4)
    gen = GenerationConfig(max_new_tokens=5, eos_token_ids=())
    state = runner.new_state(tiered=tiered)
    replies = [runner.turn(state, torch.randint(3, 90, (n,), generator=g).tolist(), cfg, gen).tokens
               for n in (50, 9, 14)]
    return replies, state


@pytest.mark.parametrize("tiered", [False, True])
def test_a_compressed_session_runs_again_to_the_same_bits(tiered):
    """What replay and --verify rely on: the same turns on a second model converted the same way give the same
    replies and caches, bit for bit."""
    cfg = CompressionConfig.make(budget=24, window=4)
    runs = []
    for _ in range(2):
        model = build_tiny("qwen2")
        weights16.convert(model, "bf16-weights")
        runs.append(_three_turns(ModelRunner(model), cfg, tiered))
    (replies_a, state_a), (replies_b, state_b) = runs
    assert replies_a == replies_b
    for la, lb in zip(state_a.cache.layers, state_b.cache.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_a_batched_step_equals_each_session_alone():
    model = build_tiny("llama")
    weights16.convert(model, "fp16-weights")
    runner = ModelRunner(model)
    cfg = CompressionConfig.make(budget=24, window=4)
    together = [_three_turns(runner, cfg, False)[1] for _ in range(2)]
    alone = [_three_turns(runner, cfg, False)[1] for _ in range(2)]
    tokens = [5, 7]
    for s in together + alone:
        s.pending = []
    for _ in range(4):
        batch = decode_step(runner, together, tokens)  # (2, V)
        single = torch.stack([runner.step(s, t) for s, t in zip(alone, tokens, strict=True)])  # (2, V)
        torch.testing.assert_close(batch, single, rtol=1e-5, atol=1e-5)
        assert batch.argmax(-1).tolist() == single.argmax(-1).tolist()
        tokens = single.argmax(-1).tolist()


def test_the_dtype_names_and_auto(monkeypatch):
    for name in FORMATS:
        spec = ModelSpec.parse("m", name)
        assert spec.model_id == f"m@{name}" and ModelSpec.parse(spec.model_id) == spec
        assert spec.torch_dtype == torch.float32  # activations and the KV cache
    monkeypatch.setattr(models, "bf16_fast", lambda: False)
    assert resolve_dtype("auto") == "fp16-weights"
    monkeypatch.setattr(weights16, "available", lambda: False)
    assert resolve_dtype("auto") == "float32"
    monkeypatch.setattr(models, "bf16_fast", lambda: True)
    assert resolve_dtype("auto") == "bfloat16"


def test_refusals_name_the_cause_and_leave_the_model_as_it_was():
    model = build_tiny("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = 1e5
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.down_proj holds a weight of 1e\+05.*bf16-weights"):
        weights16.convert(model, "fp16-weights")
    assert weights16.format_of(model) is None
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert weights16.convert(model, "bf16-weights") > 0  # bf16 holds it
    with pytest.raises(ConfigError, match="already stores its weights as bf16-weights"):
        weights16.convert(model, "fp16-weights")
    if packed.available():
        with pytest.raises(ConfigError, match="runs their own kernel"):
            packed.pack_linears(model)
    with pytest.raises(ConfigError, match="must be one of"):
        weights16.convert(build_tiny("llama"), "int8-weights")
    with pytest.raises(ConfigError, match="converts fp32 weights"):
        weights16.convert(build_tiny("llama").to(torch.bfloat16), "fp16-weights")
