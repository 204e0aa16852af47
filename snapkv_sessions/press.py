"""SnapKV selection: which cache positions each layer and KV head keeps.

Device-agnostic torch. The scoring follows SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking
for Before Generation", arXiv:2404.14469): average the observation window's attention over its queries, pool
it along the positions so that neighbours of a hot token come along, reduce the query heads of a GQA group to
their KV head, then keep the top-k history positions per KV head plus the observation window itself. The
per-layer budgets optionally follow PyramidKV (Cai et al., 2024, arXiv:2406.02069).

:class:`SnapKV` is one scorer behind the seam of :mod:`snapkv_sessions.scorers`; :func:`select_positions` and
:func:`layer_budgets` are the top-k (pins forced in) and per-layer budgets every scorer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import CompressionConfig
from .errors import BudgetError

if TYPE_CHECKING:
    from .allocate import Allocator
    from .state import KVState


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along positions, same length out ("same" padding).

    Parameters
    ----------
    scores : (B, H, P)

    Returns
    -------
    (B, H, P). Average pooling counts the padding as zeros (``count_include_pad``), as SnapKV does.
    """
    if kernel == 1:
        return scores
    bsz, heads, length = scores.shape
    flat = scores.reshape(bsz * heads, 1, length)  # (B*H, 1, P)
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return pooled.view(bsz, heads, length)  # (B, H, P)


@dataclass
class SnapKV:
    """SnapKV scorer (Li et al., 2024, arXiv:2404.14469): a :class:`~snapkv_sessions.scorers.Scorer`.

    A history slot's score is the attention the observation window pays it, averaged over the window's queries
    (the probe does that), pooled along positions so that the neighbours of a hot token come along, then
    reduced over the query heads of each KV head's GQA group.

    Parameters
    ----------
    window: observation window W (its own positions are kept outright, never scored)
    kernel: pooling kernel (odd; 1 = none)
    pooling: ``"avg"`` or ``"max"``
    head_reduce: ``"mean"`` or ``"max"`` over the query heads of a KV head's group
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    head_reduce: str = "mean"

    @classmethod
    def from_config(cls, cfg: CompressionConfig, window: int | None = None) -> SnapKV:
        """The scorer ``cfg`` describes; ``window`` overrides ``cfg.window`` (a short turn observes fewer)."""
        return cls(window=cfg.window if window is None else window, kernel=cfg.kernel, pooling=cfg.pooling,
                   head_reduce=cfg.head_reduce)

    def score(self, window_probs: torch.Tensor, state: KVState | int, layer: int = 0) -> torch.Tensor:
        """Importance of every history position (all but the last W) for each KV head of ``layer``.

        Parameters
        ----------
        window_probs : (B, Hq, T) window-mean attention probabilities over the layer's cache
        state : the conversation's state (only its KV-head count is read), or that count itself (the call
            form from before the scorer seam, ``score(window_probs, num_kv_heads)``, kept working)

        Returns
        -------
        (B, Hkv, T - W)
        """
        heads = state if isinstance(state, int) else int(state.positions[layer].shape[1])
        return self.history_scores(window_probs, heads)  # (B, Hkv, T - W)

    def history_scores(self, window_probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """The scoring itself: (B, Hq, T) window attention in, (B, Hkv, T - W) history scores out."""
        bsz, n_q, t_len = window_probs.shape
        hist = window_probs[..., : t_len - self.window]  # (B, Hq, P)
        pooled = pool_scores(hist, self.kernel, self.pooling)  # (B, Hq, P)
        grouped = pooled.view(bsz, num_kv_heads, n_q // num_kv_heads, -1)  # (B, Hkv, G, P)
        if self.head_reduce == "max":
            return grouped.amax(dim=2)  # (B, Hkv, P)
        return grouped.mean(dim=2)  # (B, Hkv, P)


def spread_over_words(scores: torch.Tensor, word_ids: torch.Tensor, num_words: int | None = None) -> torch.Tensor:
    """Give every token the best score of its word.

    Parameters
    ----------
    scores : (B, Hkv, P)
    word_ids : (B, Hkv, P) long, the word each slot's token belongs to (equal within a word)
    num_words : an upper bound on the word ids (exclusive) when the caller knows it on the host (the engine
        does: ids are below the context length); None renumbers the ids densely first

    Returns
    -------
    (B, Hkv, P)
    """
    if num_words is None:
        word_ids = torch.unique(word_ids, return_inverse=True)[1]  # (B, Hkv, P) ids in [0, n_words)
        num_words = scores.shape[-1]  # n_words <= P; reading n_words would wait on the device
    best = torch.full((*scores.shape[:2], num_words), float("-inf"), dtype=scores.dtype,
                      device=scores.device)  # (B, Hkv, num_words)
    best = best.scatter_reduce(-1, word_ids, scores, reduce="amax")
    return best.gather(-1, word_ids)  # (B, Hkv, P)


def streaming_positions(length: int, budget: int, sinks: int, bsz: int, n_kv: int, device) -> torch.Tensor:
    """StreamingLLM's kept slots: the first ``sinks`` and the most recent ``budget - sinks``. (B, Hkv, budget)"""
    head = torch.arange(min(sinks, budget), device=device)
    tail = torch.arange(length - (budget - len(head)), length, device=device)
    return torch.cat([head, tail]).expand(bsz, n_kv, -1)


def select_positions(
    scores: torch.Tensor, keep: int, window: int, pinned: torch.Tensor | None, grow: bool, layer: int,
    n_pinned: int | None = None, allocator: Allocator | None = None, allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cache slots to keep: top-``keep`` history slots per KV head, pins forced in, plus the window.

    Parameters
    ----------
    scores : (B, Hkv, P) history scores (P = T - W)
    keep : history slots to keep per KV head (the budget minus the window)
    pinned : (B, Hkv, P) bool, history slots that must be kept, or None
    grow : keep every pin even past ``keep`` (else raise :class:`BudgetError`)
    n_pinned : the most pinned slots any head has, when the caller knows it on the host (the engine does);
        None counts them on the device, which makes the host wait for it
    allocator : shares the layer's ``Hkv * keep`` slots among its heads (:mod:`snapkv_sessions.allocate`);
        None: every head keeps ``keep``
    allowed : (B, Hkv, P) bool, the slots a head may keep (False: padding of an earlier uneven split), or None

    Returns
    -------
    (B, Hkv, K') long, sorted slot indices into the layer's cache, K' = max(keep, pins) + W. When the heads keep
    different numbers of slots, K' is the most any head keeps (plus W), and a head that keeps fewer repeats its
    best slot in the rest: a repeated index is padding (:func:`snapkv_sessions.cache.first_slots`).
    """
    bsz, n_kv, hist = scores.shape
    if pinned is not None:
        if n_pinned is None:
            n_pinned = int(pinned.sum(dim=-1).max())
        if n_pinned > keep:
            if not grow:
                raise BudgetError(
                    f"layers[{layer}].history_budget",
                    keep,
                    f"{n_pinned} pinned positions do not fit; raise the budget or set pin_overflow='grow'",
                )
            keep = n_pinned
        scores = scores.masked_fill(pinned, float("inf"))  # (B, Hkv, P)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # (B, Hkv, P) padding is never kept
    counts = allocator.counts(scores, keep) if allocator is not None else None  # (B, Hkv) or None
    if counts is None and allowed is None:
        top = scores.topk(keep, dim=-1).indices  # (B, Hkv, keep)
    else:  # uneven heads: each head's best counts[h] slots, padded with its best one
        if counts is None:
            counts = torch.full(scores.shape[:2], keep, dtype=torch.long, device=scores.device)  # (B, Hkv)
        best = scores.topk(min(int(counts.max()), hist), dim=-1)  # (B, Hkv, K) the one host read of the split
        rank = torch.arange(best.indices.shape[-1], device=scores.device)  # (K,)
        real = (rank < counts[..., None]) & (best.values > float("-inf"))  # (B, Hkv, K)
        top = torch.where(real, best.indices, best.indices[..., :1])  # (B, Hkv, K)
    recent = torch.arange(hist, hist + window, device=scores.device).expand(bsz, n_kv, window)  # (B, Hkv, W)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values  # (B, Hkv, keep + W)


def layer_budgets(cfg: CompressionConfig, num_layers: int, context_tokens: int) -> list[int]:
    """Tokens each layer keeps (window included) for a context of ``context_tokens`` true positions.

    ``uniform`` gives every layer the budget. ``pyramid`` (PyramidKV) spreads the same total history budget
    linearly from ``2*b - b/beta`` at layer 0 down to ``b/beta`` at the top, b being the history budget
    (budget - window); rounding is corrected so the total is exact.
    """
    budget = cfg.budget_for(context_tokens)
    if cfg.strategy == "uniform" or num_layers == 1:
        return [budget] * num_layers
    hist = budget - cfg.window
    low = hist / cfg.pyramid_beta
    high = 2 * hist - low
    raw = torch.linspace(high, low, num_layers, dtype=torch.float64)  # (L,)
    sizes = raw.floor().long()
    short = hist * num_layers - int(sizes.sum())
    order = torch.argsort(raw - sizes, descending=True)  # largest remainders first
    sizes[order[:short]] += 1
    return [max(1, int(s)) + cfg.window for s in sizes]


def history_room(cfg: CompressionConfig, num_layers: int, context_tokens: int, window: int | None = None) -> int:
    """History slots the tightest layer keeps for a context of ``context_tokens`` beside its observation window
    (``cfg.window``, or the shorter ``window`` a short turn observes): what pins and a protected question must fit."""
    return min(layer_budgets(cfg, num_layers, context_tokens)) - (cfg.window if window is None else window)
