"""The caches a conversation's KV lives in, and the memory protocol the runner drives every turn through.

:class:`CompactCache`: transformers' DynamicCache concatenates the whole layer cache at every token
(``torch.cat``), so a decode step costs a copy of everything held. Here each layer owns a buffer
``(B, Hkv, capacity, D)``; ``keys`` and ``values`` are views of its first ``length`` slots. Compression writes the
kept slots into a buffer of exactly the kept size (resident KV = budget x per-token size);
:meth:`CompactCache.reserve` makes room for a reply's tokens once, before decoding, so that no step reallocates.

Every cache here also answers the turn's memory questions (:class:`HotOnly`): what a turn's compression reads
(:meth:`~HotOnly.history`), how the chosen slots are kept (:meth:`~HotOnly.keep`), and the hooks a turn's start,
prefill and end pass through. A cache without a tier holds its history in the hot slots alone; the tiered cache
(:class:`snapkv_sessions.tier.TieredCache`) overrides them with its host tier, after transformers'
``cache_utils``, where offload and prefetch live inside the cache. The runner calls the protocol and never
knows which memory it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .errors import ConfigError
from .gpu import fused_gather

if TYPE_CHECKING:
    from .reach import Before
    from .state import KVState


def first_slots(positions: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, K) bool: False at a padding slot. Positions are sorted per head and a head that keeps fewer slots
    than its layer's busiest head repeats one of its own (:func:`snapkv_sessions.press.select_positions`), so a
    slot is padding exactly when it repeats the previous slot's true position."""
    real = torch.ones_like(positions, dtype=torch.bool)  # (B, Hkv, K)
    real[..., 1:] = positions[..., 1:] != positions[..., :-1]
    return real


def _no_padding(layer: int) -> None:
    return None


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The slots ``idx`` (B, Hkv, K) of ``x`` (B, Hkv, C, D): (B, Hkv, K, D). One row copy per slot from the flat
    view (``gather`` with an index expanded over D is about eight times slower on a CPU); a view that is not
    contiguous (a slice of a preallocated buffer) is gathered as it is."""
    bsz, heads, cold, dim = x.shape
    if not x.is_contiguous():
        return x.gather(2, idx[..., None].expand(-1, -1, -1, dim))
    base = torch.arange(bsz * heads, device=idx.device).view(bsz, heads, 1) * cold  # (B, Hkv, 1) each head's row 0
    return x.view(-1, dim).index_select(0, (idx + base).flatten()).view(bsz, heads, -1, dim)  # (B, Hkv, K, D)


@dataclass(frozen=True)
class History:
    """What a turn's compression reads and chooses from: every slot the conversation holds, per layer.

    positions[l] (B, Hkv, T_l): the true position of each slot, sorted; token_ids and pinned (N,) over true
    positions; ``kv(l)`` the layer's keys and values (B, Hkv, T_l, D), built on demand (a tiered cache builds one
    layer's union at a time). Scorers read exactly this (:class:`snapkv_sessions.scorers.Scorer`).
    """

    positions: Sequence[torch.Tensor]
    token_ids: Sequence[int]
    pinned: torch.Tensor
    next_position: int
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int  # key and value bytes of every slot held, hot and cold
    visible: Callable[[int], torch.Tensor | None] = _no_padding  # (B, Hkv, T_l) bool: False at padding slots

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv(layer)[0]  # (B, Hkv, T_l, D)

    def values(self, layer: int) -> torch.Tensor:
        return self.kv(layer)[1]  # (B, Hkv, T_l, D)

    def lengths(self) -> list[int]:
        return [int(p.shape[-1]) for p in self.positions]


class HotOnly:
    """The memory protocol of a cache whose history is its hot slots alone (no tier): a turn compresses what the
    cache holds and keeps the chosen slots by gathering them. :class:`~snapkv_sessions.tier.TieredCache`
    overrides each hook."""

    cold = None  # the host tier (snapkv_sessions.tier.ColdKV), on a tiered cache

    @property
    def lost(self) -> str | None:
        """Why the tier no longer holds the session (it must re-prefill from the store); None when it does."""
        return None

    def refeedable(self, state: KVState) -> int:
        """How many tokens of the history the next prefill may feed again (none without a tier)."""
        return 0

    def can_clone(self) -> bool:
        """Whether :meth:`clone` makes an exact copy now (a fork's)."""
        return hasattr(self, "clone")

    def lease(self) -> contextlib.AbstractContextManager[None]:
        """Holds the memory for one turn (a tier is not evicted while leased); nothing to hold here."""
        return contextlib.nullcontext()

    def release(self) -> None:
        """The conversation is done with this cache (its tier, if any, goes back to the pool)."""

    def begin_turn(self, state: KVState, reach: int) -> None:
        """A turn starts. ``reach``: history tokens its prefill's observation window reaches back over (only a
        tier can feed them again)."""

    def attending(self, state: KVState) -> contextlib.AbstractContextManager[None]:
        """For one prefill forward: what the attention sees (here, the hot slots)."""
        return contextlib.nullcontext()

    def prefill_done(self, state: KVState) -> None:
        """The turn's prefill and compression are done; decode writes to the hot slots next."""

    def recall(self, state: KVState, fed: int = 0):
        """For one decode step (``fed`` tokens already written past ``state``'s, a batched slot's): what the step
        recalls from a tier (:class:`snapkv_sessions.recall.Recall`); None here: decode reads the hot slots."""
        return None

    def retake(self, state: KVState, logits: torch.Tensor) -> bool:
        """Whether the decode step that gave ``logits`` (V,) must be taken again over the whole history (a tier's
        recall escalating on a near-tie, ``memory.recall.escalate``); False here: decode read all it holds. When
        True the caller calls :meth:`rewind_decoded` and feeds the step's token again as a prefill."""
        return False

    def rewind_decoded(self, state: KVState) -> None:
        """Send the turn's tokens decoded since the last exact point back to ``state.pending`` (their slots, and any
        slot a step wrote past ``state``, dropped), so that a prefill of the step's token computes them over the
        whole history. Only a cache whose :meth:`retake` can say True has any to send."""
        raise NotImplementedError("only a tiered cache with decode-time recall retakes a step")

    def observe_recall(self, observer) -> None:
        """Have ``observer(layer, positions)`` see what each decode step of this turn recalls (nothing here)."""

    def decode_done(self, state: KVState) -> dict | None:
        """The turn's decode is done: what it recalled, for the turn's report (None without recall)."""
        return None

    def history(self, state: KVState) -> History:
        layers = self.layers  # type: ignore[attr-defined]  # the Cache's layers
        return History(state.positions, state.token_ids, state.pinned, state.next_position,
                       lambda layer: (layers[layer].keys, layers[layer].values), state.kv_bytes(),
                       lambda layer: getattr(layers[layer], "visible", None))

    def key_masks(self) -> LayerMasks | None:
        """For one forward: per layer the keys attention may see, read as the layer runs (None: all of them,
        the cache holds no padding)."""
        layers = self.layers  # type: ignore[attr-defined]
        if not any(getattr(lay, "_vis", None) is not None for lay in layers):
            return None
        return LayerMasks(layers)

    def keep(self, state: KVState, chosen: dict[int, torch.Tensor],
             visible: dict[int, torch.Tensor] | None = None) -> bool:
        """Keep each chosen layer's slots ``chosen[l]`` (B, Hkv, K); ``visible[l]`` (B, Hkv, K) bool marks the
        real ones of a layer whose heads keep different numbers (False: padding). Returns whether the memory
        changed."""
        if not chosen:
            return False
        visible = visible or {}
        layers = self.layers  # type: ignore[attr-defined]
        fused = None
        if isinstance(self, CompactCache) and len(chosen) == len(layers) and len({i.shape for i in chosen.values()}) == 1:
            fused = fused_gather(layers[0].keys.device)  # Triton on CUDA; None elsewhere
        if fused is not None:
            idx = torch.stack([chosen[layer] for layer in range(len(layers))])  # (L, B, Hkv, K)
            keys, values = fused([lay.keys for lay in layers], [lay.values for lay in layers], idx)  # (L, B, Hkv, K, D)
            self.replace_all(keys, values)
            for layer, lay in enumerate(layers):
                lay.set_visible(visible.get(layer))
        else:
            for layer, idx in chosen.items():
                lay = layers[layer]
                set_layer(lay, gather_slots(lay.keys, idx), gather_slots(lay.values, idx), visible.get(layer))
        for layer, idx in chosen.items():
            state.positions[layer] = state.positions[layer].gather(-1, idx)  # (B, Hkv, K)
        return True

    def tier_report(self, state: KVState) -> dict | None:
        """The tier's figures for the turn's compression report (None without a tier)."""
        return None

    def hot_before(self) -> Before | None:
        """What was hot when the turn began, against which the window's reach into the cold is read
        (:mod:`snapkv_sessions.reach`); None without a tier: nothing evicted can be told from nothing held."""
        return None


class LayerMasks:
    """``masks.get(layer)``: the layer's key mask (B, Hkv, 1, T) for the keys its last update returned, or None;
    read by the attention function when the layer runs (``snapkv_keymask=``), after the layer's update."""

    def __init__(self, layers) -> None:
        self.layers = layers

    def get(self, layer: int) -> torch.Tensor | None:
        return self.layers[layer].key_mask()


class CompactLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer; ``keys``/``values`` are views of the used part.

    A layer whose heads keep different numbers of slots (an uneven allocator, :mod:`snapkv_sessions.allocate`)
    also holds ``visible`` (B, Hkv, length) bool: False at the padding slots, which attention never sees. None
    (the usual case): every slot is real.
    """

    _vis: torch.Tensor | None = None  # (B, Hkv, capacity) bool, or None: no padding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        bsz, heads, _, dim = key_states.shape
        self._k = key_states.new_empty(bsz, heads, 0, dim)  # (B, Hkv, capacity, D)
        self._v = value_states.new_empty(bsz, heads, 0, value_states.shape[-1])
        self._vis = None
        self.length = 0
        self._sync_views()
        self.is_initialized = True

    def _sync_views(self) -> None:
        self.keys = self._k[:, :, : self.length]  # (B, Hkv, length, D), a view
        self.values = self._v[:, :, : self.length]

    @property
    def visible(self) -> torch.Tensor | None:
        """(B, Hkv, length) bool, False at padding slots; None when the layer holds none."""
        return None if self._vis is None else self._vis[..., : self.length]

    def set_visible(self, visible: torch.Tensor | None) -> None:
        """Mark the held slots' padding: ``visible`` (B, Hkv, length) bool, or None for none."""
        if visible is None:
            self._vis = None
            return
        vis = visible.new_ones(*visible.shape[:2], self.capacity)  # (B, Hkv, capacity) slots to come are real
        vis[..., : visible.shape[-1]] = visible
        self._vis = vis

    def key_mask(self) -> torch.Tensor | None:
        """(B, Hkv, 1, length) bool: the keys attention may see; None: all of them."""
        return None if self._vis is None else self._vis[:, :, None, : self.length]

    @property
    def capacity(self) -> int:
        return self._k.shape[-2] if self.is_initialized else 0

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more slots (one reallocation at most)."""
        need = self.length + extra
        if need <= self.capacity:
            return
        k = self._k.new_empty(*self._k.shape[:2], need, self._k.shape[-1])  # (B, Hkv, need, D)
        v = self._v.new_empty(*self._v.shape[:2], need, self._v.shape[-1])
        k[:, :, : self.length] = self.keys
        v[:, :, : self.length] = self.values
        k[:, :, self.length :] = 0  # a decode step may read the spare slots, masked (attention._whole_buffers):
        v[:, :, self.length :] = 0  # they must hold numbers, never NaN bit patterns left in fresh memory
        self._k, self._v = k, v
        if self._vis is not None:
            vis = self._vis.new_ones(*self._vis.shape[:2], need)  # (B, Hkv, need)
            vis[..., : self.length] = self._vis[..., : self.length]
            self._vis = vis
        self._sync_views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            # prefills grow geometrically; decode steps never get here after reserve()
            self.reserve(max(n, self.capacity // 2))
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        if self._vis is not None:
            self._vis[..., self.length : self.length + n] = True
        self.length += n
        self._sync_views()
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Forget every slot from ``length`` on (a reply's decoded slots, fed again by the next turn)."""
        self.length = min(self.length, length)
        self._sync_views()

    def replace(self, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None = None) -> None:
        """Hold exactly these slots (after a compression): the buffer becomes them, capacity == length;
        ``visible`` (B, Hkv, K) marks their padding (None: none)."""
        self._k, self._v = keys.contiguous(), values.contiguous()
        self.length = keys.shape[-2]
        self._vis = None if visible is None else visible.contiguous()
        self._sync_views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def allocated_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


class CompactCache(HotOnly, Cache):
    """A Cache of :class:`CompactLayer`, one per model layer."""

    layer_class: type[CompactLayer] = CompactLayer

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[self.layer_class() for _ in range(num_layers)])

    def reserve(self, extra: int) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.reserve(extra)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def clone(self) -> CompactCache:
        """An independent copy of the slots held (no spare capacity): a fork of a session starts from it."""
        out = CompactCache(len(self.layers))
        self._copy_into(out)
        return out

    def _copy_into(self, out: CompactCache) -> None:
        for mine, theirs in zip(out.layers, self.layers, strict=True):
            if theirs.is_initialized:
                mine.lazy_initialization(theirs.keys, theirs.values)
                vis = theirs.visible
                mine.replace(theirs.keys.clone(), theirs.values.clone(),  # (B, Hkv, length, D) each
                             None if vis is None else vis.clone())

    def replace_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every layer holds exactly its slice of ``keys``/``values`` (L, B, Hkv, K, D): one storage for all."""
        for layer, lay in enumerate(self.layers):
            lay.replace(keys[layer], values[layer])  # contiguous slices: views, no copy


class PlainDynamicCache(HotOnly, DynamicCache):
    """transformers' DynamicCache (concatenates at every step), with the memory protocol of a cache without a
    tier (the runner's ``cache="dynamic"``)."""

    def can_clone(self) -> bool:
        return False


def set_layer(layer, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None = None) -> None:
    """Store compressed keys/values in any supported cache layer; ``visible`` marks padding slots, which only the
    compact layers can hide from attention."""
    if isinstance(layer, CompactLayer):
        layer.replace(keys, values, visible)
    elif visible is not None:
        raise ConfigError("cache", "dynamic", "heads keeping different numbers of slots (an uneven allocator) "
                          "need the 'compact' cache")
    else:
        layer.keys, layer.values = keys, values
