"""``bench pointing``: where single window rows point, read as a task-shift signal (measured, not a decision).

The tiered memory's recorded attention signal (:mod:`snapkv_sessions.reach`) averages the observation window's
rows, and most rows are the chat template's, which attend where every turn's template attends; it separates
shifts from follow-ups at chance (docs/drift.md). A question's own name tokens can point instead: a copy
("retrieval") head at the token after a name attends to that name's earlier occurrence. This bench reads each
window row on its own, on tiered sessions of ``bench detector``'s scenarios:

1. per layer, query head and window row: the row's attention over the positions before the window (the sinks
   left out), summed per line of the document and divided by the row's mass on those positions; per head, the
   most any row gave each line (:class:`RowCapture`, through the runner's ``rows_observer`` and ``observer`` seams);
2. minus the mean of the same values over the session's earlier turns (the *lift*: a header line, or the
   previous question that every window attends to, drops out) (:func:`lifted`);
3. summed over ``K`` heads chosen on the other seeds' shift turns (those whose top line was most often the
   asked-for record's line: leave one seed out) (:func:`choose_heads`);
4. the turn's pointed line is the top one; a shift is a pointed line above ``floor`` outside the lines the turns
   since the last shift pointed at (:func:`decide`). The score for the AUC is the top value, negated when the
   line was already pointed at.

Model runs are fp32 (what ``bench detector --tier`` uses). Figures: the pointing accuracy on shift turns with one
record line, the AUC shift against follow-up per ``K``, and precision/recall per kind and shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..compress import Selection
from ..errors import ConfigError
from ..reach import SINKS
from .detector import _confusion, scenario, tiered_session
from .shift import Scenario, auc


@dataclass
class TurnReading:
    """One turn's reading: ``lines`` (L, Hq, D) per layer and query head, the most any window row gave each of
    the document's D lines (a share of the row's mass before the window); ``targets``: the document lines
    holding the turn's expected answer; ``label``: first, follow or shift."""

    label: str
    lines: np.ndarray
    targets: list[int]


class RowCapture:
    """A turn's window rows, seen through :attr:`ModelRunner.rows_observer` (each layer's rows, over its slots)
    and mapped to true positions when the compression observes the layer's selection (:attr:`ModelRunner.observer`:
    the slots' true positions, the whole history on a tiered cache), reduced there to the document's lines.

    ``document_line(ids)`` maps the conversation's token ids to each token's document line (-1 outside the
    document). A row reads the positions before the window (the sinks left out): on a later turn the history, on
    a first turn also a document pasted before its question."""

    def __init__(self, ids: Callable[[], Sequence[int]], document_line: Callable[[Sequence[int]], np.ndarray],
                 documents: int) -> None:
        self.ids, self.document_line, self.documents = ids, document_line, documents
        self.rows: dict[int, torch.Tensor] = {}  # layer -> (Hq, W, T) this turn's window rows
        self.lines: dict[int, np.ndarray] = {}  # layer -> (Hq, D)
        self._line: torch.Tensor | None = None  # (n,) this turn's document line per position before the window

    def begin(self) -> None:
        self._line = None
        self.rows.clear()
        self.lines.clear()

    def on_rows(self, layer: int, probs: torch.Tensor) -> None:
        self.rows[layer] = probs[0].flatten(0, 1).float().clone()  # (Hq, W, T): batch row 0, a session's

    def on_selection(self, sel: Selection) -> None:
        rows = self.rows.pop(sel.layer, None)
        if rows is None:
            return
        if self._line is None:
            ids = list(self.ids())
            line = self.document_line(ids[: len(ids) - rows.shape[1]])  # (n,) -1 outside the document
            self._line = torch.from_numpy(np.where(line < 0, self.documents, line))  # (n,) D: the spare bin
        positions = sel.positions[0]  # (Hkv, T) true positions of the layer's slots
        pos = positions.repeat_interleave(rows.shape[0] // positions.shape[0], 0)  # (Hq, T)
        n = len(self._line)
        if n <= SINKS:
            return
        mass = torch.zeros(rows.shape[0], rows.shape[1], max(int(pos.max()) + 1, n))  # (Hq, W, N)
        mass.scatter_add_(-1, pos.clamp(min=0).unsqueeze(1).expand(-1, rows.shape[1], -1), rows)
        mass = mass[..., :n]  # (Hq, W, n) before the window
        mass[..., :SINKS] = 0
        mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)  # each row's share of its mass before the window
        per_line = torch.zeros(*mass.shape[:2], self.documents + 1)  # (Hq, W, D + 1)
        per_line.index_add_(-1, self._line, mass)
        self.lines[sel.layer] = per_line[..., : self.documents].amax(1).numpy()  # (Hq, D) the most any row gave

    def reading(self, label: str, targets: list[int]) -> TurnReading | None:
        if not self.lines:
            return None
        return TurnReading(label, np.stack([self.lines[k] for k in sorted(self.lines)]), targets)  # (L, Hq, D)


def document_lines(token_ids: Sequence[int], text_of: Callable[[int], str], document: str) -> np.ndarray:
    """(N,) each token's line of ``document`` (-1 outside it): lines are counted by the newlines in the tokens'
    text, and the document begins at the first line whose text begins with the document's first line."""
    first = document.split("\n", 1)[0]
    count = len(document.split("\n"))
    texts = [text_of(t) for t in token_ids]
    line = np.concatenate([[0], np.cumsum([t.count("\n") for t in texts])[:-1]]).astype(np.int64)  # (N,)
    joined: dict[int, str] = {}
    for k, t in zip(line.tolist(), texts, strict=True):
        joined[k] = joined.get(k, "") + t
    start = next((k for k in sorted(joined) if joined[k].lstrip().startswith(first)), None)
    if start is None:
        return np.full(len(token_ids), -1, dtype=np.int64)
    out = line - start
    return np.where((out >= 0) & (out < count), out, -1)


def session_readings(runner, sc: Scenario, shape: str, budget_ratio: float, max_new_tokens: int) -> list[TurnReading]:
    """One scenario as a tiered session on ``runner`` (the policy of ``bench detector --tier``): a reading per
    turn whose compression observed its layers (every turn of a tiered session compresses)."""
    texts: dict[int, str] = {}

    def text_of(t: int) -> str:
        if t not in texts:
            texts[t] = runner.tokenizer.decode([t])
        return texts[t]

    doc_lines = sc.document.split("\n")
    session = tiered_session(runner, sc, shape, budget_ratio)
    capture = RowCapture(lambda: session.state.token_ids,
                         lambda ids: document_lines(ids, text_of, sc.document), len(doc_lines))
    runner.rows_observer, runner.observer = capture.on_rows, capture.on_selection
    try:
        out = []
        for turn in sc.turns:
            capture.begin()
            session.chat(turn.question, max_new_tokens=max_new_tokens)
            targets = [j for j, text in enumerate(doc_lines) if turn.expect and turn.expect[0] in text]
            reading = capture.reading(turn.label, targets)
            if reading is not None:
                out.append(reading)
        return out
    finally:
        runner.rows_observer, runner.observer = None, None


def lifted(readings: list[TurnReading]) -> list[np.ndarray]:
    """Each turn's lines (L, Hq, D) minus the mean of the session's earlier turns' (the first turn's as read)."""
    out, total = [], None
    for k, r in enumerate(readings):
        out.append(r.lines if total is None else r.lines - total / k)  # (L, Hq, D)
        total = r.lines.copy() if total is None else total + r.lines
    return out


def choose_heads(sessions: list[list[TurnReading]], k: int) -> list[tuple[int, int]]:
    """The ``k`` (layer, query head) pairs whose top lifted line was most often the asked-for record's line, over
    the shift turns with exactly one such line (ties: the lower layer and head first)."""
    hits = None
    for readings in sessions:
        for r, lift in zip(readings, lifted(readings), strict=True):
            if r.label == "shift" and len(r.targets) == 1:
                hit = (lift.argmax(-1) == r.targets[0]).astype(np.int64)  # (L, Hq)
                hits = hit if hits is None else hits + hit
    if hits is None:
        return []
    order = np.argsort(-hits.ravel(), kind="stable")[:k]
    return [(int(a), int(b)) for a, b in zip(*np.unravel_index(order, hits.shape), strict=True)]


@dataclass(frozen=True)
class Decision:
    """One turn's decision: the pointed line, its lifted value over the chosen heads (their mean), whether it was
    new to the turns since the last shift, and the score for the AUC (the value, negated when not new)."""

    label: str
    line: int
    value: float
    shift: bool
    score: float
    on_target: bool | None  # the pointed line is the record's (shift turns with one record line), else None


def decide(readings: list[TurnReading], heads: list[tuple[int, int]], floor: float) -> list[Decision]:
    """A session's turns in order: a shift is a pointed line whose value is above ``floor`` and which the turns
    since the last shift (the first turn's included) did not point at; the pointed set resets at a shift."""
    pointed: set[int] = set()
    out = []
    for k, (r, lift) in enumerate(zip(readings, lifted(readings), strict=True)):
        combined = np.mean([lift[a, b] for a, b in heads], axis=0)  # (D,)
        line, value = int(combined.argmax()), float(combined.max())
        sure, before = value > floor, line not in pointed
        new = sure and before and k > 0
        if new:
            pointed = {line}
        elif sure:
            pointed.add(line)
        on_target = line == r.targets[0] if r.label == "shift" and len(r.targets) == 1 else None
        out.append(Decision(r.label, line, round(value, 4), new, round(value if before else -value, 4), on_target))
    return out


def summarise(cells: dict[str, dict[int, list[list[TurnReading]]]], ks: Sequence[int], floor: float) -> dict:
    """Leave one seed out: per held-out seed, heads chosen on the other seeds of every cell, then that seed's
    sessions decided. ``cells[cell][seed]``: the sessions (one per seed). Per K: pointing accuracy, AUC (all
    cells and per cell), precision and recall per cell at ``floor``; and the heads chosen on every seed."""
    seeds = sorted({s for per_seed in cells.values() for s in per_seed})
    out: dict = {"floor": floor, "seeds": seeds, "by_k": {}}
    for k in ks:
        decisions: dict[str, list[Decision]] = {cell: [] for cell in cells}
        for held in seeds:
            train = [r for per_seed in cells.values() for s, sessions in per_seed.items() if s != held
                     for r in sessions]
            heads = choose_heads(train, k)
            if not heads:
                raise ConfigError("seeds", seeds, f"seeds other than {held} have no shift turn with exactly one "
                                  "record line to choose heads on")
            for cell, per_seed in cells.items():
                for readings in per_seed.get(held, []):
                    decisions[cell] += decide(readings, heads, floor)
        every = [d for ds in decisions.values() for d in ds if d.label in ("shift", "follow")]
        on = [d.on_target for d in every if d.on_target is not None]
        out["by_k"][str(k)] = {
            "pointing": {"on_target": sum(on), "of": len(on)},
            "auc": auc([d.score for d in every], [d.label == "shift" for d in every]),
            "cells": {cell: {"auc": auc([d.score for d in ds if d.label != "first"],
                                        [d.label == "shift" for d in ds if d.label != "first"]),
                             **_confusion([(d.shift, d.label) for d in ds])} for cell, ds in decisions.items()},
            "heads_all_seeds": choose_heads([r for per_seed in cells.values() for sessions in per_seed.values()
                                             for r in sessions], k)}
    return out


def run(model: str, kinds: Sequence[str], shapes: Sequence[str], seeds: Sequence[int], ks: Sequence[int],
        floor: float = 0.2, budget_ratio: float = 0.3, max_new_tokens: int = 12, log=None) -> dict:
    """Tiered sessions of ``bench detector``'s scenarios on ``model`` (fp32), read and summarised."""
    from ..models import runner_for

    runner, model_id = runner_for(model)
    cells: dict[str, dict[int, list[list[TurnReading]]]] = {}
    for kind in kinds:
        for shape in shapes:
            per_seed = cells.setdefault(f"{kind}/{shape}", {})
            for seed in seeds:
                per_seed[seed] = [session_readings(runner, scenario(seed, kind, shape), shape, budget_ratio,
                                                   max_new_tokens)]
                if log:
                    log(f"{kind}/{shape} seed {seed}: {len(per_seed[seed][0])} turns read")
    return {"benchmark": "pointing", "model": model_id, "budget_ratio": budget_ratio, "max_new_tokens": max_new_tokens,
            "kinds": list(kinds), "shapes": list(shapes), **summarise(cells, ks, floor)}


def table(result: dict) -> str:
    lines = [f"model {result['model']}, budget {result['budget_ratio']}, seeds {result['seeds']} (leave one out), "
             f"floor {result['floor']}"]
    head = f"{'K':>3} {'cell':<18} {'AUC':>6} {'precision':>9} {'recall':>7} {'tp':>4} {'fp':>4} {'fn':>4}"
    lines += [head, "-" * len(head)]
    for k, by in result["by_k"].items():
        p = by["pointing"]
        lines.append(f"{k:>3} {'all':<18} {by['auc']!s:>6}   pointing on the record's line: {p['on_target']}/{p['of']}")
        for cell, c in by["cells"].items():
            lines.append(f"{k:>3} {cell:<18} {c['auc']!s:>6} {c['precision']!s:>9} {c['recall']!s:>7} {c['tp']:>4} "
                         f"{c['fp']:>4} {c['fn']:>4}")
    return "\n".join(lines)

