"""A prefill chunk onto a cache attends in two parts (the earlier keys unmasked, the chunk's own causal, merged by
log-sum-exp): the same attention as one masked SDPA; each turn records which way it attended, and a replay,
``--verify`` and a session reopened from the store attend the same way, records from before included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny, word_tokenizer
from test_chunks import TEXT, Sized, _prefill_forwards

from snapkv_sessions import Session
from snapkv_sessions.attention import causal_sdpa, split_prefill
from snapkv_sessions.audit.verify import verify
from snapkv_sessions.errors import ConfigError, PlanError
from snapkv_sessions.runner import ModelRunner
from snapkv_sessions.store import SessionStore
from snapkv_sessions.transcript import TurnPlan


def _masked(query, key, value, scaling):
    q_len, t_len = query.shape[-2], key.shape[-2]
    mask = torch.ones(q_len, t_len, dtype=torch.bool).tril(t_len - q_len)  # (Q, T) bottom-right causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)  # (B, Q, Hq, D)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_len,t_len,heads,group", [(2, 3, 1, 1), (7, 40, 2, 3), (64, 300, 2, 7), (129, 130, 4, 1)])
def test_two_parts_equal_the_masked_attention(q_len, t_len, heads, group, dtype, tol):
    gen = torch.Generator().manual_seed(q_len + t_len)
    query = torch.randn(1, heads * group, q_len, 32, generator=gen).to(dtype)  # (B, Hq, Q, D)
    key, value = (torch.randn(1, heads, t_len, 32, generator=gen).to(dtype) for _ in range(2))  # (B, Hkv, T, D)
    got = split_prefill(query, key, value, 0.2)
    want = _masked(query, key, value, 0.2)
    assert got.shape == want.shape == (1, q_len, heads * group, 32)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(causal_sdpa(query, key, value, 0.2, split=True), got)  # what the attention function runs


def test_a_key_mask_keeps_the_one_masked_sdpa():
    """Padding slots (heads keeping uneven counts) need the mask: the split is not taken there."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 5, 16, generator=gen)
    key, value = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(2))
    key_mask = torch.rand(1, 2, 1, 20, generator=gen) < 0.7
    key_mask[..., -5:] = True
    assert torch.equal(causal_sdpa(query, key, value, 0.25, key_mask, split=True),
                       causal_sdpa(query, key, value, 0.25, key_mask, split=False))


def test_a_live_runner_splits_in_bf16_and_fp16_and_keeps_the_masked_reference_in_fp32():
    assert ModelRunner(build_tiny("llama", layers=1)).prefill_attention == "masked"
    assert ModelRunner(build_tiny("llama", layers=1).to(torch.bfloat16)).prefill_attention == "split"
    assert ModelRunner(build_tiny("qwen2", layers=1).to(torch.float16)).prefill_attention == "split"


def _session(tmp_path, attention: str) -> tuple[Session, SessionStore]:
    """A bf16 session whose prefills run in chunks of 4, then 13, then at most 9 tokens, attending ``attention``."""
    model, tokenizer = build_tiny("qwen2", layers=2).to(torch.bfloat16), word_tokenizer()
    model.config._name_or_path = "tiny"
    runner = ModelRunner(model, tokenizer, prefill_chunk=9)
    runner.executor = Sized(runner, [4, 13])
    runner.prefill_attention = attention
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    from conftest import TINY_POLICY

    session = Session.create(runner, policy=TINY_POLICY, store=store, system="you will quiz about the text")
    for text in (TEXT, "what is the special magic number for sky ?"):
        session.chat(text, max_new_tokens=3)
    return session, store


@pytest.mark.parametrize("attention", ["split", "masked"])
def test_each_turn_records_how_it_attended_and_verify_and_a_reopened_session_attend_the_same(tmp_path, attention,
                                                                                               monkeypatch):
    """A record without the field (every record before it: masked) and a split one both re-execute exactly on a
    runner whose own choice is the other one."""
    session, store = _session(tmp_path, attention)
    segments = [t["segments"] for t in store.turns(session.id, status="done")]
    assert [s.get("attention") for s in segments] == [None if attention == "masked" else "split"] * 2
    live = [(lay.keys.clone(), lay.values.clone()) for lay in session.state.cache.layers]

    from snapkv_sessions import attention as attn

    seen = []  # for every prefill forward onto a cache (1 < Q < T), whether it was asked to split
    real = attn.causal_sdpa

    def watch(query, key, *rest):
        if 1 < query.shape[-2] < key.shape[-2]:
            seen.append(rest[3] if len(rest) > 3 else False)
        return real(query, key, *rest)

    monkeypatch.setattr(attn, "causal_sdpa", watch)
    model, tokenizer = session.runner.model, session.runner.tokenizer
    other = ModelRunner(model, tokenizer)
    other.prefill_attention = "masked" if attention == "split" else "split"  # not what the turns ran
    fed = _prefill_forwards(other)
    reopened = Session.open(session.id, model=other, store=store)
    rebuilt = [(lay.keys, lay.values) for lay in reopened.state.cache.layers]
    assert fed and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(live, rebuilt, strict=True))
    assert set(seen) == {attention == "split"}  # every prefill onto a cache attended the recorded way
    result = verify(store, session.id, model=other)
    assert result.ok and result.turns_checked == 2


def test_a_record_states_masked_or_split_or_nothing():
    base = {"pinned": [], "protect": [], "window": None, "reprefill": False, "owners": [[1, 0, 3]]}
    assert TurnPlan.from_record(base, [1, 2, 3]).attention == "masked"  # recorded before the field existed
    assert TurnPlan.from_record({**base, "attention": "split"}, [1, 2, 3]).attention == "split"
    with pytest.raises(PlanError, match="segments.attention"):
        TurnPlan.from_record({**base, "attention": "<script>"}, [1, 2, 3])
    runner = ModelRunner(build_tiny("llama", layers=1))
    with pytest.raises(ConfigError, match="attention"):
        runner._prefill(runner.new_state(), [1, 2, 3], False, None, None, "fast")
