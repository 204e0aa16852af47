"""Tiered KV memory: what compression evicts waits in a host tier, and every turn's prefill sees all of it.

A :class:`TieredCache` is the conversation's cache: its hot layers (on the model's device) hold the budget and
are what decode reads; its :class:`ColdKV` holds, per layer and KV head, every slot the last compression evicted,
with its true position, in host memory (pinned on CUDA). Hot and cold together always hold every position of the
history exactly once, so a turn's prefill can attend to all of it (:meth:`TieredCache.attending`, one layer's
:func:`union` at a time) and the compression can choose the new hot set from all of it
(:meth:`TieredCache.history`, :meth:`TieredCache.keep`): the turn then equals a fresh full prefill compressed with
this turn's window ("re-prefill every turn"), without the re-prefill. The reply tokens, whose KV decode computed
against the hot cache alone, are fed again with the next turn's tokens (:meth:`TieredCache.begin_turn`).

:class:`~snapkv_sessions.tierpool.TierPool` caps the bytes all sessions of a process keep cold, drops (or spills
to disk as safetensors) the least recently used session's tier first, and says why; a session whose tier is gone
re-prefills from the store, which stays exact.

Design after serving engines' host tiers (SGLang HiCache, LMCache) and RepairKV's recall of evicted tokens;
the selection is SnapKV's (Li et al., 2024, arXiv:2404.14469).
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import CompactCache, CompactLayer, History, gather_slots
from .reach import Before
from .recall import Recall, RecallConfig, RecallStats
from .rotary import Rotary


@dataclass
class TierStats:
    """What the tier did during one turn (reset by :meth:`ColdKV.begin_turn`).

    streamed_bytes: cold key+value bytes read into a transient union buffer (prefill and compression)
    peak_transient_bytes: the largest union buffer held at once (one layer: its history plus the new tokens)
    recalled: slots that came back from cold to hot in this turn's compression, all layers and heads
    peak_cold_layers: the most layers' cold parts brought to the compute device at once (the layer in use and
        the next one, prefetched; :class:`ColdStream`)
    """

    streamed_bytes: int = 0
    peak_transient_bytes: int = 0
    recalled: int = 0
    peak_cold_layers: int = 0

    def to_dict(self) -> dict:
        return {"streamed_bytes": self.streamed_bytes, "peak_transient_bytes": self.peak_transient_bytes,
                "recalled": self.recalled, "peak_cold_layers": self.peak_cold_layers}


@dataclass
class ColdLayer:
    """One layer's evicted slots, in host memory.

    keys, values: (B, Hkv, C, D); positions: (B, Hkv, C) long, the true position of every slot, sorted. Where the
    heads evicted different numbers of slots, C is the most any head evicted and a head that evicted fewer repeats
    a slot of its own history (the same true position and keys and values, so the union is unchanged); ``real``
    (B, Hkv, C) bool is then False at those repeats (decode-time recall never reads them), else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor | None = None

    @property
    def padded(self) -> bool:
        return self.real is not None

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class ColdKV:
    """One session's cold tier: per layer, the slots its compressions evicted (None: nothing evicted yet).

    ``lost`` says why the tier no longer holds the session (evicted by the pool's cap), after which the session
    must re-prefill. ``decode_start``: the first true position a decode wrote to the hot cache (the reply), fed
    again by the next turn.
    """

    layers: list[ColdLayer | None]
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    lost: str | None = None
    decode_start: int | None = None
    stats: TierStats = field(default_factory=TierStats)
    spilled: Path | None = None
    refeed_reply: bool = True  # False: the reply keeps the KV decode computed (policy memory.refeed_reply)
    hot_at_start: list[torch.Tensor] = field(default_factory=list)  # set by begin_turn
    history_at_start: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> ColdKV:
        return cls(layers=[None] * num_layers)

    @property
    def nbytes(self) -> int:
        return sum(lay.nbytes for lay in self.layers if lay is not None)

    def clone(self) -> ColdKV:
        """A tier of its own for a fork, holding the same evicted slots. The layers are shared, not copied: a
        tier replaces a layer whole (a compression's eviction, a fold, a spill) and never writes one in place."""
        if self.lost is not None or self.spilled is not None:
            raise RuntimeError("a tier that no longer holds its session cannot be cloned")
        return ColdKV(layers=list(self.layers), decode_start=self.decode_start, refeed_reply=self.refeed_reply)

    def drop(self, reason: str) -> None:
        """Forget the evicted slots; the session's next turn re-prefills and records ``reason``."""
        self.layers = [None] * len(self.layers)
        self.lost = reason

def _spread(slots: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``slots`` (B, Hkv, S, D) into ``out`` (B, Hkv, N, D) at their true ``positions`` (B, Hkv, S).

    As rows of the flattened buffer: one row copy per slot (a ``scatter_`` along dim 2 indexes every element, and
    took 4x as long at 8K slots on the CPU)."""
    bsz, heads, n, dim = out.shape
    base = torch.arange(bsz * heads, device=out.device).view(bsz, heads, 1) * n  # (B, Hkv, 1) each head's first row
    rows = (base + positions).reshape(-1)  # (B * Hkv * S,)
    out.view(-1, dim).index_copy_(0, rows, slots.reshape(-1, dim))


def union(hot_keys: torch.Tensor, hot_values: torch.Tensor, hot_positions: torch.Tensor, cold: ColdLayer | None,
          stats: TierStats, history: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's whole history in true-position order, plus the slots a forward just appended.

    Parameters
    ----------
    hot_keys, hot_values : (B, Hkv, H + n, D): the hot slots, then ``n`` slots appended by this forward
    hot_positions : (B, Hkv, H) true positions of the first H hot slots
    cold : the layer's cold slots (B, Hkv, C, ...), or None
    history : N, the true positions hot and cold hold; None: H + C (every slot a distinct position). Padding slots
        (heads keeping uneven counts) repeat a position with its own keys and values, so writing them is harmless.

    Returns
    -------
    keys, values (B, Hkv, N + n, D): slot ``p`` holds true position ``p`` for p < N (hot and cold together hold
    every position of the history), then the ``n`` new slots. A transient buffer: only the layer being computed
    holds one.
    """
    held = hot_positions.shape[-1]
    n_cold = 0 if cold is None else cold.positions.shape[-1]
    bsz, heads, total, dim = hot_keys.shape
    hist = held + n_cold if history is None else history
    out_k = hot_keys.new_empty(bsz, heads, hist + total - held, dim)  # (B, Hkv, N + n, D)
    out_v = hot_values.new_empty(bsz, heads, hist + total - held, hot_values.shape[-1])
    _spread(hot_keys[:, :, :held], hot_positions, out_k)
    _spread(hot_values[:, :, :held], hot_positions, out_v)
    if cold is not None:
        device = hot_keys.device
        cold_pos = cold.positions.to(device, non_blocking=True)  # (B, Hkv, C)
        _spread(cold.keys.to(device, non_blocking=True), cold_pos, out_k)
        _spread(cold.values.to(device, non_blocking=True), cold_pos, out_v)
        stats.streamed_bytes += cold.nbytes
    out_k[:, :, hist:] = hot_keys[:, :, held:]
    out_v[:, :, hist:] = hot_values[:, :, held:]
    stats.peak_transient_bytes = max(stats.peak_transient_bytes, 2 * out_k.numel() * out_k.element_size())
    return out_k, out_v


class ColdStream:
    """Brings each layer's cold slots to the compute device just ahead of their use.

    When layer ``l`` takes its cold part, the copy of the next layer's is issued (on CUDA: on a side stream, from
    page-locked memory, so it overlaps layer ``l``'s attention and MLP; the layer that uses it waits on its event).
    At most two layers' cold parts are on the device at once: the one in use and the next. On the host there is
    nothing to copy and the parts are the host tensors themselves; the same order and bound hold.
    """

    def __init__(self, cold: ColdKV, device: torch.device) -> None:
        self.cold, self.device = cold, device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[ColdLayer, object]] = {}  # layer -> (its cold part on the device, copy event)

    def take(self, layer: int) -> ColdLayer | None:
        """The layer's cold part on the device (None: nothing of it is cold); issues the next layer's copy."""
        self._issue(layer)
        nxt = next((i for i in range(layer + 1, len(self.cold.layers)) if self.cold.layers[i] is not None), None)
        if nxt is not None:
            self._issue(nxt)
        part, event = self.ready.pop(layer, (None, None))
        if event is not None:  # the compute stream waits for the copy; the tensors stay alive for it
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in (part.keys, part.values, part.positions):
                t.record_stream(current)
        return part

    def _issue(self, layer: int) -> None:
        part = self.cold.layers[layer]
        if part is None or layer in self.ready:
            return
        if self.side is None:
            self.ready[layer] = (part, None)
        else:
            with torch.cuda.stream(self.side):
                moved = ColdLayer(*(t.to(self.device, non_blocking=True) for t in (part.keys, part.values,
                                                                                 part.positions)),
                                  None if part.real is None else part.real.to(self.device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.side)
            self.ready[layer] = (moved, event)
        self.cold.stats.peak_cold_layers = max(self.cold.stats.peak_cold_layers, len(self.ready))


class TieredLayer(CompactLayer):
    """A hot layer whose prefill forwards attend to the layer's whole history: while its cache is
    :meth:`TieredCache.attending`, :meth:`update` returns the union of the hot slots, the layer's cold part and the
    new slots (:func:`union`), a transient buffer dropped after the layer runs."""

    whole: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    _union = False  # the last update returned the union (every position once: no padding to hide)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # (B, Hkv, H + n, D) hot
        self._union = self.whole is not None
        if self._union:
            return self.whole(keys, values)  # (B, Hkv, N + n, D)
        return keys, values

    def key_mask(self) -> torch.Tensor | None:
        return None if self._union else super().key_mask()


class TieredCache(CompactCache):
    """The hot cache (:class:`TieredLayer` per model layer, on the model's device) and its host tier
    (:class:`ColdKV`, :attr:`cold`): hot and cold together hold every position of the history exactly once.

    Every turn: :meth:`begin_turn` feeds the last reply again (and the history a short turn's window reaches back
    over); each prefill forward runs :meth:`attending`, so every layer attends to its whole history; the
    compression reads :meth:`history` (the union, one layer at a time) and :meth:`keep` makes the chosen slots hot
    and the rest cold. :meth:`lease` holds the tier against the pool's cap for the turn.
    """

    layer_class = TieredLayer

    def __init__(self, num_layers: int, cold: ColdKV | None = None, recall: RecallConfig | None = None,
                 rotary: Rotary | None = None) -> None:
        super().__init__(num_layers)
        self.cold: ColdKV = cold if cold is not None else ColdKV.empty(num_layers)
        self.recall_config = recall  # decode-time recall from the tier (None: decode reads the hot slots)
        self.rotary = rotary  # the model's RoPE, for selectors that summarise keys before it
        self._recall: Recall | None = None  # the current turn's, from its prefill to the end of its decode

    # ------------------------------------------------------------------ the tier's standing

    @property
    def lost(self) -> str | None:
        return self.cold.lost

    def refeedable(self, state) -> int:
        """All of the history: each token's KV is exactly recomputable over the whole of it; none when the policy
        keeps the reply's decoded KV."""
        return state.next_position if self.cold.refeed_reply else 0

    def can_clone(self) -> bool:
        return self.cold.lost is None and self.cold.spilled is None

    def clone(self) -> TieredCache:
        """A copy of the hot slots and a tier of its own sharing the cold layers (:meth:`ColdKV.clone`)."""
        out = TieredCache(len(self.layers), self.cold.clone(), self.recall_config, self.rotary)
        self._copy_into(out)
        return out

    @contextlib.contextmanager
    def lease(self) -> Iterator[None]:
        """The turn's hold on the tier: in use (never evicted by the pool) until the turn ends; then the pool is
        brought within its cap, the least recently used idle tiers first. A tier lost before the lease raises:
        a replay cannot follow its record without it (a live turn re-prefills before it asks)."""
        from .tierpool import POOL

        if self.cold.lost:
            raise TierLost(self.cold.lost)
        POOL.touch(self.cold)
        try:
            yield
        finally:
            POOL.done(self.cold)
            POOL.enforce()

    def release(self) -> None:
        from .tierpool import POOL

        POOL.release(self.cold)

    # ------------------------------------------------------------------ a turn

    def begin_turn(self, state, reach: int) -> None:
        """Fresh stats, what was hot (what "recalled" counts against), then the rewind: the last reply's KV was
        decoded against the hot cache alone, so it is fed again over the whole history; a turn shorter than its
        window also feeds again the ``reach`` history tokens its window reaches back over."""
        cold = self.cold
        cold.stats = TierStats()
        self._recall = None
        cold.hot_at_start = list(state.positions)  # per layer (B, Hkv, T): slots hot before this turn
        cold.history_at_start = state.next_position
        self._rewind(state, reach)

    def _rewind(self, state, n: int) -> int:
        """Send the history's last ``n`` tokens (at least the last reply's) back to ``state.pending``, so the next
        prefill computes their KV, and their queries' scores, over the whole history.

        The reply alone was appended last by decode in every layer: its slots are cut off the hot cache. Reaching
        further back folds the layer's hot slots into the cold tier, where every position below the cut is then
        held once. The turn's compression chooses hot afresh from the union either way. Returns the tokens rewound.
        """
        cold = self.cold
        if cold.lost is not None or cold.spilled is not None:  # folding would read slots the tier no longer holds
            raise RuntimeError(f"the cold tier does not hold the session ({cold.lost or 'spilled to disk'}); "
                               "re-prefill from the store")
        reply = 0 if cold.decode_start is None or not cold.refeed_reply else max(0, state.next_position
                                                                                   - cold.decode_start)
        cold.decode_start = None
        n = min(max(n, reply), state.next_position)
        if n == 0:
            return 0
        start = state.next_position - n
        if n == reply:
            self._cut_decoded(state, n)
        else:
            for layer in range(len(self.layers)):
                self._fold(state, layer, start)
        state.requeue(start)
        return n

    def _cut_decoded(self, state, n: int) -> None:
        """Drop the last ``n`` tokens ``state`` accounts for from every hot layer (decode appended them last, in
        every layer), and any slot a step wrote past ``state`` with them."""
        for layer, lay in enumerate(self.layers):
            keep = int(state.positions[layer].shape[-1]) - n
            lay.truncate(keep)
            state.positions[layer] = state.positions[layer][..., :keep]  # (B, Hkv, T - n)

    def _fold(self, state, layer: int, start: int) -> None:
        """Move the layer's whole history below ``start`` to the cold tier (every head holds all of it) and
        empty its hot slots; the slots at ``start`` and after are dropped."""
        lay = self.layers[layer]
        keys, values = union(lay.keys, lay.values, state.positions[layer], self.cold.layers[layer], self.cold.stats,
                             state.next_position)
        pin = keys.device.type == "cuda"
        bsz, heads = keys.shape[:2]
        positions = torch.arange(start, device=keys.device).expand(bsz, heads, start)  # (B, Hkv, start)
        self.cold.layers[layer] = ColdLayer(_host(keys[:, :, :start], pin), _host(values[:, :, :start], pin),
                                            _host(positions, pin)) if start else None
        lay.truncate(0)
        state.positions[layer] = state.positions[layer][..., :0]  # (B, Hkv, 0)

    @contextlib.contextmanager
    def attending(self, state) -> Iterator[None]:
        """For one prefill forward: each layer attends to its hot and cold slots together (:func:`union`), built
        when the layer runs and dropped after it; the next layer's cold part is brought over meanwhile."""
        cold = self.cold
        if all(lay is None for lay in cold.layers):
            yield
            return
        stream = ColdStream(cold, state.positions[0].device)
        for layer, lay in enumerate(self.layers):
            if cold.layers[layer] is not None:
                lay.whole = functools.partial(_attend, positions=state.positions[layer], stream=stream, layer=layer,
                                              history=state.next_position)
        try:
            yield
        finally:
            for lay in self.layers:
                lay.whole = None

    def prefill_done(self, state) -> None:
        self.cold.decode_start = state.next_position  # the reply decode writes from here is fed again next turn
        if self.recall_config is not None:  # one Recall for the turn's decode: selector summaries are kept
            self._recall = Recall(self.recall_config, self.cold, RecallStats(), self.rotary, state.next_position)

    @property
    def current_recall(self) -> Recall | None:
        """The running turn's recall (from its prefill to the end of its decode), for an observer to watch."""
        return self._recall

    def observe_recall(self, observer) -> None:
        if self._recall is not None:
            self._recall.observer = observer

    def recall(self, state, fed: int = 0) -> Recall | None:
        """This decode step's recall from the tier (None: no recall configured, or nothing is cold)."""
        rec = self._recalling()
        if rec is None:
            return None
        rec.begin_step(state.next_position + fed + 1, state.kv_bytes())
        return rec

    def _recalling(self) -> Recall | None:
        """The turn's recall while anything is cold (with nothing cold, decode reads the whole history)."""
        if self._recall is None or all(part is None for part in self.cold.layers):
            return None
        return self._recall

    def retake(self, state, logits: torch.Tensor) -> bool:
        rec = self._recalling()
        return rec is not None and rec.retake(logits)

    def rewind_decoded(self, state) -> None:
        """Decode appended the turn's tokens last in every layer: the ``n`` since the recall's exact point are cut
        off the hot cache (and a step's write past ``state`` with them) and go back to ``state.pending``."""
        rec = self._recall
        if rec is None or state.next_position < rec.exact_until:
            raise RuntimeError("no decode of this turn to take again")
        start = rec.exact_until
        n = state.next_position - start
        self._cut_decoded(state, n)
        state.requeue(start)
        rec.retaken(n + 1, state.kv_bytes())  # the step's own token is fed with them

    def decode_done(self, state) -> dict | None:
        rec, self._recall = self._recall, None
        if rec is None or not rec.stats.steps:
            return None
        return rec.report()

    def history(self, state) -> History:
        """The whole history, every true position 0..N-1 in order in every layer; one layer's union at a time."""
        first = state.positions[0]  # (B, Hkv, T)
        ids = torch.arange(state.next_position, device=first.device)  # (N,)
        positions = [ids.expand(*first.shape[:2], state.next_position)] * len(state.positions)  # (B, Hkv, N) each
        return History(positions, state.token_ids, state.pinned, state.next_position, _Merged(self, state),
                       state.kv_bytes() + self.cold.nbytes)

    def keep(self, state, chosen: dict[int, torch.Tensor], visible: dict[int, torch.Tensor] | None = None) -> bool:
        """Hot becomes the chosen true positions of each layer (all of them where a layer fits its budget); cold
        becomes the rest, moved to host memory. ``visible[l]`` (B, Hkv, K) marks the real slots of a layer whose
        heads keep uneven counts (False: padding). Returns whether anything changed."""
        if not chosen and not self.cold.nbytes:
            return False  # nothing evicted and nothing cold: the hot cache already holds every position in order
        visible = visible or {}
        merged = _Merged(self, state)
        for layer, lay in enumerate(self.layers):
            keys, values = merged(layer)  # (B, Hkv, N, D)
            idx = chosen.get(layer)
            if idx is None:  # the layer fits: every position back to hot
                idx = torch.arange(keys.shape[2], device=keys.device).expand(*keys.shape[:2], -1)  # (B, Hkv, N)
            real = visible.get(layer)  # (B, Hkv, K) or None: every slot real
            self.cold.stats.recalled += self._recalled(layer, idx, keys.shape[:3], real)
            lay.replace(gather_slots(keys, idx), gather_slots(values, idx), real)  # (B, Hkv, K, D) each
            state.positions[layer] = idx
            self.cold.layers[layer] = _evicted(keys, values, idx, real is not None)
        merged.release()
        return True

    def _recalled(self, layer: int, chosen: torch.Tensor, shape: torch.Size, real: torch.Tensor | None) -> int:
        """Slots of ``chosen`` that came back from cold: held before the turn, and not hot then (padding aside)."""
        before = self.cold.hot_at_start
        if layer >= len(before):  # the first turn: nothing was held
            return 0
        return _recalled_count(before[layer], self.cold.history_at_start, chosen, shape, real)

    def hot_before(self) -> Before | None:
        """The hot positions of every layer when the turn began (:meth:`begin_turn`); None on a first turn."""
        cold = self.cold
        return Before(cold.hot_at_start, cold.history_at_start) if cold.hot_at_start else None

    def tier_report(self, state) -> dict:
        return {**self.cold.stats.to_dict(), "hot_bytes": state.kv_bytes(), "cold_bytes": self.cold.nbytes}


class TierLost(RuntimeError):
    """The tier no longer holds the session (its reason is the message): re-prefill from the store."""


class _Merged:
    """``merged(layer)``: the layer's whole history (B, Hkv, N, D) keys and values in true-position order; only
    one layer's union is held at a time (the previous one is released first), with the next layer's cold part
    prefetched (:class:`ColdStream`)."""

    def __init__(self, cache: TieredCache, state) -> None:
        self.cache, self.state = cache, state
        self._memo: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._stream = ColdStream(cache.cold, state.positions[0].device)

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._memo is None or self._memo[0] != layer:
            self._memo = None  # release the previous layer's buffer before building this one
            lay = self.cache.layers[layer]
            self._memo = (layer, union(lay.keys, lay.values, self.state.positions[layer], self._stream.take(layer),
                                       self.cache.cold.stats, self.state.next_position))
        return self._memo[1]

    def release(self) -> None:
        self._memo = None


def _recalled_count(hot_before: torch.Tensor, history: int, chosen: torch.Tensor, shape: torch.Size,
                    real: torch.Tensor | None = None) -> int:
    """How many ``chosen`` (B, Hkv, K) true positions below ``history`` were not among ``hot_before``; ``real``
    (B, Hkv, K) leaves padding slots out (a repeated slot is counted once)."""
    was_hot = torch.zeros(shape, dtype=torch.bool, device=chosen.device)  # (B, Hkv, N)
    was_hot.scatter_(-1, hot_before.to(chosen.device), True)
    was_hot[..., history:] = True  # this turn's tokens were never cold
    back = ~was_hot.gather(-1, chosen)  # (B, Hkv, K)
    return int((back if real is None else back & real).sum())


def _evicted(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, uneven: bool = False) -> ColdLayer | None:
    """The slots of ``keys``/``values`` (B, Hkv, N, D) not in ``kept`` (B, Hkv, K), as a host :class:`ColdLayer`.

    When every head keeps K slots, every head evicts N - K: the cold part is a dense tensor. When the heads keep
    uneven counts (``uneven``: ``kept`` repeats slots as padding), each head's evicted slots are padded up to the
    most any head evicted by repeating its first slot in true-position order (the union is unchanged by it).
    """
    bsz, heads, total, dim = keys.shape
    if not uneven and kept.shape[-1] == total:
        return None
    gone = torch.ones(bsz, heads, total, dtype=torch.bool, device=keys.device)  # (B, Hkv, N)
    gone.scatter_(-1, kept, False)
    if not uneven:
        pos = gone.nonzero()[:, 2].view(bsz, heads, total - kept.shape[-1])  # (B, Hkv, C) sorted per head
    else:
        n_gone = gone.sum(-1)  # (B, Hkv)
        width = int(n_gone.max())  # the one host read of the uneven split
        if width == 0:
            return None
        # evicted positions first (in order), then the kept ones: the first `width` of each head, padding being
        # repeats of the head's first evicted position (or of position 0 where a head evicted nothing)
        order = torch.sort((~gone).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # (B, Hkv, C)
        slot = torch.arange(width, device=keys.device)  # (C,)
        real = slot < n_gone[..., None]  # (B, Hkv, C)
        pos = torch.where(real, order, order[..., :1])  # (B, Hkv, C)
        pos, at = pos.sort(dim=-1, stable=True)  # (B, Hkv, C) sorted, a repeat beside its original
        real = real.gather(-1, at)  # (B, Hkv, C)
    pin = keys.device.type == "cuda"
    return ColdLayer(_host(gather_slots(keys, pos), pin), _host(gather_slots(values, pos), pin), _host(pos, pin),
                     _host(real, pin) if uneven else None)


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy (page-locked on CUDA, so the next turn's copy back can be asynchronous)."""
    if t.device.type == "cpu":
        return t.contiguous()
    return t.to("cpu", non_blocking=False).pin_memory() if pin else t.cpu()


def _covered(hot: torch.Tensor, part: ColdLayer | None, history: int) -> int:
    """The fewest of the ``history`` true positions any head holds in hot (B, Hkv, H) or cold, counted once."""
    seen = torch.zeros(*hot.shape[:2], history, dtype=torch.bool, device=hot.device)  # (B, Hkv, N)
    seen.scatter_(-1, hot, True)
    if part is not None:
        seen.scatter_(-1, part.positions.to(hot.device), True)
    return int(seen.sum(-1).min()) if history else 0


def _attend(keys: torch.Tensor, values: torch.Tensor, *, positions: torch.Tensor, stream: ColdStream, layer: int,
            history: int) -> tuple[torch.Tensor, torch.Tensor]:
    cold = stream.cold
    part = stream.take(layer)
    if part is not None and part.padded:  # uneven heads: count what hot and cold cover, position by position
        held = _covered(positions, part, history)
    else:
        held = positions.shape[-1] + (0 if part is None else part.positions.shape[-1])
    if held != history:  # hot and cold must hold every position once: never attend to an unfilled buffer
        raise RuntimeError(f"layer {layer}: hot and cold hold {held} slots of a {history}-token history "
                           f"(the tier was changed during the turn: {cold.lost or 'no reason recorded'})")
    return union(keys, values, positions, part, cold.stats, history)  # (B, Hkv, N + n, D) each
