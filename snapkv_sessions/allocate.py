"""The allocation seam: how many history slots each KV head of a layer keeps.

A compression's layer budget (:func:`~snapkv_sessions.press.layer_budgets`: uniform or pyramid) says how many
slots a layer keeps; an :class:`Allocator` says how the layer's heads share them. The scorer ranks
(:mod:`snapkv_sessions.scorers`), the allocator counts, and the shared top-k
(:func:`~snapkv_sessions.press.select_positions`) takes each head's best ``counts[h]`` slots with the pins forced
in. Heads that keep fewer slots than the layer's busiest head are padded up to its count by repeating one of their
own slots (same true position, same keys and values), which the cache hides from attention
(:attr:`~snapkv_sessions.cache.CompactLayer.visible`): a layer holds ``max_h counts[h] + W`` slots, never the
whole context.

Built-in allocators, by registry key:

* ``"uniform"``: every head keeps the layer's per-head budget (the SnapKV paper's split; no padding);
* ``"adakv"``: :class:`AdaKV` (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
  Allocation for Efficient LLM Inference", arXiv:2407.11550): the layer's budget goes to the best-scored slots
  across all its heads, each head guaranteed a floor.

A new allocator is a class whose constructor takes its parameters (``compression.allocator_params``) and checks
them, with a :meth:`Allocator.counts` method; :func:`register_allocator` makes ``compression.allocator: key``
build it. The module imports torch only when an allocator runs, so a policy is validated without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    import torch


class Allocator(Protocol):
    """Shares one layer's history budget among its KV heads."""

    def counts(self, scores: torch.Tensor, keep: int) -> torch.Tensor | None:
        """History slots each KV head keeps.

        Parameters
        ----------
        scores : (B, Hkv, P) the scorer's history scores, pins (and this compression's protected tokens) at
            ``+inf``, slots a head may not keep (padding) at ``-inf``
        keep : the layer's per-head history budget (budget minus window), at least the most pins a head holds

        Returns
        -------
        (B, Hkv) long on the scores' device, each in ``[pins of the head, P]`` and at least 1, their sum at most
        ``Hkv * keep`` per row; or None: every head keeps ``keep`` (the uniform split, no padding). It must not
        read the device from the host: the shared top-k reads the largest count once.
        """
        ...


@dataclass(frozen=True)
class Uniform:
    """Every head keeps the layer's per-head budget (the default)."""

    def counts(self, scores: torch.Tensor, keep: int) -> torch.Tensor | None:
        return None


@dataclass(frozen=True)
class AdaKV:
    """Ada-KV's adaptive split (Feng et al., 2024, arXiv:2407.11550), as kvpress's ``AdaKVPress`` applies it.

    Each head first keeps its ``floor`` share of the per-head budget (its own best slots: a head the window barely
    reads still keeps some); the rest of the layer's ``Hkv * keep`` slots go to the best remaining scores across
    all heads, so a head whose attention is spread keeps more than one whose attention is concentrated. Scores
    are compared across heads as they are: the scorer's window attention is a probability on every head.

    Parameters
    ----------
    floor: the share of the per-head budget every head keeps, in [0, 1] (kvpress's ``alpha_safeguard``; 0.2 as
        there). 1 is the uniform split. At least one slot per head whatever the share.
    """

    floor: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not 0.0 <= self.floor <= 1.0:
            raise ConfigError("allocator_params.floor", self.floor, "must be a number in [0, 1]")

    def counts(self, scores: torch.Tensor, keep: int) -> torch.Tensor | None:
        import torch

        bsz, heads, hist = scores.shape
        safe = min(hist, max(1, math.floor(keep * self.floor)))
        boosted = scores.clone()  # (B, Hkv, P)
        # each head's own best `safe` slots outrank every shared one (pins are +inf already and stay first);
        # a slot the head may not keep (-inf: padding of an earlier uneven split) is never boosted
        floor = scores.topk(safe, dim=-1)  # (B, Hkv, safe)
        boosted.scatter_(-1, floor.indices, floor.values.masked_fill(floor.values > float("-inf"), float("inf")))
        total = min(heads * keep, heads * hist)
        picked = boosted.reshape(bsz, heads * hist).topk(total, dim=-1).indices  # (B, Hkv * keep)
        chosen = torch.zeros(bsz, heads * hist, dtype=torch.long, device=scores.device)  # (B, Hkv * P)
        chosen.scatter_(-1, picked, 1)
        return chosen.view(bsz, heads, hist).sum(-1)  # (B, Hkv)


AllocatorFactory = Callable[..., Allocator]
ALLOCATORS: dict[str, AllocatorFactory] = {}
BUILTIN_ALLOCATORS = ("uniform", "adakv")


def register_allocator(name: str, factory: AllocatorFactory, *, replace: bool = False) -> None:
    """Make ``compression.allocator: name`` build ``factory(**compression.allocator_params)``.

    The factory (a class, usually) checks its own parameters and raises :class:`ConfigError` naming them. An
    existing key is only overwritten with ``replace=True``.
    """
    if not name or not isinstance(name, str):
        raise ConfigError("compression.allocator", name, "an allocator key must be a non-empty string")
    if name in ALLOCATORS and not replace:
        raise ConfigError("compression.allocator", name, "is already registered; pass replace=True to override it")
    ALLOCATORS[name] = factory


def build_allocator(name: str, params: Mapping[str, object]) -> Allocator:
    """The allocator registered under ``name``, built with ``params``; a :class:`ConfigError` names what is wrong."""
    factory = ALLOCATORS.get(name)
    if factory is None:
        raise ConfigError("compression.allocator", name, f"no allocator is registered under this key (registered: "
                          f"{sorted(ALLOCATORS)}); register one with snapkv_sessions.allocate.register_allocator")
    try:
        return factory(**params)
    except TypeError as exc:  # an unknown or missing parameter: the factory's signature says which
        raise ConfigError("allocator_params", dict(params), f"not the parameters of allocator "
                          f"{name!r}: {exc}") from None


register_allocator("uniform", Uniform)
register_allocator("adakv", AdaKV)
