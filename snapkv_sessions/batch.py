"""One decode step for several sessions at once: one forward, every weight read once for all of them.

Each session keeps its own compact cache (its length, its true positions). For the step, every layer's keys and
values are laid side by side in a padded batch ``(S, Hkv, T_max, D)`` with a key mask, the new token of each
session is written to its own cache first (so nothing is scattered back afterwards), and each query attends to
its own session's keys only. Rows are independent: a session's logits equal those of a step taken alone (the
equality tests in ``tests/test_batch.py``).

The building block of batched serving (issue 17): a scheduler that interleaves prefills and compressions
between such steps is not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .state import KVState


class KeyMasks(dict):
    """``{layer: (S, 1, 1, T_max) bool}``, filled by :class:`SlotLayer` as each layer runs; the attention function
    reads its layer's mask (``snapkv_keymask=`` through the model's forward kwargs)."""


class SlotLayer(DynamicLayer):
    """One layer of the step: the sessions' own cache layers, seen as one padded batch."""

    def __init__(self, layers: list, masks: KeyMasks, index: int) -> None:
        super().__init__()
        self.rows, self.masks, self.index = layers, masks, index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` (S, Hkv, 1, D): appended to each session's own layer; returns the padded
        batch (S, Hkv, T_max, D) of every session's keys and values, and records the layer's key mask."""
        held = []
        for row, layer in enumerate(self.rows):
            keys, values = layer.update(key_states[row : row + 1], value_states[row : row + 1])  # (1, Hkv, T_i, D)
            held.append((keys, values))
        longest = max(k.shape[-2] for k, _ in held)
        bsz, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(bsz, heads, longest, dim)  # (S, Hkv, T_max, D)
        values = value_states.new_zeros(bsz, heads, longest, value_states.shape[-1])
        mask = torch.zeros(bsz, 1, 1, longest, dtype=torch.bool, device=key_states.device)  # (S, 1, 1, T_max)
        for row, (k, v) in enumerate(held):
            keys[row, :, : k.shape[-2]] = k[0]
            values[row, :, : v.shape[-2]] = v[0]
            mask[row, ..., : k.shape[-2]] = True
        self.masks[self.index] = mask
        return keys, values

    def get_seq_length(self) -> int:
        return max(layer.get_seq_length() for layer in self.rows)


class SlotCache(Cache):
    """The sessions' caches as one batch, for one decode step."""

    def __init__(self, states: Sequence[KVState], masks: KeyMasks) -> None:
        n_layers = len(states[0].cache.layers)
        super().__init__(layers=[SlotLayer([s.cache.layers[i] for s in states], masks, i) for i in range(n_layers)])


@torch.inference_mode()
def decode_step(runner, states: Sequence[KVState], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[i]`` to ``states[i]`` at its true position, all in one forward; returns the next-token logits
    (S, V). Each state's cache and bookkeeping advance exactly as :meth:`ModelRunner.step` would advance them."""
    if len(states) != len(tokens) or not states:
        raise ValueError(f"{len(states)} states and {len(tokens)} tokens: give one token per state, at least one")
    masks = KeyMasks()
    device = runner.device
    input_ids = torch.tensor([[int(t)] for t in tokens], device=device)  # (S, 1)
    position_ids = torch.tensor([[s.next_position] for s in states], device=device)  # (S, 1) true positions
    out = runner.model(input_ids=input_ids, position_ids=position_ids, cache=SlotCache(states, masks),
                       use_cache=True, logits_to_keep=1, snapkv_keymask=masks)
    for state, token in zip(states, tokens, strict=True):
        state.append([int(token)], [False], runner.num_kv_heads, device)
    return out.logits[:, -1]  # (S, V)
