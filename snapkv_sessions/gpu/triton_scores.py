"""SnapKV scoring fused into one Triton kernel: pooling along positions and the GQA head reduction.

The torch fallback (:meth:`snapkv_sessions.press.SnapKV.history_scores`) runs a pooling kernel over every query
head, then a reduction over each KV head's group: the pooled (B, Hq, P) tensor goes through memory twice. Here one
program reads each (query head, position) window once and writes the (B, Hkv, P) scores directly. Top-k and
the gather stay in torch (no host synchronisation either way).

SnapKV: Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - the package checks triton_available() first
    raise ImportError("snapkv_sessions.gpu.triton_scores needs Triton: `pip install triton` (CUDA builds of "
                      "torch bring it)") from exc

from ..press import SnapKV

BLOCK = 128  # positions per program


@triton.jit
def _snapkv_score_kernel(
    probs_ptr, out_ptr, hist, n_kv,
    stride_pb, stride_ph, stride_pt, stride_ob, stride_oh, stride_ot,
    GROUP: tl.constexpr, KERNEL: tl.constexpr, MAX_POOL: tl.constexpr, MAX_HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)  # b * n_kv + kv head
    b = row // n_kv
    kv = row % n_kv
    offs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,) history positions
    valid = offs < hist
    if MAX_HEADS:
        acc = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    else:
        acc = tl.zeros((BLOCK_P,), tl.float32)
    for g in tl.static_range(GROUP):
        base = probs_ptr + b * stride_pb + (kv * GROUP + g) * stride_ph
        if MAX_POOL:
            pooled = tl.full((BLOCK_P,), float("-inf"), tl.float32)
        else:
            pooled = tl.zeros((BLOCK_P,), tl.float32)
        for j in tl.static_range(KERNEL):
            idx = offs + (j - KERNEL // 2)  # "same" padding: out-of-range neighbours are padding
            inside = valid & (idx >= 0) & (idx < hist)
            if MAX_POOL:
                pooled = tl.maximum(pooled, tl.load(base + idx * stride_pt, mask=inside, other=float("-inf")))
            else:
                pooled += tl.load(base + idx * stride_pt, mask=inside, other=0.0)
        if not MAX_POOL:
            pooled = pooled / KERNEL  # count_include_pad, as SnapKV's avg_pool1d
        if MAX_HEADS:
            acc = tl.maximum(acc, pooled)
        else:
            acc += pooled
    if not MAX_HEADS:
        acc = acc / GROUP
    tl.store(out_ptr + b * stride_ob + kv * stride_oh + offs * stride_ot, acc, mask=valid)


def fused_score(window_probs: torch.Tensor, num_kv_heads: int, window: int, kernel: int, pooling: str,
                head_reduce: str) -> torch.Tensor:
    """SnapKV history scores in one kernel.

    Parameters
    ----------
    window_probs : (B, Hq, T) float32, window-mean attention over the layer's cache

    Returns
    -------
    (B, Hkv, T - W) float32, equal (to float rounding) to ``SnapKV(...).score(window_probs, num_kv_heads)``.
    """
    bsz, n_q, t_len = window_probs.shape
    hist = t_len - window
    probs = window_probs.float()  # (B, Hq, T)
    out = torch.empty(bsz, num_kv_heads, hist, dtype=torch.float32, device=probs.device)  # (B, Hkv, P)
    if hist <= 0:
        return out
    grid = (bsz * num_kv_heads, triton.cdiv(hist, BLOCK))
    _snapkv_score_kernel[grid](
        probs, out, hist, num_kv_heads,
        *probs.stride(), *out.stride(),
        GROUP=n_q // num_kv_heads, KERNEL=kernel, MAX_POOL=pooling == "max", MAX_HEADS=head_reduce == "max",
        BLOCK_P=BLOCK,
    )
    return out


@dataclass
class FusedSnapKV(SnapKV):
    """:class:`snapkv_sessions.press.SnapKV` whose scoring runs the fused Triton kernel; same scorer protocol."""

    def history_scores(self, window_probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """(B, Hq, T) window attention in, (B, Hkv, T - W) float32 history scores out, in one launch."""
        return fused_score(window_probs, num_kv_heads, self.window, self.kernel, self.pooling, self.head_reduce)
