"""Compression settings: the ``compression`` section of a policy, validated with pydantic v2."""

from __future__ import annotations

import math
import sys
from typing import Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from .errors import ConfigError, bounded_repr

BUILTIN_SCORERS = ("snapkv", "streaming")  # registered by snapkv_sessions.scorers when it is imported


BUILTIN_SELECTORS = ("exact", "sparq", "pages", "lowrank")  # registered by snapkv_sessions.recall when it is imported
PAGE_SELECTORS = ("pages",)  # built-in selectors that rank pages, not slots (no per-slot scores to weigh)


def registered_selectors() -> tuple[str, ...]:
    """Recall selector keys a policy may name now, read without importing torch (as :func:`registered_scorers`)."""
    recall = sys.modules.get(f"{__package__}.recall")
    return tuple(recall.SELECTORS) if recall is not None else BUILTIN_SELECTORS


def registered_scorers() -> tuple[str, ...]:
    """Scorer keys a config may name now, read without importing torch.

    Registering a scorer imports :mod:`snapkv_sessions.scorers`, so while that module is not loaded only the
    built-in scorers exist; once it is, its registry is the truth (it may have grown since this module loaded).
    """
    scorers = sys.modules.get(f"{__package__}.scorers")
    return tuple(scorers.SCORERS) if scorers is not None else BUILTIN_SCORERS


class _Settings(BaseModel):
    """A validated, frozen settings section; :meth:`make` reports a bad field as a :class:`ConfigError`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def make(cls, **kwargs: object) -> Self:
        """Build one, turning pydantic's errors into a :class:`ConfigError` naming field and value."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise _config_error(exc, kwargs) from None


class CompressionConfig(_Settings):
    """How SnapKV compresses the cache after each turn's prefill.

    Parameters
    ----------
    budget:
        Tokens kept per layer and KV head after compression (recent window included), or ``None`` to use
        ``budget_ratio``.
    budget_ratio:
        Budget as a share of the context length (tokens seen so far, true positions), in ``(0, 1]``. Floored at
        ``window + 1`` tokens.
    window:
        Observation window W: the last W query tokens of the turn's prefill. They score the history, and they
        are always kept (the recent window).
    kernel:
        1-D pooling kernel over positions (odd), as in SnapKV; 1 disables pooling.
    pooling:
        ``"avg"`` or ``"max"`` pooling of the window scores.
    head_reduce:
        How the query heads of a GQA group are reduced to their KV head: ``"mean"`` or ``"max"``.
    strategy:
        Per-layer budget: ``"uniform"`` (every layer gets ``budget``) or ``"pyramid"`` (PyramidKV: lower
        layers keep more, upper layers less, same total).
    pyramid_beta:
        PyramidKV's beta: the top layer keeps ``(budget - window) / beta`` history tokens.
    scorer:
        Key of the scorer that ranks history positions, in :data:`snapkv_sessions.scorers.SCORERS`:
        ``"snapkv"`` (default), ``"streaming"``, or one added with
        :func:`~snapkv_sessions.scorers.register_scorer` before the config is built. Every scorer shares the
        top-k, the pins, the window and the per-layer budgets.
    method:
        ``"snapkv"`` (default), or ``"streaming"``: StreamingLLM's fixed pattern (Xiao et al., 2023,
        arXiv:2309.17453), the first ``sinks`` slots plus the most recent ones, a baseline for benchmarks.
        The older spelling of ``scorer="streaming"``.
    sinks:
        Attention-sink slots kept by ``method="streaming"``.
    span_aware:
        Score whole words (whitespace-delimited token runs): every token of a word gets the word's best score,
        so kept positions tend to cover whole words and numbers. Wraps the scorer (not the streaming one, whose
        pattern is positional). Needs the runner's tokenizer.
    span_unit:
        What ``span_aware`` keeps whole: ``"word"`` (default), ``"line"`` (a record of a listing, a table row, a
        line of JSON or code) or ``"sentence"``.
    allocator:
        How a layer's budget is shared among its KV heads, a key in
        :data:`snapkv_sessions.allocate.ALLOCATORS`: ``"uniform"`` (default: every head keeps the budget) or
        ``"adakv"`` (Ada-KV: the layer's slots go to the best scores across its heads, each head keeping a floor;
        heads then hold different numbers of slots), or one added with
        :func:`~snapkv_sessions.allocate.register_allocator`. Applies to every scorer and to both strategies.
    allocator_params:
        The allocator's own parameters, checked by it (``adakv``: ``floor``, the share of the budget every head
        keeps, default 0.2).
    pin_overflow:
        What happens when the pinned positions alone exceed a layer's history budget: ``"error"`` raises
        :class:`~snapkv_sessions.errors.BudgetError`; ``"grow"`` keeps every pinned position and grows that
        layer's budget by the excess.
    """

    budget: int | None = 1024
    budget_ratio: float | None = None
    window: int = 32
    kernel: int = 7
    pooling: Literal["avg", "max"] = "avg"
    head_reduce: Literal["mean", "max"] = "mean"
    strategy: Literal["uniform", "pyramid"] = "uniform"
    pyramid_beta: float = 20.0
    pin_overflow: Literal["error", "grow"] = "error"
    method: Literal["snapkv", "streaming"] = "snapkv"
    sinks: int = 4
    span_aware: bool = False
    span_unit: Literal["word", "line", "sentence"] = "word"
    scorer: str = "snapkv"
    allocator: str = "uniform"
    allocator_params: dict[str, float | int | str | bool] = {}

    @property
    def base_scorer(self) -> str:
        """The registry key compression runs: ``method="streaming"`` selects the streaming scorer."""
        return "streaming" if self.method == "streaming" else self.scorer

    @field_validator("scorer")
    @classmethod
    def _registered(cls, name: str) -> str:
        known = registered_scorers()
        if name not in known:
            raise ValueError(f"unknown scorer {name!r}; registered: {sorted(known)} (register one with "
                             "snapkv_sessions.scorers.register_scorer before building the config)")
        return name

    @field_validator("allocator")
    @classmethod
    def _allocator_registered(cls, name: str) -> str:
        from .allocate import ALLOCATORS  # torch-free at import

        if name not in ALLOCATORS:
            raise ValueError(f"unknown allocator {name!r}; registered: {sorted(ALLOCATORS)} (register one with "
                             "snapkv_sessions.allocate.register_allocator before building the config)")
        return name

    @model_serializer(mode="wrap")
    def _defaults_unsaid(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # A policy's canonical JSON (and so its sha256, stored with every session) stays what it was before
        # the scorer and allocator fields existed unless a policy names another scorer or allocator.
        data = handler(self)
        if self.scorer == "snapkv":
            data.pop("scorer", None)
        if self.allocator == "uniform":
            data.pop("allocator", None)
        if not self.allocator_params:
            data.pop("allocator_params", None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _ratio_replaces_budget(cls, data: object) -> object:
        # Giving budget_ratio alone means "no token budget", not "both".
        if isinstance(data, dict) and data.get("budget_ratio") is not None and "budget" not in data:
            return {**data, "budget": None}
        return data

    @model_validator(mode="after")
    def _check(self) -> CompressionConfig:
        if (self.budget is None) == (self.budget_ratio is None):
            raise ValueError("set exactly one of budget and budget_ratio")
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget={self.budget} must be a positive number of tokens")
        if self.budget is not None and self.budget <= self.window:
            raise ValueError(f"budget={self.budget} must be greater than window={self.window}")
        if self.budget_ratio is not None and not 0.0 < self.budget_ratio <= 1.0:
            raise ValueError(f"budget_ratio={self.budget_ratio} must be in (0, 1]")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} must be a positive odd number")
        if self.pyramid_beta < 1:
            raise ValueError(f"pyramid_beta={self.pyramid_beta} must be >= 1")
        if self.method == "streaming" and self.scorer not in ("snapkv", "streaming"):
            raise ValueError(f"scorer={self.scorer!r} conflicts with method='streaming', which selects the "
                             "'streaming' scorer; set only one of them")
        from .allocate import build_allocator

        try:  # the allocator checks its own parameters; its ConfigError names the one at fault
            build_allocator(self.allocator, self.allocator_params)
        except ConfigError as exc:
            raise ValueError(f"{exc.param}={bounded_repr(exc.value)} {exc.reason}") from None
        return self

    def budget_for(self, context_tokens: int) -> int:
        """Tokens kept per layer (uniform strategy) for a context of ``context_tokens`` true positions."""
        if self.budget is not None:
            return self.budget
        return max(self.window + 1, math.ceil(self.budget_ratio * context_tokens))


def _config_error(exc: ValidationError, given: dict[str, object]) -> ConfigError:
    """The first pydantic error as a ConfigError whose param is the field path and whose value is the input."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    value = given.get(loc, err.get("input"))
    if not loc:  # a model-level validator: name the field its message starts with ("field=value: reason")
        head = msg.split(" ", 1)[0]
        loc = msg.split("=", 1)[0] if "=" in head else "compression"
        value = _dotted(given, loc, value)
    return ConfigError(loc, value, msg)


def _dotted(given: dict[str, object], path: str, default: object) -> object:
    """``given["a"]["b"]`` for ``path`` "a.b", or ``default`` when the input has no such entry."""
    value: object = given
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


class RecallConfig(_Settings):
    """Decode-time recall from the tiered memory's host tier (the policy's ``memory.recall``; two-stage attention,
    :mod:`snapkv_sessions.recall`): at every decode step each layer and KV head also attends to the cold slots
    the step's query reaches for.

    Parameters
    ----------
    budget:
        Cold slots recalled per layer and KV head per step; or ``None`` to use ``ratio``.
    ratio:
        The same as a share of the context (true positions so far), in ``[0, 1]``; 1 recalls every cold slot
        (full attention).
    selector:
        How the slots are chosen, a key in :data:`snapkv_sessions.recall.SELECTORS`: ``"exact"`` (every cold key
        scored), ``"sparq"`` (the ``channels`` largest components of ``|q|``), ``"pages"`` (Quest's per-page
        key bounds, pages of ``page`` slots recalled whole), ``"lowrank"`` (a rank-``rank`` fit of the cold keys
        before RoPE, after ShadowKV).
    channels:
        SparQ's r.
    page:
        Quest's page size, in slots.
    rank:
        The low-rank selector's rank (at most the head dimension).
    reduce:
        How a slot is ranked from the query heads of its GQA group: ``"max"`` (the largest of their scores: a slot
        any of them reaches for), or ``"mass"`` (the attention probability the group would give it, each query
        head's softmax normalised over the hot slots and the selector's estimate of every cold one: a head whose
        hot set already holds its attention asks for little). ``"mass"`` needs a selector that scores slots (not
        ``"pages"``).
    share:
        How the step's recall budget is split: ``"head"`` (``budget`` slots per layer and KV head), or ``"layer"``
        (``budget`` times the KV heads per layer, to the slots of any head with the most attention mass: a head
        whose attention is spread out gets more; needs ``reduce: mass``).
    tail:
        What becomes of the cold slots a step does not recall: ``"drop"`` (not attended), or ``"pages"``
        (estimated: each one's logit is the selector's estimate, its value the mean value of its page of
        ``tail_page`` cold slots, and together they enter the softmax as one more slot per query head, so the
        attention they would take is not handed to the rest). Needs a selector that scores slots.
    tail_page:
        Cold slots per page whose values the tail's estimate averages (1: each slot's own value).
    escalate:
        A margin in logits, or ``None`` (never). A decode step whose two most likely next tokens are within this
        margin of each other under recall is taken again over the whole history: the turn's tokens decoded since
        the last retake are fed again with the step's own as a prefill over hot and cold, so the step is the full
        cache's and a near-tie is not flipped by the recall's error. ``0`` never retakes a step either.
    """

    budget: int | None = None
    ratio: float | None = None
    selector: str = "exact"
    channels: int = 16
    page: int = 16
    rank: int = 16
    reduce: Literal["max", "mass"] = "max"
    share: Literal["head", "layer"] = "head"
    tail: Literal["drop", "pages"] = "drop"
    tail_page: int = 32
    escalate: float | None = None

    @field_validator("selector")
    @classmethod
    def _selector_registered(cls, name: str) -> str:
        known = registered_selectors()
        if name not in known:
            raise ValueError(f"unknown selector {name!r}; registered: {sorted(known)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> RecallConfig:
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("set exactly one of budget and ratio")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"budget={self.budget} must be a non-negative number of slots")
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio={self.ratio} must be in [0, 1]")
        if self.channels < 1:
            raise ValueError(f"channels={self.channels} must be >= 1")
        if self.page < 1:
            raise ValueError(f"page={self.page} must be >= 1")
        if self.rank < 1:
            raise ValueError(f"rank={self.rank} must be >= 1")
        if self.reduce == "mass" and self.selector in PAGE_SELECTORS:
            raise ValueError(f"reduce={self.reduce} needs a selector that scores slots; {self.selector!r} ranks pages")
        if self.share == "layer" and self.reduce != "mass":
            raise ValueError(f"share={self.share} compares heads by attention mass: it needs reduce: mass")
        if self.tail != "drop" and self.selector in PAGE_SELECTORS:
            raise ValueError(f"tail={self.tail} needs a selector that scores slots; {self.selector!r} ranks pages")
        if self.tail_page < 1:
            raise ValueError(f"tail_page={self.tail_page} must be >= 1")
        if self.escalate is not None and not 0.0 <= self.escalate < math.inf:  # NaN too
            raise ValueError(f"escalate={self.escalate} must be a finite margin >= 0 in logits, or null")
        return self

    def slots(self, context: int) -> int:
        """Cold slots each layer and KV head recalls per step, for a context of ``context`` true positions."""
        if self.budget is not None:
            return self.budget
        return math.ceil(self.ratio * context)
