"""The bf16 decode step reads a cache's whole buffer instead of copying its keys, with the same bits."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import attention
from snapkv_sessions.attention import _decode_matmul, _whole_buffers
from snapkv_sessions.cache import CompactCache
from snapkv_sessions.runner import ModelRunner


def _buffer(bsz: int, heads: int, cap: int, t_len: int, dim: int, seed: int) -> torch.Tensor:
    """(B, Hkv, C, D) bf16: random keys in the first T slots, stale (random) numbers after them, as a cache's
    buffer holds after a reply was truncated."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bsz, heads, cap, dim, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("t_len", [1, 7, 64, 65, 333, 1024, 2906])
@pytest.mark.parametrize("bsz,heads,group", [(1, 2, 7), (1, 1, 4), (3, 2, 2), (8, 4, 1)])
@pytest.mark.parametrize("mask", [None, "slots", "heads", "additive"])
def test_reading_the_whole_buffer_gives_the_bits_of_the_copied_keys(t_len, bsz, heads, group, mask):
    dim = 64
    cap = t_len + max(1, t_len // 5)  # within the share a step may read
    keys = _buffer(bsz, heads, cap, t_len, dim, 0)[:, :, :t_len]  # (B, Hkv, T, D) views of the buffers
    values = _buffer(bsz, heads, cap, t_len, dim, 1)[:, :, :t_len]
    query = torch.randn(bsz, heads * group, 1, dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    key_mask = None
    if mask == "slots":  # a batched step's padding: (B, 1, 1, T)
        key_mask = torch.rand(bsz, 1, 1, t_len, generator=gen) < 0.8
        key_mask[..., 0] = True
    elif mask == "heads":  # a layer whose heads keep uneven counts: (B, Hkv, 1, T)
        key_mask = torch.rand(bsz, heads, 1, t_len, generator=gen) < 0.8
        key_mask[..., 0] = True
    elif mask == "additive":  # (B, Hq, 1, T) fp32, 0 or -inf
        seen = torch.rand(bsz, heads * group, 1, t_len, generator=gen) < 0.8
        seen[..., 0] = True
        key_mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    wide = _whole_buffers(keys, values)
    if keys.is_contiguous():  # one slot of one head: a plain view already
        assert wide is None
    else:
        wide_k, wide_v = wide
        assert wide_k.shape[2] == cap and wide_k.is_contiguous() and wide_v.is_contiguous()  # no copy needed
        assert wide_k.data_ptr() == keys.data_ptr()
    got = _decode_matmul(query, keys, values, 0.125, key_mask)  # (B, 1, Hq, D)
    copied = (keys.contiguous(), values.contiguous())
    want = _decode_matmul(query, *copied, 0.125, key_mask)
    assert torch.equal(got, want)


def test_a_view_with_more_spare_slots_than_allowed_is_read_as_it_is():
    t_len = 1000
    cap = t_len + max(attention.WIDEN_MIN, int(t_len * attention.WIDEN_SHARE)) + 1
    keys = _buffer(1, 2, cap, t_len, 64, 0)[:, :, :t_len]
    values = _buffer(1, 2, cap, t_len, 64, 1)[:, :, :t_len]
    assert _whole_buffers(keys, values) is None
    contiguous = keys.contiguous()  # nothing to widen
    assert _whole_buffers(contiguous, contiguous) is None
    other = _buffer(1, 2, t_len + 10, t_len, 64, 1)[:, :, :t_len]  # keys and values of different buffers' widths
    assert _whole_buffers(keys, other) is None


def test_a_reserved_cache_holds_zeros_past_its_length():
    cache = CompactCache(1)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), 0)
    cache.reserve(40)
    assert layer.capacity == 45
    assert torch.count_nonzero(layer._k[:, :, 5:]) == 0 and torch.count_nonzero(layer._v[:, :, 5:]) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_decode_steps_equal_those_that_copy_the_keys(kind, monkeypatch):
    """A session decoding in bf16 (the cache reserved for the reply, so every step widens) gets the logits of
    steps that copy their keys, bit for bit."""
    model = build_tiny(kind, layers=2).to(torch.bfloat16)
    runner = ModelRunner(model)
    prompt = [int(t) for t in torch.randint(3, 90, (150,), generator=torch.Generator().manual_seed(0))]

    def decode(widen: bool) -> list[torch.Tensor]:
        if not widen:
            monkeypatch.setattr(attention, "WIDEN_MIN", 0)
            monkeypatch.setattr(attention, "WIDEN_SHARE", 0.0)
        state = runner.new_state()
        logits, _ = runner.prefill(state, prompt)
        state.cache.reserve(20)
        out = []
        for _ in range(12):
            logits = runner.step(state, int(logits.argmax()))
            out.append(logits)
        monkeypatch.undo()
        return out

    widened, copied = decode(True), decode(False)
    assert all(torch.equal(a, b) for a, b in zip(widened, copied, strict=True))


def test_the_buffer_is_read_whole_only_where_the_check_at_first_use_found_the_same_bits(monkeypatch):
    """The equality rests on the kernels adding each masked slot's zero last; a CPU whose kernels split the key
    axis by its length would break it, so it is checked once per dtype and process, and where it fails the step
    copies the keys as before."""
    attention._widening_exact.cache_clear()
    found = attention._widening_exact(torch.bfloat16, "cpu")  # this CPU's answer (True on the AMX and EPYC runs)
    assert isinstance(found, bool) and attention._widening_exact(torch.bfloat16, "cpu") is found
    keys = _buffer(1, 2, 80, 70, 64, 0)[:, :, :70]
    query = torch.randn(1, 14, 1, 64).to(torch.bfloat16)
    widened = []
    real = attention._whole_buffers
    monkeypatch.setattr(attention, "_whole_buffers", lambda *a: widened.append(1) or real(*a))
    monkeypatch.setattr(attention, "_widening_exact", lambda dtype, device: False)
    copied = _decode_matmul(query, keys, keys, 0.125, None)
    assert widened == []
    monkeypatch.setattr(attention, "_widening_exact", lambda dtype, device: True)
    whole = _decode_matmul(query, keys, keys, 0.125, None)
    assert widened == [1] and (torch.equal(whole, copied) or not found)
