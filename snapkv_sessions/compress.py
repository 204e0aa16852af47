"""One compression: what each layer and KV head keeps after a turn's prefill, from the window's attention.

A compression reads the conversation's memory (:meth:`~snapkv_sessions.cache.HotOnly.history`: the hot slots,
or hot and cold together on a tiered cache), asks the policy's scorer (:mod:`snapkv_sessions.scorers`) to rank
every layer's history slots, takes the shared top-k with the pins forced in and the window kept, and hands the
chosen slots back to the memory (:meth:`~snapkv_sessions.cache.HotOnly.keep`). How many slots each layer keeps
is the budget allocation: per layer (:func:`~snapkv_sessions.press.layer_budgets`: uniform or pyramid), then
among the layer's heads (the policy's allocator, :mod:`snapkv_sessions.allocate`: even, or AdaKV's split).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import stats
from .allocate import Allocator, Uniform, build_allocator
from .attention import WindowProbe
from .cache import History, first_slots
from .config import CompressionConfig
from .errors import ConfigError
from .press import history_room, layer_budgets
from .reach import Reach, cold_reach, earlier_end
from .report import CompressionReport
from .scorers import KeepRule, ScoreContext, Scorer, build_scorer, select_layer
from .state import KVState


@dataclass(frozen=True)
class Selection:
    """One layer's selection, for an observer (:attr:`ModelRunner.observer`).

    positions (B, Hkv, T): true positions of the layer's slots (the whole history when tiered); scores
    (B, Hkv, T - W): the scorer's scores of the history slots; chosen (B, Hkv, K): the kept slots; keep_mask (N,):
    the positions forced in (pins and this turn's protected question).
    """

    layer: int
    positions: torch.Tensor
    scores: torch.Tensor
    chosen: torch.Tensor
    keep_mask: torch.Tensor


@dataclass(frozen=True)
class Layout:
    """What a compression needs of the model: its layer and KV-head counts, its device and tokenizer."""

    num_layers: int
    num_kv_heads: int
    device: torch.device
    tokenizer: object | None = None


@torch.inference_mode()
def compress(state: KVState, cfg: CompressionConfig, probe: WindowProbe, layout: Layout,
             protect: torch.Tensor | None = None, observer: Callable[[Selection], None] | None = None,
             ) -> CompressionReport:
    """Keep, per layer and KV head, the history the probe's window attends to, plus the window.

    Layers whose history already fits their budget are left alone. Pinned positions are always kept; ``protect``
    (N,) bool over true positions is kept for this compression only (the current question). ``observer`` gets
    every layer's :class:`Selection` (the audit's ``--find``); None computes nothing for it.
    """
    # The keep mask lives on the host (pins are known there); the selection gets a device copy, and the
    # pin count comes from the host copy, so choosing slots never waits on the device.
    keep_host = state.pinned.cpu() if protect is None else state.pinned.cpu() | protect[: state.next_position].cpu()
    keep_mask = keep_host.to(layout.device)  # (N,)
    window = probe.window
    budgets = layer_budgets(cfg, layout.num_layers, state.next_position)
    history = state.cache.history(state)  # a tiered cache's is the whole history, hot and cold
    report = CompressionReport(
        context_tokens=state.next_position,
        window=window,
        budgets=budgets,
        tokens_before=history.lengths(),
        tokens_after=[],
        pinned_total=int(state.pinned.sum()),
        score_ms=probe.seconds * 1e3,
        kv_bytes_before=history.nbytes,
    )
    mass = history_attention(history, probe)  # a device scalar: read once, at the end
    spread = window_concentration(probe) if stats.active() else None  # two device scalars, for the stats stream
    # the scorer the config names (snapkv_sessions.scorers): on CUDA the "snapkv" key builds the fused
    # Triton scorer, elsewhere the torch one (equal scores)
    scorer = build_scorer(cfg, ScoreContext(window, layout.num_kv_heads, layout.device, layout.tokenizer))
    # pins plus protected tokens in the history part (all but the window) are never evicted, so every
    # layer and head holds all of them: the host count is the count of every head
    rule = KeepRule(window, keep_mask, grow=cfg.pin_overflow == "grow",
                    n_pinned=int(keep_host[: state.next_position - window].sum()))
    allocator = build_allocator(cfg.allocator, cfg.allocator_params)
    uneven = not isinstance(allocator, Uniform)
    chosen: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, K) slots to keep
    visible: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, K) False at padding, where the heads keep uneven counts
    t0 = time.perf_counter()
    for layer in range(layout.num_layers):
        length = history.positions[layer].shape[-1]
        if probe.scores[layer].shape[-1] != length:
            raise ConfigError("probe", f"layer {layer}", "was recorded on another cache length; compress "
                              "right after the prefill that observed")
        if length > budgets[layer]:
            chosen[layer] = _select(history, probe, scorer, rule, layer, budgets[layer], allocator,
                                    observer)  # (B, Hkv, K)
            if uneven or history.visible(layer) is not None:
                visible[layer] = first_slots(chosen[layer])  # a repeated slot is a head's padding
    before = state.cache.hot_before()  # what was hot when the turn began (None without a tier)
    reach = cold_reach(history, probe, before, chosen) if before is not None else None  # (2, L, Hkv) device
    t1 = time.perf_counter()
    if state.cache.keep(state, chosen, visible):  # a cache that fits every budget is left alone, and costs nothing
        report.select_ms = (t1 - t0) * 1e3
        report.gather_ms = (time.perf_counter() - t1) * 1e3
    _fill_report(report, state, probe, mass, layout, spread,
                 None if reach is None else (reach, earlier_end(probe, before)))
    report.tier = state.cache.tier_report(state)
    state.reports.append(report)
    return report


def _select(history: History, probe: WindowProbe, scorer: Scorer, rule: KeepRule, layer: int, budget: int,
            allocator: Allocator, observer: Callable[[Selection], None] | None) -> torch.Tensor:
    """Sorted slot indices to keep in one layer, (B, Hkv, K): the shared top-k. No host synchronisation unless
    the heads keep uneven counts (the largest is read once)."""
    chosen = select_layer(scorer, probe.scores[layer], history, layer, budget, rule, allocator)  # (B, Hkv, K)
    if observer is not None:
        scores = scorer.score(probe.scores[layer], history, layer)  # (B, Hkv, T - W), as the top-k saw them
        observer(Selection(layer, history.positions[layer], scores, chosen, rule.keep_mask))
    return chosen


def _fill_report(report: CompressionReport, state: KVState, probe: WindowProbe, mass: torch.Tensor | None,
                 layout: Layout, spread: torch.Tensor | None = None,
                 reach: tuple[torch.Tensor, int] | None = None) -> None:
    """Per-layer counts for the report, read from the device in one transfer after all layers are done."""
    report.tokens_after = state.cache_lengths()  # slots held, padding included (what the memory costs)
    pinned = state.pinned.to(layout.device)  # (N,)
    held_pos = [p[0] for p in state.held()]  # per layer (Hkv, K), -1 at padding
    real = torch.stack([(p >= 0).sum(-1) for p in held_pos])  # (L, Hkv) real slots per head
    new = torch.stack([(p >= probe.turn_start).sum(-1) for p in held_pos])  # (L, Hkv)
    held = torch.stack([(pinned[p.clamp(min=0)] & (p >= 0)).sum(-1).min() for p in held_pos])  # (L,) fewest pins
    # counts stay below 2**24, so float32 carries them exactly alongside the attention mass
    parts = [real.flatten().float(), new.flatten().float(), held.float()]
    if spread is not None:
        parts.append(spread.float())
    if reach is not None:
        parts.append(reach[0].flatten())
    if mass is not None:
        parts.append(mass.float().reshape(1))
    values = torch.cat(parts).tolist()
    n, heads = new.numel(), new.shape[1]
    report.kept = [[int(v) for v in values[i : i + heads]] for i in range(0, n, heads)]
    report.kept_new = [[int(v) for v in values[i : i + heads]] for i in range(n, 2 * n, heads)]
    report.pinned_kept = int(min(values[2 * n : 2 * n + held.numel()]))
    report.history_attention = values[-1] if mass is not None else None
    if spread is not None:
        at = 2 * n + held.numel()
        report.window_top_mass, report.window_entropy = round(values[at], 4), round(values[at + 1], 4)
    if reach is not None:
        at = 2 * n + held.numel() + (0 if spread is None else spread.numel())
        grid, earlier = reach  # (2, L, Hkv), and where the turn's prefill began
        report.reach = Reach.of(values[at : at + grid.numel()], grid.shape[1], grid.shape[2], earlier).to_dict()
    report.kv_bytes_after = state.kv_bytes()


TOP_SHARE = 0.1  # window_concentration: the share of the history's positions whose mass it measures


def window_concentration(probe: WindowProbe) -> torch.Tensor | None:
    """How concentrated the window's attention over the history (the window itself excluded) is, as a (2,) device
    tensor: the mass on the top :data:`TOP_SHARE` of positions, and the entropy over log(positions) (1: even, 0:
    one position), each the mean over layers and query heads; None when no layer has 10 history positions.

    Attention that sits on a few positions is what SnapKV keeps well; attention spread evenly over the history is
    what a budget cuts into (an operator watches both against the kept share)."""
    tops, spreads = [], []
    for scores in probe.scores.values():  # (B, Hq, T)
        hist = scores[..., : scores.shape[-1] - probe.window].float()  # (B, Hq, n) the history's positions
        n = hist.shape[-1]
        if n < 10:
            continue
        p = hist / hist.sum(-1, keepdim=True).clamp_min(1e-30)  # (B, Hq, n) a distribution per query head
        tops.append(p.topk(math.ceil(TOP_SHARE * n), dim=-1).values.sum(-1).mean())  # ()
        spreads.append(-(p * p.clamp_min(1e-30).log()).sum(-1).mean() / math.log(n))  # ()
    if not tops:
        return None
    return torch.stack([torch.stack(tops).mean(), torch.stack(spreads).mean()])  # (2,)


def history_attention(history: History, probe: WindowProbe, sinks: int = 4) -> torch.Tensor | None:
    """Window attention mass on the slots that predate this prefill, sinks excluded, mean over layers.

    A 0-d device tensor (not read here: the caller reads it with the rest of the report)."""
    if probe.turn_start <= sinks or not probe.scores:
        return None
    masses = []
    for layer, scores in probe.scores.items():  # (B, Hq, T)
        pos = history.positions[layer]  # (B, Hkv, T)
        old = (pos < probe.turn_start) & (pos >= sinks)  # (B, Hkv, T) slots from earlier turns, no sinks
        old = old.repeat_interleave(scores.shape[1] // pos.shape[1], dim=1)  # (B, Hq, T)
        masses.append((scores * old).sum(-1).mean())
    return torch.stack(masses).mean()


def protect_mask(state: KVState, protect: tuple[tuple[int, int], ...], cfg: CompressionConfig, num_layers: int,
                 window: int) -> torch.Tensor | None:
    """(N,) bool: the ``protect`` ranges of true positions, when they fit beside the pins in every layer's budget."""
    if not protect:
        return None
    mask = torch.zeros(state.next_position, dtype=torch.bool)  # (N,)
    for start, end in protect:
        mask[start:end] = True
    if int((mask | state.pinned.cpu()).sum()) > history_room(cfg, num_layers, state.next_position, window):
        return None
    return mask
