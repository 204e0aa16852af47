"""The scorer seam: a compression method is a :class:`Scorer`; the top-k, the pins and the budgets are shared.

A scorer ranks one layer's history slots (all but the observation window) per KV head; :func:`select_layer`
turns any scorer's ranking into kept slots with the shared rules of :mod:`snapkv_sessions.press`: the pins
(and this compression's protected tokens) are forced in, the window is kept outright, and every layer keeps its
budget (:func:`~snapkv_sessions.press.layer_budgets`). A scorer therefore never sees a pin or a budget.

Built-in scorers, by registry key:

* ``"snapkv"``: :class:`~snapkv_sessions.press.SnapKV` (Li et al., 2024, arXiv:2404.14469), or on CUDA its
  fused Triton kernel (:class:`snapkv_sessions.gpu.triton_scores.FusedSnapKV`, equal scores);
* ``"streaming"``: :class:`StreamingLLM` (Xiao et al., 2023, arXiv:2309.17453).

:class:`SpanAware` wraps any scorer (``compression.span_aware``). A new method registers a factory under a
key (:func:`register_scorer`) and a policy names it with ``compression.scorer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .allocate import Allocator
from .cache import History
from .config import BUILTIN_SCORERS, CompressionConfig
from .errors import ConfigError
from .gpu import fused_scorer
from .press import SnapKV, select_positions, spread_over_words


class Scorer(Protocol):
    """Ranks the history slots of one layer, per KV head; higher is kept first."""

    def score(self, window_probs: torch.Tensor, state: History, layer: int) -> torch.Tensor:
        """History scores of ``layer``.

        Parameters
        ----------
        window_probs : (B, Hq, T) the probe's window-mean attention over the layer's cache, float32
        state : what the compression chooses from (:class:`~snapkv_sessions.cache.History`): keys
            ``state.keys(layer)`` (B, Hkv, T, D), true positions ``state.positions[layer]`` (B, Hkv, T), token ids
            ``state.token_ids`` (indexed by true position), ``state.pinned`` and ``state.next_position``. On a
            tiered session it is the whole history, hot and cold; a scorer must read nothing else.
        layer : the layer index

        Returns
        -------
        (B, Hkv, T - W) on the cache's device; the slots' order is the cache's (sorted by true position). It
        must not read the device from the host (``.item()``, ``.tolist()``...): selection never waits on it.
        """
        ...


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer factory may need beyond the config; fixed for one compression.

    Attributes
    ----------
    window: the probe's observation window W (shorter than ``cfg.window`` on a short later turn)
    num_kv_heads: KV heads per layer (Hkv)
    device: the cache's device
    tokenizer: the runner's tokenizer, or None
    """

    window: int
    num_kv_heads: int
    device: torch.device
    tokenizer: object | None = None


ScorerFactory = Callable[[CompressionConfig, ScoreContext], Scorer]
SCORERS: dict[str, ScorerFactory] = {}


def register_scorer(name: str, factory: ScorerFactory, *, replace: bool = False) -> None:
    """Make ``compression.scorer: name`` build its scorer with ``factory(cfg, ctx)``.

    Register before building a config that names the key (the config checks it). An existing key is only
    overwritten with ``replace=True``.
    """
    if not name or not isinstance(name, str):
        raise ConfigError("compression.scorer", name, "a scorer key must be a non-empty string")
    if name in SCORERS and not replace:
        raise ConfigError("compression.scorer", name, "is already registered; pass replace=True to override it")
    SCORERS[name] = factory


def build_scorer(cfg: CompressionConfig, ctx: ScoreContext) -> Scorer:
    """The scorer ``cfg`` names (``cfg.base_scorer``), wrapped in :class:`SpanAware` when ``cfg.span_aware``."""
    key = cfg.base_scorer
    factory = SCORERS.get(key)
    if factory is None:  # the config was valid when built, but the key has been unregistered since
        raise ConfigError("compression.scorer", key, f"no scorer is registered under this key (registered: "
                          f"{sorted(SCORERS)}); register one with snapkv_sessions.scorers.register_scorer")
    scorer = factory(cfg, ctx)
    # streaming's pattern is positional: spreading it over words would only blur it
    if cfg.span_aware and key != "streaming":
        scorer = SpanAware(scorer, ctx.tokenizer, cfg.span_unit)
    return scorer


# ---------------------------------------------------------------- the shared top-k


@dataclass(frozen=True)
class KeepRule:
    """What the shared top-k forces in, fixed for one compression.

    Attributes
    ----------
    window: W, the trailing slots kept outright
    keep_mask: (N,) bool over true positions: the pins plus this compression's protected tokens, on the
        cache's device
    grow: keep every pin even past a layer's history budget (else :class:`~snapkv_sessions.errors.BudgetError`)
    n_pinned: how many history positions ``keep_mask`` marks, counted on the host; None counts on the device
    """

    window: int
    keep_mask: torch.Tensor
    grow: bool = False
    n_pinned: int | None = None


def select_layer(scorer: Scorer, window_probs: torch.Tensor, state: History, layer: int, budget: int,
                 rule: KeepRule, allocator: Allocator | None = None) -> torch.Tensor:
    """Sorted slots of ``layer`` to keep, (B, Hkv, K): the scorer's top history slots, pins forced in, + window.

    ``budget`` is the layer's budget, window included; ``allocator`` shares it among the heads (None: evenly).
    No host synchronisation when ``rule.n_pinned`` is set and the heads keep even counts.
    """
    positions = state.positions[layer]  # (B, Hkv, T)
    hist = positions.shape[-1] - rule.window
    scores = scorer.score(window_probs, state, layer)  # (B, Hkv, T - W)
    if tuple(scores.shape) != (*positions.shape[:2], hist):
        raise ConfigError("compression.scorer", type(scorer).__name__, f"returned scores of shape "
                          f"{tuple(scores.shape)} for layer {layer}; expected (B, Hkv, T - W) = "
                          f"{(*positions.shape[:2], hist)}")
    pinned = rule.keep_mask[positions[..., :hist]]  # (B, Hkv, T - W)
    padding = getattr(state, "visible", None)  # a History's; a bare state (the older call form) has no padding
    visible = padding(layer) if padding is not None else None  # (B, Hkv, T) False at padding slots, or None
    allowed = None if visible is None else visible[..., :hist]  # (B, Hkv, T - W)
    return select_positions(scores, budget - rule.window, rule.window, pinned, rule.grow, layer,
                            rule.n_pinned, allocator, allowed)  # (B, Hkv, K)


# ---------------------------------------------------------------- scorers


@dataclass(frozen=True)
class StreamingLLM:
    """StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks",
    arXiv:2309.17453) as scores: the first ``sinks`` slots (attention sinks), then the most recent ones.

    The window attention is not read. Sinks outrank every other slot and the rest rank by recency, so with no
    pins the shared top-k keeps exactly :func:`~snapkv_sessions.press.streaming_positions` whenever the sinks
    fit the history budget (``sinks <= budget - window``); when they do not, the shared top-k keeps the first
    ``budget - window`` sinks and the whole window, where :func:`~snapkv_sessions.press.streaming_positions`
    kept every sink and cut into the window. Ranks stay exact in float32 below 2**23 slots.
    """

    window: int
    sinks: int = 4

    def score(self, window_probs: torch.Tensor, state: History, layer: int) -> torch.Tensor:
        positions = state.positions[layer]  # (B, Hkv, T)
        hist = positions.shape[-1] - self.window
        recency = torch.arange(hist, dtype=torch.float32, device=positions.device)  # (T - W,) later is higher
        # sinks above every recent slot, the first one highest: a budget too small for all sinks keeps the first
        ranks = torch.where(recency < self.sinks, 2 * hist - recency, recency)  # (T - W,)
        return ranks.expand(*positions.shape[:2], hist)  # (B, Hkv, T - W)


class SpanAware:
    """Wrapper: every token of a span gets its span's best score under ``inner``, so a span is kept whole or
    not at all.

    ``unit`` says what a span is (:func:`span_ids`): ``"word"`` (a token that begins with whitespace, or follows
    a newline, starts one), ``"line"`` (a record of a listing, a table row, a line of JSON or code) or
    ``"sentence"``. Line and sentence spans are records in the sense of ChunkKV (Liu et al., 2025,
    arXiv:2502.00299): a record whose name the question matches keeps the value that follows it.
    """

    def __init__(self, inner: Scorer, tokenizer: object | None, unit: str = "word") -> None:
        if tokenizer is None:
            raise ConfigError("span_aware", True, "needs the runner to have a tokenizer")
        if unit not in SPAN_UNITS:
            raise ConfigError("span_unit", unit, f"must be one of {list(SPAN_UNITS)}")
        self.inner, self.tokenizer, self.unit = inner, tokenizer, unit
        self._memo: tuple[History, int, torch.Tensor] | None = None  # (history, its length, span ids)

    def score(self, window_probs: torch.Tensor, state: History, layer: int) -> torch.Tensor:
        scores = self.inner.score(window_probs, state, layer)  # (B, Hkv, P)
        spans = self._spans(state, scores.device)  # (N,)
        hist_pos = state.positions[layer][..., : scores.shape[-1]]  # (B, Hkv, P)
        # span ids count span starts, so they stay below the number of true positions
        return spread_over_words(scores, spans[hist_pos], num_words=len(spans) + 1)  # (B, Hkv, P)

    def _spans(self, state: History, device: torch.device) -> torch.Tensor:
        """(N,) span ids of ``state``, tokenized once per compression rather than once per layer."""
        memo = self._memo
        if memo is None or memo[0] is not state or memo[1] != state.next_position:
            memo = (state, state.next_position, span_ids(self.tokenizer, state.token_ids, device, self.unit))
            self._memo = memo
        return memo[2]


SPAN_UNITS = ("word", "line", "sentence")
_SPACE = "ĠĊ▁ \n\t"  # byte-level BPE marks a leading space as "Ġ" and a newline as "Ċ"; sentencepiece uses "▁"


def _has_newline(piece: str) -> bool:
    return "Ċ" in piece or "\n" in piece


def _ends_sentence(piece: str) -> bool:
    return piece.rstrip(_SPACE).endswith((".", "!", "?"))


def span_ids(tokenizer: object, token_ids: Sequence[int], device: torch.device, unit: str = "word") -> torch.Tensor:
    """(N,) span index of every true position, for ``unit`` in :data:`SPAN_UNITS`.

    word: a token that begins with whitespace, or follows a newline, starts a word; line: a token that follows a
    newline starts a line; sentence: a line start, or a word start after a token ending in ``.``, ``!`` or ``?``.
    """
    pieces = tokenizer.convert_ids_to_tokens(token_ids)
    starts = []
    for i, piece in enumerate(pieces):
        prev = pieces[i - 1] if i else ""
        word = not piece or piece[0] in _SPACE or (bool(prev) and prev[-1] in "Ċ\n")
        if unit == "word":
            starts.append(word)
        elif unit == "line":
            starts.append(_has_newline(prev))
        else:
            starts.append(_has_newline(prev) or (word and _ends_sentence(prev)))
    return torch.tensor(starts, dtype=torch.long, device=device).cumsum(0)  # (N,)


def word_ids(tokenizer: object, token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """(N,) word index of every true position: a new word starts at a token that begins with whitespace."""
    return span_ids(tokenizer, token_ids, device, "word")


# ---------------------------------------------------------------- built-in factories


def _snapkv(cfg: CompressionConfig, ctx: ScoreContext) -> Scorer:
    # the fused Triton scorer on CUDA (snapkv_sessions.gpu), else the torch scorer: equal scores
    fused = fused_scorer(ctx.device, ctx.window, cfg.kernel, cfg.pooling, cfg.head_reduce)
    return fused if fused is not None else SnapKV.from_config(cfg, window=ctx.window)


def _streaming(cfg: CompressionConfig, ctx: ScoreContext) -> Scorer:
    return StreamingLLM(window=ctx.window, sinks=cfg.sinks)


register_scorer("snapkv", _snapkv)
register_scorer("streaming", _streaming)
assert tuple(SCORERS) == BUILTIN_SCORERS, "config.BUILTIN_SCORERS must name the built-in scorers"
