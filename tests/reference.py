"""Independent, straightforward references the engine is checked against (eager, loops, no shortcuts)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from snapkv_sessions.state import KVState

REF_NAME = "snapkv_test_masked_eager"


def masked_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ref_masks=None,
                           **kwargs):
    """Eager attention over the full sequence; ``ref_masks[layer]`` (Hkv, T, T) bool says what each query sees."""
    n_q, n_kv = query.shape[1], key.shape[1]
    group = n_q // n_kv
    k = key.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
    v = value.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
    logits = (query @ k.transpose(-1, -2)) * scaling  # (B, Hq, T, T)
    visible = ref_masks[module.layer_idx].repeat_interleave(group, dim=0)  # (Hq, T, T)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = logits.softmax(-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF_NAME, masked_eager_attention)


def visibility_masks(snapshots: list[tuple[int, list[torch.Tensor]]], total: int, layers: int, heads: int):
    """Per layer (Hkv, T, T) bool: what query position p could see in the compressed run.

    ``snapshots`` are (boundary, kept positions per layer (Hkv, K)) taken right after each compression, in
    order; ``boundary`` is the number of tokens that were in the context then. A query at p sees the kept set
    of the last compression with boundary <= p, plus every position from that boundary up to p.
    """
    causal = torch.ones(total, total, dtype=torch.bool).tril()  # (T, T)
    masks = []
    for layer in range(layers):
        mask = causal.expand(heads, total, total).clone()  # (Hkv, T, T)
        for i, (boundary, kept) in enumerate(snapshots):
            end = snapshots[i + 1][0] if i + 1 < len(snapshots) else total
            allowed = torch.zeros(heads, total, dtype=torch.bool)  # (Hkv, T)
            for h in range(heads):
                allowed[h, kept[layer][h]] = True
            allowed[:, boundary:] = True
            mask[:, boundary:end, :] &= allowed[:, None, :]
        masks.append(mask)
    return masks


def snapshot(state: KVState) -> tuple[int, list[torch.Tensor]]:
    return state.next_position, [p[0].clone() for p in state.positions]


def full_logits_masked(model, token_ids: list[int], masks) -> torch.Tensor:
    """Logits (T, V) of one forward over all tokens with the masked eager reference attention."""
    original = model.config._attn_implementation
    model.set_attn_implementation(REF_NAME)
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([token_ids]), ref_masks=masks)
    finally:
        model.set_attn_implementation(original)
    return out.logits[0]


def reference_selection(attn_rows: list[torch.Tensor], window: int, kernel: int, pooling: str, head_reduce: str,
                        keep: int, num_kv_heads: int) -> list[list[list[int]]]:
    """Kept slots per layer and KV head from full eager attention maps, with plain loops.

    ``attn_rows[layer]`` is (Hq, T, T) softmax attention of one forward over the prompt.
    """
    out = []
    for attn in attn_rows:
        n_q, t_len, _ = attn.shape
        hist = t_len - window
        win_mean = attn[:, t_len - window :, :hist].mean(dim=1)  # (Hq, P)
        pooled = torch.empty_like(win_mean)
        half = kernel // 2
        for i in range(hist):
            lo, hi = max(0, i - half), min(hist, i + half + 1)
            seg = win_mean[:, lo:hi]
            pooled[:, i] = seg.amax(-1) if pooling == "max" else seg.sum(-1) / kernel
        group = n_q // num_kv_heads
        layer_keep = []
        for h in range(num_kv_heads):
            members = pooled[h * group : (h + 1) * group]
            score = members.amax(0) if head_reduce == "max" else members.mean(0)
            top = sorted(score.topk(keep).indices.tolist())
            layer_keep.append(top + list(range(hist, t_len)))
        out.append(layer_keep)
    return out


def reference_adakv(attn_rows: list[torch.Tensor], window: int, kernel: int, keep: int, num_kv_heads: int,
                    floor: float) -> list[list[list[int]]]:
    """Ada-KV's kept slots per layer and KV head (Feng et al., 2024, arXiv:2407.11550, as kvpress's AdaKVPress
    splits), from full eager attention maps with plain loops: SnapKV scores (window mean, avg pooling, mean over
    each GQA group); each head first keeps its own best ``max(1, floor(keep * floor))``; the rest of the layer's
    ``Hkv * keep`` slots go to the best remaining scores over all heads; the window is kept outright."""
    out = []
    for attn in attn_rows:
        n_q, t_len, _ = attn.shape
        hist = t_len - window
        win_mean = attn[:, t_len - window :, :hist].mean(dim=1)  # (Hq, P)
        half = kernel // 2
        pooled = torch.stack([win_mean[:, max(0, i - half) : min(hist, i + half + 1)].sum(-1) / kernel
                              for i in range(hist)], dim=-1)  # (Hq, P)
        group = n_q // num_kv_heads
        scores = [pooled[h * group : (h + 1) * group].mean(0).tolist() for h in range(num_kv_heads)]
        safe = max(1, int(keep * floor))
        kept: list[set[int]] = []
        for h in range(num_kv_heads):
            order = sorted(range(hist), key=lambda i, h=h: -scores[h][i])
            kept.append(set(order[:safe]))
        rest = sorted(((scores[h][i], h, i) for h in range(num_kv_heads) for i in range(hist) if i not in kept[h]),
                      reverse=True)
        for _, h, i in rest[: num_kv_heads * keep - num_kv_heads * safe]:
            kept[h].add(i)
        out.append([sorted(k) + list(range(hist, t_len)) for k in kept])
    return out
