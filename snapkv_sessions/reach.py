"""What a turn's window reaches for: the attention-side task-shift signal of the tiered memory.

With the tier, every turn's prefill attends to the whole history and its compression chooses the hot set afresh
from all of it. Whatever was cold when the turn began (evicted by an earlier turn's compression) is known exactly
(:class:`Before`, from :meth:`~snapkv_sessions.cache.HotOnly.hot_before`), so the turn can say, per layer and KV
head, how much of its observation window's attention lay on those positions and how much of its new hot set came
back from them. A question about something the earlier windows did not look at reaches into the cold; a follow-up
finds what it needs already hot. The text signals (:mod:`snapkv_sessions.drift`) read the question's words before
the prefill; this one reads the model's attention after it, at no extra forward.

Both shares exclude the attention sinks (the first positions, always hot and always attended) and this turn's own
tokens (never cold). Per layer and KV head the window's mass is the mean over the head's GQA group of query heads.
The turn's figure is the median over the heads of the upper half of the layers (the lower layers attend by
position and syntax more than by content).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .attention import WindowProbe
from .cache import History

SINKS = 4  # the first positions: attended by every query, and pinned hot


@dataclass(frozen=True)
class Before:
    """What the memory held hot when the turn began.

    hot[l] (B, Hkv, T_l): the true positions each layer and KV head held (-1 at padding slots); history: the
    positions the conversation had then (every later one is this turn's, never cold)."""

    hot: list[torch.Tensor]
    history: int


def cold_reach(history: History, probe: WindowProbe, before: Before, chosen: dict[int, torch.Tensor],
               sinks: int = SINKS) -> torch.Tensor | None:
    """Per layer and KV head, the share of the window's mass on the earlier history that lay on positions cold
    before the turn, and the share of the new hot set's earlier-history slots that came back from cold.

    ``chosen[l]`` (B, Hkv, K): the slots the compression kept (true positions on a tiered cache); a layer absent
    from it kept every position. Returns a (2, L, Hkv) float32 device tensor (batch row 0, a session's), read by
    the caller with the rest of the report; None when nothing predates this prefill beyond the sinks or nothing
    was hot before (a first turn)."""
    old_end = earlier_end(probe, before)
    if old_end <= sinks or not probe.scores or not before.hot:
        return None
    rows = []
    for layer, scores in sorted(probe.scores.items()):  # (B, Hq, T)
        pos = history.positions[layer][:1]  # (1, Hkv, T) true positions of the layer's slots
        heads, length = pos.shape[1], pos.shape[-1]
        mass = scores[:1].float().view(1, heads, -1, length).mean(2)  # (1, Hkv, T): the GQA group's mean
        was_hot = _was_hot(before.hot[layer][:1], before.history, old_end, pos.device)  # (1, Hkv, N0)
        old = (pos >= sinks) & (pos < old_end)  # (1, Hkv, T) earlier-history slots, no sinks
        cold = old & ~was_hot.gather(-1, pos.clamp(max=old_end - 1))  # (1, Hkv, T)
        cold_mass = (mass * cold).sum(-1) / (mass * old).sum(-1).clamp_min(1e-30)  # (1, Hkv)
        kept = chosen.get(layer)
        kept = pos if kept is None else pos.gather(-1, kept[:1])  # (1, Hkv, K) true positions kept
        kept_old = (kept >= sinks) & (kept < old_end)  # (1, Hkv, K)
        back = kept_old & ~was_hot.gather(-1, kept.clamp(min=0, max=old_end - 1))  # (1, Hkv, K)
        recalled = back.sum(-1) / kept_old.sum(-1).clamp_min(1)  # (1, Hkv)
        rows.append(torch.stack([cold_mass[0], recalled[0].float()]))  # (2, Hkv)
    return torch.stack(rows, dim=1)  # (2, L, Hkv)


def earlier_end(probe: WindowProbe, before: Before) -> int:
    """The first position the turn's prefill fed (its tokens, and the history it fed again, were never cold)."""
    return min(probe.turn_start, before.history)


def _was_hot(hot: torch.Tensor, history: int, old_end: int, device: torch.device) -> torch.Tensor:
    """(1, Hkv, old_end) bool: True at the earlier-history positions each head held hot (padding -1 left out)."""
    hot = hot.to(device)  # (1, Hkv, T0)
    flags = torch.zeros(*hot.shape[:2], history + 1, dtype=torch.bool, device=device)  # (1, Hkv, N0 + 1)
    flags.scatter_(-1, hot.masked_fill(hot < 0, history), True)  # padding -> the spare slot
    return flags[..., :old_end]  # (1, Hkv, old_end)


@dataclass(frozen=True)
class Reach:
    """One turn's reading of the attention shift signal.

    score: the median over the upper half of the layers' KV heads of ``cold_mass`` (what a threshold applies to);
    recalled: the same median of the recalled share of the new hot set; cold_mass[l][h], recalled_share[l][h]:
    per layer and KV head (3 decimals); earlier: the earlier history's end (positions from ``SINKS`` to it are
    the ones read; the turn's prefill fed the rest)."""

    score: float
    recalled: float
    cold_mass: list[list[float]]
    recalled_share: list[list[float]]
    earlier: int = 0

    @classmethod
    def of(cls, values: list[float], layers: int, heads: int, earlier: int = 0) -> Reach:
        """From :func:`cold_reach`'s tensor read as a flat list (2 * L * Hkv values)."""
        n = layers * heads
        grid = [[[values[k * n + layer * heads + h] for h in range(heads)] for layer in range(layers)]
                for k in range(2)]
        upper = range(layers // 2, layers)
        return cls(score=round(statistics.median(v for lay in upper for v in grid[0][lay]), 4),
                   recalled=round(statistics.median(v for lay in upper for v in grid[1][lay]), 4),
                   cold_mass=[[round(v, 3) for v in row] for row in grid[0]],
                   recalled_share=[[round(v, 3) for v in row] for row in grid[1]], earlier=earlier)

    def to_dict(self) -> dict:
        return {"score": self.score, "recalled": self.recalled, "cold_mass": self.cold_mass,
                "recalled_share": self.recalled_share, "earlier": self.earlier}
