"""One prefill, several compressions: how the benchmarks compare budgets on the same input side by side."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..config import CompressionConfig
from ..report import CompressionReport
from ..runner import ModelRunner
from ..state import KVState


@dataclass
class Variant:
    """A copy of the prefilled cache, compressed one way (``config`` None: the full cache)."""

    config: CompressionConfig | None
    state: KVState
    logits: torch.Tensor  # (V,) the prefill's next-token logits: the reply's first token comes from them
    report: CompressionReport | None
    prefill_ms: float


@dataclass
class Prefix:
    """A prompt's shared beginning, prefilled once with nothing observed (no window, nothing compressed)."""

    state: KVState
    ms: float  # its prefill time, counted in every prompt that continues it

    @classmethod
    def of(cls, runner: ModelRunner, ids: Sequence[int], tiered: bool = False) -> Prefix:
        """``tiered``: a state whose compressions keep what they evict in a host tier (decode-time recall reads it)."""
        state = runner.new_state(tiered=tiered)
        t0 = time.perf_counter()
        if ids:
            runner.prefill(state, ids)
        return cls(state, (time.perf_counter() - t0) * 1e3)


def compressed_variants(runner: ModelRunner, ids: Sequence[int], window: int,
                        configs: Sequence[CompressionConfig | None], prefix: Prefix | None = None) -> Iterator[Variant]:
    """Prefill ``ids`` once, observing the last ``window`` tokens, then yield one :class:`Variant` per config.

    A copy per variant keeps the comparison exact (every variant starts from the same cache) and costs one
    prefill instead of one per budget (36 s per 4K tokens on the quality model). With ``prefix``, ``ids`` are
    prefilled onto a copy of its (uncompressed) state, so several prompts sharing a long beginning pay for it once.
    """
    base = _copy(prefix.state) if prefix is not None else runner.new_state()
    t0 = time.perf_counter()
    logits, probe = runner.prefill(base, ids, window=window)
    prefill_ms = (time.perf_counter() - t0) * 1e3 + (prefix.ms if prefix is not None else 0.0)
    for cfg in configs:
        state = _copy(base)
        report = runner.compress(state, cfg, probe) if cfg is not None else None
        yield Variant(cfg, state, logits, report, prefill_ms)


def _copy(state: KVState) -> KVState:
    """An independent copy: a tiered state clones (its cold layers shared, never written in place), others deep."""
    return state.clone() if state.cold is not None else copy.deepcopy(state)
