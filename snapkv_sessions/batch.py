"""Decode slots: several sessions' caches in one preallocated batch, one forward for all their next tokens.

Every session's cache is bounded by its budget plus the current turn, so decoding sessions fit fixed-size slots.
Per layer the pool holds keys and values ``(S, Hkv, T_cap, D)``; a session that starts decoding is copied into a
free slot once (:meth:`SlotPool.admit`), each step writes its new token's keys and values in place at its own
length and true position, and a key mask hides the padding past each slot's length. When the reply ends the slot
is copied back into the session's own cache (:meth:`SlotPool.release`), which stays the exactly recoverable state
(store, cold tier), and the last occupied slot moves into the hole, so the active slots are always ``[0, n)`` and
a step reads plain views. Rows are independent: each session's logits equal those of a step taken alone (the
equality tests in ``tests/test_batch.py`` and ``tests/test_scheduler.py``).

Slots widen in steps of ``_ROUND`` tokens as replies grow, a non-static pool allocates slots as replies join (in
powers of two up to ``size``: one reply alone allocates and zeroes one slot, which on the 0.5B at 3K tokens is
40 MB instead of 300 MB before its first step), and it frees its buffers when its last slot is released: one long
reply does not pin its width for good; the next admission allocates what it needs (the memory goes back to
torch's allocator, for the sessions' own caches to reuse).

With ``static=True`` every step attends over the whole ``T_cap`` (masked), so the shapes of a step depend only on
the number of active slots: what a CUDA graph capture needs. A static pool never shrinks: its buffers (their shapes
and addresses) stay as they are between replies, and so hold the widest width it has reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .cache import set_layer
from .recall import BatchRecall
from .runner import Forward
from .state import KVState

_ROUND = 64  # slot widths grow in steps of this many tokens, so a step's shapes rarely change


class KeyMasks(dict):
    """``{layer: (S, 1, 1, T) bool}`` (``(S, Hkv, 1, T)`` when a slot's heads keep uneven counts), filled by
    :class:`SlotLayer` as each layer runs; the attention function reads its layer's mask (``snapkv_keymask=``
    through the model's forward kwargs)."""


@dataclass(eq=False)  # a slot is itself: found by identity (SlotPool.slots.index), never by its fields
class Slot:
    """One occupied slot: the session's state, its per-layer lengths, and the tokens fed since admission."""

    state: KVState
    lengths: list[int]  # per layer: slots used (its cache length plus the tokens fed)
    fed: list[int] = field(default_factory=list)  # written here, not yet accounted in the state
    padded: bool = False  # its cache has padding slots (heads keeping uneven counts), hidden by the pool's mask


class SlotPool:
    """Preallocated decode slots for up to ``size`` sessions of one model.

    Parameters
    ----------
    num_layers : the model's layers
    size : S, the most sessions decoding at once
    static : attend over the whole slot width every step (fixed shapes) instead of the longest active slot
    """

    def __init__(self, num_layers: int, size: int, static: bool = False) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size={size!r}: must be an int >= 1")
        self.num_layers, self.size, self.static = num_layers, size, static
        self.keys: list[torch.Tensor] = []  # per layer (S, Hkv, T_cap, D)
        self.values: list[torch.Tensor] = []
        # per layer (S, Hkv, T_cap) bool, False at the padding slots of heads keeping uneven counts; None until a
        # session with padding is admitted (then every slot's row is kept, True where it has none)
        self.visible: list[torch.Tensor] | None = None
        self.slots: list[Slot] = []  # slot i holds self.slots[i]; always the first len(self.slots)

    @property
    def width(self) -> int:
        """T_cap: tokens one slot holds per layer."""
        return self.keys[0].shape[-2] if self.keys else 0

    @property
    def free(self) -> int:
        return self.size - len(self.slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @torch.inference_mode()
    def admit(self, state: KVState, extra: int) -> int:
        """Copy ``state``'s cache into a free slot with room for ``extra`` more tokens (at most ``_ROUND``: the
        slots widen as replies fill them, so a large reply cap allocates nothing up front); returns the slot."""
        if not self.free:
            raise RuntimeError(f"all {self.size} slots are taken")
        layers = state.cache.layers
        longest = max(int(lay.keys.shape[-2]) for lay in layers)
        self._fit(layers[0].keys, longest + min(max(extra, 1), _ROUND), len(self.slots) + 1)
        index = len(self.slots)
        padded = any(getattr(lay, "visible", None) is not None for lay in layers)
        self.slots.append(Slot(state, self._fill(index, state), padded=padded))
        return index

    def _fill(self, index: int, state: KVState) -> list[int]:
        """Write ``state``'s cache into slot ``index`` (it fits: admit fitted the pool, and a retake holds one slot
        more than the slot's length, where the step had room to write); returns the slot's per-layer lengths."""
        layers = state.cache.layers
        lengths = [int(lay.keys.shape[-2]) for lay in layers]
        masks = [getattr(lay, "visible", None) for lay in layers]  # (1, Hkv, n) or None per layer
        if self.visible is None and any(m is not None for m in masks):
            self.visible = [torch.ones(k.shape[:3], dtype=torch.bool, device=k.device) for k in self.keys]
        for layer, lay in enumerate(layers):
            n = lengths[layer]
            self.keys[layer][index, :, :n] = lay.keys[0]  # (Hkv, n, D)
            self.values[layer][index, :, :n] = lay.values[0]
            if self.visible is not None:
                self.visible[layer][index] = True  # (Hkv, T_cap)
                if masks[layer] is not None:
                    self.visible[layer][index, :, :n] = masks[layer][0]
        return lengths

    @torch.inference_mode()
    def release(self, index: int) -> KVState:
        """Copy slot ``index`` back into its session's own cache, account for the tokens fed, free the slot."""
        state = self._copy_back(index)
        self.drop(index)
        return state

    @torch.inference_mode()
    def drop(self, index: int) -> None:
        """Free slot ``index`` without copying it back (:meth:`release` copies first); the last occupied slot moves
        into the hole, so the active slots stay ``[0, n)``. When no slot is left, a non-static pool frees its
        buffers."""
        last = len(self.slots) - 1
        if index != last:  # the last slot fills the hole
            moved = self.slots[last]
            for layer in range(self.num_layers):
                n = max(moved.lengths[layer], 1)
                self.keys[layer][index, :, :n] = self.keys[layer][last, :, :n]  # (Hkv, n, D)
                self.values[layer][index, :, :n] = self.values[layer][last, :, :n]
                if self.visible is not None:
                    self.visible[layer][index] = self.visible[layer][last]  # (Hkv, T_cap)
            self.slots[index] = moved
        self.slots.pop()
        if not self.slots and not self.static:  # idle: give the width back; the next admit allocates anew
            self.keys, self.values, self.visible = [], [], None

    @property
    def rows(self) -> int:
        """Slots allocated: all ``size`` for a static pool; for another, the most occupied since it was last idle,
        rounded up to a power of two (a single reply allocates and zeroes one slot, not ``size``)."""
        return self.keys[0].shape[0] if self.keys else 0

    def _fit(self, like: torch.Tensor, need: int, rows: int) -> None:
        """Allocate the slots on first use (or after an idle pool freed them), or widen them or add rows (keeping
        what they hold) when a session needs more than the pool holds: ``need`` tokens in a slot, ``rows``
        slots."""
        if need <= self.width and rows <= self.rows:
            return
        width = max(self.width, -(-need // _ROUND) * _ROUND)
        count = self.size if self.static else min(self.size, max(self.rows, 1 << (rows - 1).bit_length()))
        _, heads, _, dim = like.shape
        held, old_width = self.rows, self.width
        grown_k, grown_v = [], []
        for layer in range(self.num_layers):
            k = like.new_zeros(count, heads, width, dim)  # (S, Hkv, T_cap, D)
            v = like.new_zeros(count, heads, width, dim)
            if self.keys:
                k[:held, :, :old_width] = self.keys[layer]
                v[:held, :, :old_width] = self.values[layer]
            grown_k.append(k)
            grown_v.append(v)
        if self.visible is not None:
            grown = []
            for vis in self.visible:
                wide = vis.new_ones(count, heads, width)  # (S, Hkv, T_cap)
                wide[:held, :, :old_width] = vis
                grown.append(wide)
            self.visible = grown
        self.keys, self.values = grown_k, grown_v

    @torch.inference_mode()
    def step(self, runner, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` to slot ``i`` at its session's true position, all in one forward; returns the
        next-token logits (n, V) of the ``n`` active slots."""
        n = len(self.slots)
        if len(tokens) != n or not n:
            raise ValueError(f"{n} active slots and {len(tokens)} tokens: give one token per slot, at least one")
        longest = max(max(slot.lengths) for slot in self.slots)
        if longest >= self.width:  # a slot is full: every slot widens, keeping what it holds
            self._fit(self.keys[0], longest + 1, n)
        device = self.keys[0].device
        input_ids = torch.tensor([[int(t)] for t in tokens], device=device)  # (n, 1)
        positions = [s.state.next_position + len(s.fed) for s in self.slots]
        position_ids = torch.tensor(positions, device=device)[:, None]  # (n, 1) true positions
        masks = KeyMasks()
        recalls = [s.state.cache.recall(s.state, len(s.fed)) for s in self.slots]  # each slot's own tier
        recall = BatchRecall(recalls) if any(r is not None for r in recalls) else None
        logits = runner.forward(Forward(input_ids, position_ids, SlotCache(self, n, masks), key_masks=masks,
                                        recall=recall))  # (n, V)
        for i, (slot, token) in enumerate(zip(self.slots, tokens, strict=True)):
            if slot.state.cache.retake(slot.state, logits[i]):  # a near-tie under recall: as the step alone would
                logits[i] = self._retake(runner, i, int(token))  # (V,)
                continue
            slot.fed.append(int(token))
            slot.lengths = [length + 1 for length in slot.lengths]
        return logits  # (n, V)

    def _retake(self, runner, index: int, token: int) -> torch.Tensor:
        """Slot ``index``'s step taken again over its whole history, as :meth:`ModelRunner.step` takes it: the slot
        goes back to its session's cache, the turn's tokens since the last exact point and ``token`` are fed
        again as a prefill there, and the slot is filled from the cache (the other rows are untouched)."""
        slot = self.slots[index]
        state = self._copy_back(index)
        state.cache.rewind_decoded(state)
        logits = runner.prefill(state, [token])[0]  # (V,)
        slot.lengths = self._fill(index, state)
        return logits

    def _copy_back(self, index: int) -> KVState:
        """Copy slot ``index`` into its session's own cache and account for the tokens fed; the slot stays."""
        slot = self.slots[index]
        state = slot.state
        for layer, lay in enumerate(state.cache.layers):
            n = slot.lengths[layer]
            had = slot.padded and getattr(lay, "visible", None) is not None
            visible = self.visible[layer][index : index + 1, :, :n].clone() if had else None  # (1, Hkv, n)
            set_layer(lay, self.keys[layer][index : index + 1, :, :n].clone(),  # (1, Hkv, n, D)
                      self.values[layer][index : index + 1, :, :n].clone(), visible)
        if slot.fed:
            state.append(slot.fed, [False] * len(slot.fed), state.positions[0].shape[1], state.positions[0].device)
            slot.fed = []
        return state


class _StepRows:
    """What the layers of one step share: for each distinct set of slot lengths (every layer's, unless budgets
    differ by layer), where each slot's new token goes and the mask of the keys each slot may see, built once."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.memo: dict[tuple[int, ...], tuple[torch.Tensor, int, torch.Tensor | None]] = {}

    def get(self, lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """``(at, span, mask)``: ``at`` (n,) each slot's length, where its token goes; ``span`` the keys the step
        reads; ``mask`` (n, 1, 1, span) bool, or None where every slot sees all ``span`` keys (one slot, or slots
        of one length: the step then reads what a step alone reads, with no mask)."""
        got = self.memo.get(lengths)
        if got is None:
            at = torch.tensor(lengths, device=device)  # (n,)
            span = self.pool.width if self.pool.static else max(lengths) + 1
            if span == min(lengths) + 1:
                mask = None
            else:
                mask = (torch.arange(span, device=device)[None] <= at[:, None])[:, None, None]  # (n, 1, 1, T)
            got = self.memo[lengths] = (at, span, mask)
        return got


class SlotLayer(DynamicLayer):
    """One layer of a step: the active slots of the pool, seen as the layer's cache."""

    def __init__(self, pool: SlotPool, n: int, masks: KeyMasks, index: int, rows: _StepRows) -> None:
        super().__init__()
        self.pool, self.n, self.masks, self.index, self.rows = pool, n, masks, index, rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` (n, Hkv, 1, D): written in place at each slot's length; returns the
        slots' keys and values (n, Hkv, T, D), T the longest slot (or the width when static), and records the
        layer's key mask (n, 1, 1, T), or (n, Hkv, 1, T) with padding, or None when every slot sees all T."""
        pool, n = self.pool, self.n
        lengths = tuple(s.lengths[self.index] for s in pool.slots)
        at, span, mask = self.rows.get(lengths, key_states.device)
        keys, values = pool.keys[self.index], pool.values[self.index]  # (S, Hkv, T_cap, D)
        if len(set(lengths)) == 1:  # one place for every slot: a plain strided copy
            keys[:n, :, lengths[0]] = key_states[:, :, 0]  # (n, Hkv, D)
            values[:n, :, lengths[0]] = value_states[:, :, 0]
        else:
            rows = torch.arange(n, device=key_states.device)  # (n,)
            keys[rows, :, at] = key_states[:, :, 0]  # (n, Hkv, D)
            values[rows, :, at] = value_states[:, :, 0]
        if pool.visible is not None:  # a slot's padding slots, per KV head
            visible = pool.visible[self.index][:n, :, None, :span]  # (n, Hkv, 1, T)
            mask = visible if mask is None else mask & visible
        self.masks[self.index] = mask
        return keys[:n, :, :span], values[:n, :, :span]  # (n, Hkv, T, D) views

    def get_seq_length(self) -> int:
        return max(s.lengths[self.index] for s in self.pool.slots)


class SlotCache(Cache):
    """The pool's active slots as one batched cache, for one decode step."""

    def __init__(self, pool: SlotPool, n: int, masks: KeyMasks) -> None:
        rows = _StepRows(pool)
        super().__init__(layers=[SlotLayer(pool, n, masks, i, rows) for i in range(pool.num_layers)])


def decode_step(runner, states: Sequence[KVState], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[i]`` to ``states[i]`` at its true position, all in one forward (a pool of their own slots);
    returns the next-token logits (S, V). Each state's cache and bookkeeping advance exactly as
    :meth:`ModelRunner.step` would advance them."""
    if len(states) != len(tokens) or not states:
        raise ValueError(f"{len(states)} states and {len(tokens)} tokens: give one token per state, at least one")
    pool = SlotPool(runner.num_layers, len(states))
    for state in states:
        pool.admit(state, 1)
    logits = pool.step(runner, tokens)  # (S, V)
    for _ in states:
        pool.release(0)  # the last slot moves into 0 each time: every state goes back
    return logits
