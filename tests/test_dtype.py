"""Weights' dtypes: ``ModelSpec`` ids, ``auto``, sessions bound to the dtype they ran in, and bf16 against fp32."""

from __future__ import annotations

import pytest
import torch

from snapkv_sessions import models
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.models import ModelSpec, bound_model, resolve_dtype


def test_a_model_id_names_its_dtype_unless_it_is_float32():
    assert ModelSpec.parse("m").model_id == "m" and ModelSpec.parse("m").dtype == "float32"
    assert ModelSpec.parse("m", "bfloat16").model_id == "m@bfloat16"
    assert ModelSpec.parse("m@bfloat16") == ModelSpec("m", "bfloat16")
    assert ModelSpec.parse("m@bfloat16", "bfloat16").model_id == "m@bfloat16"
    assert ModelSpec.parse("/models/a@b") == ModelSpec("/models/a@b", "float32")  # not a dtype: part of the name
    assert ModelSpec.split("m@float16") == ("m", "float16") and ModelSpec.split("m") == ("m", None)
    with pytest.raises(ConfigError, match="dtype") as err:
        ModelSpec.parse("m@bfloat16", "float32")
    assert "already names bfloat16" in str(err.value)
    with pytest.raises(ConfigError, match="dtype") as err:
        ModelSpec.parse("m", "int8")
    assert "'int8'" in str(err.value) and "auto" in str(err.value)


def test_auto_is_bf16_only_where_it_runs_natively(monkeypatch):
    from snapkv_sessions import weights16

    assert resolve_dtype(None) == "float32"  # the library's default: what the equality tests use
    monkeypatch.setattr(models, "bf16_fast", lambda: True)
    assert resolve_dtype("auto") == "bfloat16" and ModelSpec.parse("m", "auto").model_id == "m@bfloat16"
    monkeypatch.setattr(models, "bf16_fast", lambda: False)
    monkeypatch.setattr(weights16, "available", lambda: True)  # elsewhere: fp32 math over 16-bit weights
    assert resolve_dtype("auto") == "fp16-weights" and ModelSpec.parse("m", "auto").model_id == "m@fp16-weights"
    monkeypatch.setattr(weights16, "available", lambda: False)  # and where that kernel cannot run, fp32
    assert resolve_dtype("auto") == "float32" and ModelSpec.parse("m", "auto").model_id == "m"


def test_a_bare_name_reruns_a_session_in_its_own_dtype():
    assert bound_model(None, "m@bfloat16") == "m@bfloat16"
    assert bound_model("m", "m@bfloat16") == "m@bfloat16" and bound_model("m", "m") == "m"
    assert bound_model("m@float32", "m@bfloat16") == "m@float32"  # stated: refused later, by the dtype check
    runner = object()
    assert bound_model(runner, "m@bfloat16") is runner


def test_a_loaded_model_is_stored_under_its_weights_dtype():
    import torch

    from snapkv_sessions.models import model_id_of
    from tests.conftest import build_tiny

    model = build_tiny("qwen2")
    assert model_id_of(model, "tiny") == "tiny"
    assert model_id_of(model.to(torch.bfloat16), "tiny") == "tiny@bfloat16"


def test_the_server_serves_its_name_and_stores_its_dtype(tmp_path):
    import torch

    from snapkv_sessions.serve import Service, protocol
    from snapkv_sessions.store import SessionStore
    from tests.conftest import build_tiny, word_tokenizer

    tok = word_tokenizer()
    model = build_tiny("qwen2").to(torch.bfloat16)
    model.config._name_or_path = "tiny"
    service = Service((model, tok), {"compression": {"budget": 16, "window": 4}, "drift": {"embedder": "none"}},
                      SessionStore(f"sqlite:///{tmp_path / 's.db'}"))
    assert (service.model_name, service.model_id) == ("tiny", "tiny@bfloat16")
    for name in ("tiny", "tiny@bfloat16"):
        req = protocol.ChatCompletionRequest.model_validate({"model": name, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
        assert service.prepare(req, None, None).wanted[-1].content == "hi"
    req = protocol.ChatCompletionRequest.model_validate({"model": "tiny@float32", "messages": [{"role": "user",
                                                                                                "content": "hi"}]})
    with pytest.raises(ConfigError, match="serves 'tiny' only"):
        service.prepare(req, None, None)


@pytest.mark.bundle
def test_a_bf16_session_is_stored_verified_and_reopened_in_bf16(smollm2, tmp_path):
    """A session created in bf16 is stored as ``name@bfloat16``; ``verify`` re-executes it in bf16 and finds every
    turn equal; reopening it by its bare name loads bf16 again; asking for fp32 is refused, naming the dtype."""
    import torch

    from snapkv_sessions import Session, audit
    from snapkv_sessions.store import SessionStore

    store = SessionStore(f"sqlite:///{tmp_path / 'bf16.db'}")
    policy = {"compression": {"budget": 24, "window": 8}, "drift": {"embedder": "none"}}
    session = Session.create("smollm2-135m-instruct", policy=policy, store=store, dtype="bfloat16")
    assert session.model_id == "smollm2-135m-instruct@bfloat16"
    assert next(session.runner.model.parameters()).dtype == torch.bfloat16
    for q in ("Name a colour.", "And another one?"):
        session.chat(q, max_new_tokens=6)
    result = audit.verify(store, session.id)
    assert result.ok and result.turns_checked == 2, result
    again = Session.open(session.id, model="smollm2-135m-instruct", store=store)
    assert next(again.runner.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="runs in bfloat16"):
        Session.open(session.id, model="smollm2-135m-instruct@float32", store=store)
    with pytest.raises(ConfigError, match="runs in bfloat16"):
        Session.open(session.id, model=smollm2, store=store)  # the fp32 (model, tokenizer)


@pytest.mark.bundle
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_bf16_replies_against_fp32_on_the_bundled_models(name):
    """Greedy replies of bf16 against fp32 weights: how often they are identical and where they first differ
    (``bench dtype`` prints the same figures for any model). bf16 rounds every matmul, so replies may part
    after a near-tie; the first token, decided by a clear margin on these prompts, agrees on every prompt."""
    from snapkv_sessions.bench.dtype import PROMPTS, agreement
    from snapkv_sessions.models import bundle_available

    if not bundle_available(name):
        pytest.skip(f"bundle {name} not installed")
    out = agreement(name, PROMPTS[:4], max_new_tokens=12)
    assert out.prompts == 4 and out.identical == sum(d is None for d in out.first_divergence)
    assert all(d is None or d > 0 for d in out.first_divergence)


@pytest.mark.parametrize("mask", [None, "row", "head"])
def test_bf16_decode_attention_equals_fp32_attention(mask):
    """A bf16 decode step's attention (two matmuls, an fp32 softmax; not the CPU flash kernel) equals fp32 SDPA on
    the same inputs within bf16's rounding: GQA, and key masks per row (batched slots) and per KV head (uneven
    heads)."""
    from snapkv_sessions.attention import causal_sdpa

    g = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 1, 16, generator=g)  # (B, Hq, 1, D)
    key, value = torch.randn(3, 2, 50, 16, generator=g), torch.randn(3, 2, 50, 16, generator=g)  # (B, Hkv, T, D)
    key_mask = None
    if mask is not None:
        key_mask = torch.rand(3, 1 if mask == "row" else 2, 1, 50, generator=g) > 0.4  # (B, 1 or Hkv, 1, T)
        key_mask[..., -1] = True  # a step always sees its own token
    ref = causal_sdpa(query, key, value, 0.25, key_mask)  # fp32: PyTorch's SDPA
    got = causal_sdpa(query.bfloat16(), key.bfloat16(), value.bfloat16(), 0.25, key_mask)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape == (3, 1, 6, 16)
    torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.02)
    if key_mask is not None:  # a masked key changes nothing: the output is the same with its K/V scrambled
        hidden = ~key_mask.expand(3, 2, 1, 50)[:, :, 0, :, None]  # (B, Hkv, T, 1)
        noisy = torch.where(hidden, torch.randn(key.shape, generator=g) * 50, key).bfloat16()
        torch.testing.assert_close(causal_sdpa(query.bfloat16(), noisy, value.bfloat16(), 0.25, key_mask), got)
