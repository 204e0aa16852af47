"""CompressionReport: what one compression did, for logs, the store and the audit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CompressionReport:
    """The record of one compression of a session's cache.

    Attributes
    ----------
    context_tokens: true positions seen so far (the uncompressed context length)
    window: observation window actually used (W, or fewer on a turn shorter than W)
    budgets: per layer, the tokens it may keep (window included)
    tokens_before, tokens_after: per layer, cache slots before and after
    kept: per layer, per KV head, slots kept
    kept_new: per layer, per KV head, of the kept slots those that this turn added (the rest are older history)
    pinned_total: pinned positions in the context
    pinned_kept: pinned positions present in the layer and head that kept the fewest (== pinned_total always)
    score_ms: the window scores, computed during the prefill
    select_ms: pooling, head reduction and top-k, all layers
    gather_ms: building the compressed key/value tensors, all layers
    kv_bytes_before, kv_bytes_after: key+value bytes resident in the cache
    history_attention: the observation window's attention mass on the cache as it was before this prefill
        (first 4 positions, the attention sinks, left out), averaged over layers and query heads; None on a
        first prefill. A candidate task-shift signal: little attention on the history may mean the evidence
        is not there.
    tier: with the tiered memory, the turn's tier figures (:class:`~snapkv_sessions.tier.TierStats`: cold bytes
        streamed, the largest transient union buffer, slots recalled from cold to hot) and the hot and cold
        bytes after the compression; None without it.
    reach: with the tiered memory, what the window reached for that was cold before the turn
        (:class:`~snapkv_sessions.reach.Reach`: the shift score, the recalled share of the new hot set, both per
        layer and KV head); None without a tier or on a first turn.
    """

    context_tokens: int
    window: int
    budgets: list[int]
    tokens_before: list[int]
    tokens_after: list[int]
    kept: list[list[int]] = field(default_factory=list)
    kept_new: list[list[int]] = field(default_factory=list)
    pinned_total: int = 0
    pinned_kept: int = 0
    score_ms: float = 0.0
    select_ms: float = 0.0
    gather_ms: float = 0.0
    kv_bytes_before: int = 0
    kv_bytes_after: int = 0
    history_attention: float | None = None
    tier: dict | None = None
    reach: dict | None = None
    # the window's concentration (stats.CompressionStat): measured only while a stats sink listens, and left out
    # of to_dict, so a turn record is the same with or without metrics
    window_top_mass: float | None = None
    window_entropy: float | None = None

    @property
    def compressed(self) -> bool:
        """Whether any layer was actually compressed (a cache that fits is left alone)."""
        return self.tokens_after != self.tokens_before

    @property
    def total_ms(self) -> float:
        return self.score_ms + self.select_ms + self.gather_ms

    def retention(self) -> dict:
        """Per-layer tokens kept and their share of the context (the turn record's ``retention``). The shares count
        each head's real slots (mean over heads), not the padding of heads keeping uneven counts."""
        held = [sum(heads) / len(heads) for heads in self.kept] if self.kept else self.tokens_after
        shares = [a / self.context_tokens for a in held]
        return {"tokens_after": self.tokens_after, "budgets": self.budgets, "min_share": round(min(shares), 4),
                "max_share": round(max(shares), 4)}

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["window_top_mass"], out["window_entropy"]
        out["compressed"] = self.compressed
        out["total_ms"] = self.total_ms
        return out
