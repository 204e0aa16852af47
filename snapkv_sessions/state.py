"""KVState: a conversation's compressed cache plus the TRUE position of every slot it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .report import CompressionReport


@dataclass
class KVState:
    """The model-side state of one conversation.

    Attributes
    ----------
    cache:
        The transformers cache; ``cache.layers[l].keys`` is (B, Hkv, T_l, D), post-RoPE. T_l differs between
        layers under a pyramid budget. It is also the conversation's memory (:class:`~snapkv_sessions.cache.HotOnly`):
        a :class:`~snapkv_sessions.tier.TieredCache` holds what compression evicted in its host tier.
    positions:
        ``positions[l]`` (B, Hkv, T_l) long: the true (absolute) position of each slot of layer ``l``, per KV
        head. Sorted along the last dim. This is what the audit maps back to messages.
    token_ids:
        Every token that went into the cache, indexed by true position.
    pinned:
        (N,) bool over true positions: positions that compression must never evict.
    pending:
        Tokens of the transcript not yet in the cache (the last sampled token of a reply, or history a tiered
        turn feeds again); the next prefill feeds them first.
    pending_pinned:
        Pin flags of the first ``len(pending_pinned)`` pending tokens (history sent back by :meth:`requeue`);
        the others are not pinned.
    reports:
        One CompressionReport per compression, in order.
    """

    cache: object
    positions: list[torch.Tensor] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pinned: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    pending: list[int] = field(default_factory=list)
    pending_pinned: list[bool] = field(default_factory=list)
    reports: list[CompressionReport] = field(default_factory=list)
    last_stop_reason: str | None = None
    # how the current turn's prefill attended onto the cache (transcript.PREFILL_ATTENTION); a step taken again over
    # the whole history during its decode attends the same way. None: no turn ran yet (the runner's own)
    attention: str | None = None

    @property
    def cold(self):
        """The tiered cache's host tier (:class:`~snapkv_sessions.tier.ColdKV`), for reading; None untiered."""
        return self.cache.cold

    @property
    def next_position(self) -> int:
        """The true position the next token fed to the cache gets (never the compressed length)."""
        return len(self.token_ids)

    def cache_lengths(self) -> list[int]:
        """Slots held per layer."""
        return [int(p.shape[-1]) for p in self.positions]

    def kv_bytes(self) -> int:
        """Key and value bytes resident in the cache, all layers."""
        return sum(lay.keys.numel() * lay.keys.element_size() * 2 for lay in self.cache.layers)

    def kept_positions(self, layer: int, head: int, batch: int = 0) -> list[int]:
        """True positions held by one layer and KV head (its padding slots left out)."""
        return [p for p in self.held()[layer][batch, head].tolist() if p >= 0]

    def held(self) -> list[torch.Tensor]:
        """``positions[l]`` (B, Hkv, T_l) with -1 at the padding slots of heads that keep fewer slots than their
        layer's busiest head (:mod:`snapkv_sessions.allocate`): what the turn records, the audit and drift read."""
        out = []
        for pos, lay in zip(self.positions, self.cache.layers, strict=False):
            visible = getattr(lay, "visible", None)  # (B, Hkv, T_l) bool or None
            out.append(pos if visible is None else pos.masked_fill(~visible, -1))
        return out

    def clone(self) -> KVState:
        """An independent copy (a fork's): the hot cache copied, a tier's cold layers shared
        (:meth:`~snapkv_sessions.tier.TieredCache.clone`). Only the compact caches clone."""
        return KVState(cache=self.cache.clone(), positions=[p.clone() for p in self.positions],
                       token_ids=list(self.token_ids), pinned=self.pinned.clone(), pending=list(self.pending),
                       pending_pinned=list(self.pending_pinned), reports=list(self.reports),
                       last_stop_reason=self.last_stop_reason, attention=self.attention)

    def requeue(self, start: int) -> None:
        """Send the tokens at true positions ``start`` and after back to ``pending``, ahead of what is pending
        there, with their pin flags. The caller has already taken their slots out of the cache."""
        self.pending_pinned = self.pinned[start:].tolist() + self.pending_pinned
        self.pending = self.token_ids[start:] + self.pending
        del self.token_ids[start:]
        self.pinned = self.pinned[:start]

    def take_pending(self) -> tuple[list[int], list[bool]]:
        """The pending tokens and their pin flags, leaving none pending."""
        ids, flags = self.pending, self.pending_pinned + [False] * (len(self.pending) - len(self.pending_pinned))
        self.pending, self.pending_pinned = [], []
        return ids, flags

    def append(self, ids: list[int], pinned: list[bool], heads: int, device: torch.device) -> None:
        """Account for ``ids`` having been written to the end of every layer's cache."""
        start = self.next_position
        new = torch.arange(start, start + len(ids), device=device)  # (n,)
        self.token_ids.extend(ids)
        flags = torch.tensor(pinned, dtype=torch.bool, device=self.pinned.device)  # (n,)
        self.pinned = torch.cat([self.pinned, flags])
        for layer in range(len(self.cache.layers)):
            grown = new.expand(1, heads, len(ids))  # (B, Hkv, n)
            if layer < len(self.positions):
                self.positions[layer] = torch.cat([self.positions[layer], grown], dim=-1)
            else:
                self.positions.append(grown.clone())
