"""The model's rotary position embedding, applied and undone on cached keys at their true positions.

The cache holds keys after RoPE. Before RoPE a head's keys are close to low rank (ShadowKV, Sun et al., 2024,
arXiv:2410.21465, measures this; after RoPE the fast-turning channel pairs spread them out), so a summary of the
cold tier that must stay small (:class:`snapkv_sessions.recall.LowRank`) is fitted to the keys with their
rotation undone, and rotated back to score a step's query. The cos/sin come from the model's own rotary module,
so its RoPE variant (scaled frequencies, an attention factor) is the one undone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass(frozen=True)
class Rotary:
    """``module``: the model's rotary embedding (``forward(x, position_ids) -> (cos, sin)``, the halves layout
    that ``rotate_half`` models use: Llama, Qwen2, Mistral, SmolLM2)."""

    module: torch.nn.Module
    # cos and sin repeat across the two halves of a head (how Llama-family rotary modules build them): what lets
    # :meth:`scores` move the rotation onto the query
    halves: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> Rotary | None:
        """The model's rotary module, or None where it has none this class can undo (then a summary is fitted to
        the keys as cached)."""
        config = getattr(model, "config", None)
        if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            return None  # only part of each head rotates: the layout differs
        for name, module in model.named_modules():
            if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
                probe = torch.empty(0, dtype=torch.float32, device=module.inv_freq.device)
                cos, sin = module(probe, torch.arange(1, 65, device=module.inv_freq.device)[None])  # (1, 64, d)
                half = cos.shape[-1] // 2
                halves = torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
                return cls(module, halves)
        return None

    def cos_sin(self, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin at ``positions`` (any shape S), (*S, dim) fp32 each; None if the module's width is not
        ``dim``."""
        flat = positions.reshape(1, -1)  # (1, prod S)
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        cos, sin = self.module(probe, flat)  # (1, prod S, d) each
        if cos.shape[-1] != dim:
            return None
        return cos.float().view(*positions.shape, dim), sin.float().view(*positions.shape, dim)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x`` (..., S, D) rotated to (or, ``inverse``, back from) its ``positions`` (..., S); fp32. ``cos_sin``:
        :meth:`cos_sin` of the same positions, when the caller keeps them."""
        got = cos_sin if cos_sin is not None else self.cos_sin(positions, x.shape[-1])
        if got is None:
            return x.float()
        cos, sin = got  # (..., S, D) each, the module's attention factor folded in
        x = x.float()
        if not inverse:
            return x * cos + _rotate_half(x) * sin
        # the forward map is a rotation scaled by the factor f (cos^2 + sin^2 = f^2): undo both
        return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)

    def scores(self, query: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``query (..., G, D) . apply(x, positions) (..., S, D)`` for every pair, (..., G, S) fp32, without
        rotating ``x``: with cos and sin the same in both halves (the layout ``rotate_half`` models use),
        ``q . (x cos + rh(x) sin) = (x cos) . q - (x sin) . rh(q)``, two products over ``x`` scaled instead of
        five passes over it and one product."""
        got = cos_sin if cos_sin is not None else self.cos_sin(positions, x.shape[-1])
        q = query.float()
        if got is None:
            return q @ x.float().transpose(-1, -2)
        if not self.halves:
            return q @ self.apply(x, positions, cos_sin=got).transpose(-1, -2)  # rotate, then score
        cos, sin = got  # (..., S, D) each
        x = x.float()
        return q @ (x * cos).transpose(-1, -2) - _rotate_half(q) @ (x * sin).transpose(-1, -2)  # (..., G, S)
