"""The compression gather for all layers in one Triton launch (keys, then values).

The torch path gathers layer by layer: 2 x L launches, each reading its own layer. Here one program per
(layer, batch, KV head, block of kept slots) reads the kept rows of that layer's cache through a table of base
pointers and strides, and writes one contiguous (L, B, Hkv, K, D) tensor whose per-layer slices become the
layers' new buffers. Fallback: the per-layer ``gather`` in :meth:`snapkv_sessions.runner.ModelRunner.compress`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - the package checks triton_available() first
    raise ImportError("snapkv_sessions.gpu.triton_gather needs Triton: `pip install triton`") from exc

BLOCK_K = 32  # kept slots per program


@triton.jit
def _gather_layers_kernel(
    src_table, stride_table, idx_ptr, out_ptr, batch, heads, kept, dim,
    stride_il, stride_ib, stride_ih,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # ((layer * batch) + b) * heads + h
    layer = row // (batch * heads)
    b = (row // heads) % batch
    h = row % heads
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) kept slot numbers
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    k_ok = ks < kept
    d_ok = dims < dim
    slots = tl.load(idx_ptr + layer * stride_il + b * stride_ib + h * stride_ih + ks, mask=k_ok, other=0)
    src = tl.load(src_table + layer).to(tl.pointer_type(out_ptr.dtype.element_ty))  # this layer's cache
    s_b = tl.load(stride_table + layer * 3)
    s_h = tl.load(stride_table + layer * 3 + 1)
    s_t = tl.load(stride_table + layer * 3 + 2)
    rows = src + b * s_b + h * s_h + slots[:, None] * s_t + dims[None, :]  # (BLOCK, BLOCK_D)
    ok = k_ok[:, None] & d_ok[None, :]
    vals = tl.load(rows, mask=ok, other=0.0)
    dst = out_ptr + (row * kept + ks[:, None]) * dim + dims[None, :]
    tl.store(dst, vals, mask=ok)


def _gather_one_kind(tensors: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """(L, B, Hkv, K, D) from L tensors (B, Hkv, T_l, D) (unit stride along D) and idx (L, B, Hkv, K)."""
    n_layers, bsz, heads, kept = idx.shape
    dim = tensors[0].shape[-1]
    ref = tensors[0]
    out = torch.empty(n_layers, bsz, heads, kept, dim, dtype=ref.dtype, device=ref.device)  # (L, B, Hkv, K, D)
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=ref.device)  # (L,)
    strides = torch.tensor([t.stride()[:3] for t in tensors], dtype=torch.int64, device=ref.device)  # (L, 3)
    idx = idx.contiguous()
    grid = (n_layers * bsz * heads, triton.cdiv(kept, BLOCK_K))
    _gather_layers_kernel[grid](table, strides, idx, out, bsz, heads, kept, dim, *idx.stride()[:3],
                                BLOCK=BLOCK_K, BLOCK_D=triton.next_power_of_2(dim))
    return out


def gather_layers(keys: list[torch.Tensor], values: list[torch.Tensor],
                  idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept keys and values of every layer, two launches in all.

    Parameters
    ----------
    keys, values : per layer (B, Hkv, T_l, D), unit stride along D, same dtype and device
    idx : (L, B, Hkv, K) long, slot indices into each layer's cache

    Returns
    -------
    keys, values : (L, B, Hkv, K, D) each, equal to ``torch.stack([k.gather(2, i[..., None].expand(...))])``
    """
    for t in (*keys, *values):
        if t.stride(-1) != 1:
            raise ValueError("gather_layers needs unit stride along head_dim")
    return _gather_one_kind(keys, idx), _gather_one_kind(values, idx)
