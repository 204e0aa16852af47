"""CompactCache: a preallocated KV cache whose decode step writes in place instead of re-concatenating.

transformers' DynamicCache concatenates the whole layer cache at every token (``torch.cat``), so a decode step
costs a copy of everything held. Here each layer owns a buffer ``(B, Hkv, capacity, D)``; ``keys`` and
``values`` are views of its first ``length`` slots. Compression writes the kept slots into a buffer of exactly
the kept size (resident KV = budget x per-token size); :meth:`CompactCache.reserve` makes room for a reply's
tokens once, before decoding, so that no step reallocates.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CompactLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer; ``keys``/``values`` are views of the used part."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        bsz, heads, _, dim = key_states.shape
        self._k = key_states.new_empty(bsz, heads, 0, dim)  # (B, Hkv, capacity, D)
        self._v = value_states.new_empty(bsz, heads, 0, value_states.shape[-1])
        self.length = 0
        self._sync_views()
        self.is_initialized = True

    def _sync_views(self) -> None:
        self.keys = self._k[:, :, : self.length]  # (B, Hkv, length, D), a view
        self.values = self._v[:, :, : self.length]

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
        self._k, self._v = k, v
        self._sync_views()

    # Set by the runner for one tiered prefill forward (snapkv_sessions.tier): what the attention sees is then
    # the layer's whole history (hot and cold, in true-position order) plus the new slots, a transient buffer.
    attend_to = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            # prefills grow geometrically; decode steps never get here after reserve()
            self.reserve(max(n, self.capacity // 2))
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._sync_views()
        if self.attend_to is not None:
            return self.attend_to(self.keys, self.values)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Forget every slot from ``length`` on (a reply's decoded slots, fed again by the next turn)."""
        self.length = min(self.length, length)
        self._sync_views()

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly these slots (after a compression): the buffer becomes them, capacity == length."""
        self._k, self._v = keys.contiguous(), values.contiguous()
        self.length = keys.shape[-2]
        self._sync_views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def allocated_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


class CompactCache(Cache):
    """A Cache of :class:`CompactLayer`, one per model layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[CompactLayer() for _ in range(num_layers)])

    def reserve(self, extra: int) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.reserve(extra)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def clone(self) -> CompactCache:
        """An independent copy of the slots held (no spare capacity): a fork of a session starts from it."""
        out = CompactCache(len(self.layers))
        for mine, theirs in zip(out.layers, self.layers, strict=True):
            if theirs.is_initialized:
                mine.lazy_initialization(theirs.keys, theirs.values)
                mine.replace(theirs.keys.clone(), theirs.values.clone())  # (B, Hkv, length, D) each
        return out

    def replace_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every layer holds exactly its slice of ``keys``/``values`` (L, B, Hkv, K, D): one storage for all."""
        for layer, lay in enumerate(self.layers):
            lay.replace(keys[layer], values[layer])  # contiguous slices: views, no copy


def set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store compressed keys/values in any supported cache layer."""
    if isinstance(layer, CompactLayer):
        layer.replace(keys, values)
    else:
        layer.keys, layer.values = keys, values
