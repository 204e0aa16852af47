"""Packed sibling projections (q/k/v, gate/up) run as one matmul for decode-sized inputs, with each one's own bits."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import packed
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.models import bf16_fast
from snapkv_sessions.packed import fuse_siblings, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_siblings_give_each_projection_its_own_bits(kind, dtype):
    model = build_tiny(kind, layers=2).to(dtype)
    if dtype == torch.bfloat16 and not bf16_fast():
        with pytest.raises(ConfigError, match="oneDNN cannot pack it on this CPU"):
            pack_linears(model, rows=4)  # its bf16 reorder needs AVX-512: refused, named, nothing left packed
        assert not packed.is_packed(model)
        pytest.skip("oneDNN packs bf16 only on a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT")
    pack_linears(model, rows=4)
    layer = model.model.layers[0]
    groups = {id(getattr(m, "_snapkv_fused", None)) for m in layer.modules() if hasattr(m, "_snapkv_fused")}
    if not groups:  # this CPU's kernel gave other bits for the joined weight: nothing was fused, as it must be
        pytest.skip("the fused matmul differs here; the check at load left the projections apart")
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj._snapkv_fused is attn.k_proj._snapkv_fused is attn.v_proj._snapkv_fused
    assert mlp.gate_proj._snapkv_fused is mlp.up_proj._snapkv_fused is not attn.q_proj._snapkv_fused
    alone = {m: packed._packed_forward(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 3, 4, 9):  # 9 > 4: a prefill's input runs each projection alone
            x = torch.randn(1, rows, 64, generator=gen).to(dtype)  # (B, T, hidden)
            got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]  # the order the attention calls them
            assert all(torch.equal(g, alone[m](x)) for g, m in zip(got, alone, strict=True))
            assert got[1].shape == (1, rows, 32) and got[0].shape == (1, rows, 64)
        x, other = torch.randn(1, 1, 64, generator=gen).to(dtype), torch.randn(1, 1, 64, generator=gen).to(dtype)
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(other), alone[attn.k_proj](other))  # another input: computed for it
        assert torch.equal(attn.v_proj(other), alone[attn.v_proj](other))
    assert fuse_siblings(model) == 0  # idempotent
    unpack_linears(model)
    assert not any(hasattr(m, "_snapkv_fused") for m in model.modules())

