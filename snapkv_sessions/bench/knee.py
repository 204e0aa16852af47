"""``bench knee``: where compression is safe, by context length.

Four tasks over a staff directory (``bench shift``'s records) at each target length: a lookup (a value asked
from one record), a multi-hop lookup (values from two records), an exact copy of a record's line (scored by
in-order word overlap) and a rule stated before the document (an extension written as ``EXT-<n>``). Each item
is prefilled once; every budget compresses a copy of that cache (:func:`~.variants.compressed_variants`), once
with SnapKV and once with line-level selection (``span_aware`` with ``span_unit: line``: a record is kept whole
or not at all).

Reported per task, length and selection: accuracy per budget, agreement with the full cache's reply (equal
tokens), and B*, the smallest budget whose accuracy is within 2 points of the full cache's, with a bootstrap
interval over the items (90%: the 5th and 95th percentiles of B* over 1,000 resamples).
"""

from __future__ import annotations

import random
import time

from ..config import CompressionConfig
from ..generation import GenerationConfig
from .quality import COPY_PASS, copy_score, knee_item_ids
from .shift import is_correct, make_scenario
from .variants import compressed_variants

TASKS = ("lookup", "multihop", "copy", "rule")
SELECTIONS = ("snapkv", "lines", "adakv")


def records_for(tok, target: int) -> int:
    """Directory records whose item prompt is about ``target`` tokens (measured on one scenario)."""
    sample = make_scenario(0, records=40)
    per_record = len(tok(sample.document, add_special_tokens=False)["input_ids"]) / 40
    return max(4, round((target - 120) / per_record))


def task_item(seed: int, records: int, task: str) -> tuple[str, str, list[str], str | None]:
    """(document, question, expected strings, line to copy) of one item."""
    rng = random.Random(seed * 7919 + TASKS.index(task))
    sc = make_scenario(seed, records=records)
    lines = sc.document.split("\n")[3:]
    a, b = rng.sample(lines, 2)
    name_a, name_b = a.split(":")[0], b.split(":")[0]

    def field(line: str, key: str) -> str:
        return line.split(f"{key} ", 1)[1].split(",")[0].rstrip(".")

    if task == "lookup":
        return sc.document, f"What is the office of {name_a}?", [field(a, "office")], None
    if task == "multihop":
        return (sc.document, f"What are the extensions of {name_a} and of {name_b}? Give both numbers.",
                [field(a, "extension"), field(b, "extension")], None)
    if task == "copy":
        return sc.document, f"Copy the directory line of {name_a} exactly, nothing else.", [a], a
    return (sc.document, f"What is the phone extension of {name_a}? Follow the rule at the top.",
            [f"EXT-{field(a, 'extension')}"], None)


def correct(task: str, reply: str, expect: list[str], line: str | None) -> bool:
    if task == "copy":
        return copy_score(reply, line) >= COPY_PASS
    if task == "multihop":
        return all(is_correct(reply, [e]) for e in expect)
    return is_correct(reply, expect)


def configs(budgets: list[float], window: int) -> dict[str, CompressionConfig | None]:
    out: dict[str, CompressionConfig | None] = {"full": None}
    for b in budgets:
        out[f"snapkv@{b}"] = CompressionConfig.make(budget_ratio=b, window=window)
        out[f"lines@{b}"] = CompressionConfig.make(budget_ratio=b, window=window, span_aware=True, span_unit="line")
        out[f"adakv@{b}"] = CompressionConfig.make(budget_ratio=b, window=window, allocator="adakv")
    return out


def run(runner, lengths: list[int], n: int, budgets: list[float], window: int, max_new_tokens: int,
        log=print) -> dict:
    tok = runner.tokenizer
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    variants = configs(budgets, window)
    rows = []
    t0 = time.perf_counter()
    for target in lengths:
        records = records_for(tok, target)
        for task in TASKS:
            for seed in range(n):
                doc, question, expect, line = task_item(300 + seed, records, task)
                ids = knee_item_ids(tok, doc, question)
                replies = {}
                for name, var in zip(variants, compressed_variants(runner, ids, window, list(variants.values())),
                                     strict=True):
                    out = list(runner.generate(var.state, var.logits, gen))
                    replies[name] = out
                    rows.append({"length": target, "tokens": len(ids), "task": task, "item": seed, "variant": name,
                                 "correct": correct(task, tok.decode(out, skip_special_tokens=True), expect, line),
                                 "same_as_full": out == replies["full"]})
            log(f"length {target} task {task}: {n} items ({(time.perf_counter() - t0) / 60:.1f} min)")
    return {"benchmark": "knee", "lengths": lengths, "budgets": budgets, "window": window, "items_per_cell": n,
            "cells": summarise(rows, lengths, budgets), "minutes": round((time.perf_counter() - t0) / 60, 1),
            "rows": rows}


def b_star(acc: dict[float, float], full: float, budgets: list[float]) -> float | None:
    """The smallest budget whose accuracy is within 2 points of the full cache's; None when none is, or when the
    full cache itself fails every item (within 2 points of 0 says nothing)."""
    if full <= 0:
        return None
    within = [b for b in budgets if acc[b] >= full - 0.02]
    return min(within) if within else None


def summarise(rows: list[dict], lengths: list[int], budgets: list[float], resamples: int = 1000) -> dict:
    cells = {}
    for target in lengths:
        for task in TASKS:
            sel = [r for r in rows if r["length"] == target and r["task"] == task]
            items = sorted({r["item"] for r in sel})
            by = {(r["item"], r["variant"]): r for r in sel}
            for selection in SELECTIONS:
                cells[f"{task}@{target}/{selection}"] = knee_cell(by, items, selection, budgets, resamples)
    return cells


def knee_cell(by: dict, items: list[int], selection: str, budgets: list[float], resamples: int = 1000) -> dict:
    """One cell's accuracy per budget, agreement with the full cache and B* with its bootstrap 90% interval;
    ``by[(item, "full")]`` and ``by[(item, f"{selection}@{b}")]`` hold ``correct`` (a bool or a share) and
    ``same_as_full``. Shared with ``bench ruler``."""
    def accuracy(chosen: list[int]) -> tuple[float, dict[float, float]]:
        full = sum(by[(i, "full")]["correct"] for i in chosen) / len(chosen)
        return full, {b: sum(by[(i, f"{selection}@{b}")]["correct"] for i in chosen) / len(chosen) for b in budgets}

    full, acc = accuracy(items)
    rng = random.Random(0)
    draws = []
    for _ in range(resamples):
        f, a = accuracy([rng.choice(items) for _ in items])
        star = b_star(a, f, budgets)
        draws.append(2.0 if star is None else star)  # no budget within 2 points counts as above them all
    draws.sort()
    lo, hi = draws[int(0.05 * resamples)], draws[int(0.95 * resamples) - 1]
    agree = {b: round(sum(by[(i, f"{selection}@{b}")]["same_as_full"] for i in items) / len(items), 3)
             for b in budgets}
    return {"full": round(full, 3), "accuracy": {str(b): round(a, 3) for b, a in acc.items()},
            "agreement_with_full": {str(b): a for b, a in agree.items()}, "b_star": b_star(acc, full, budgets),
            "b_star_90ci": [None if lo > 1 else lo, None if hi > 1 else hi]}


def table(result: dict) -> str:
    budgets = result["budgets"]
    head = f"{'cell':<26} {'full':>5} " + " ".join(f"{b:>5}" for b in budgets) + f" {'B*':>5} {'90% CI':>13}"
    lines = [head, "-" * len(head)]
    for name, c in result["cells"].items():
        ci = "-" if c["b_star_90ci"] == [None, None] else f"{c['b_star_90ci'][0]}..{c['b_star_90ci'][1]}"
        lines.append(f"{name:<26} {c['full']:>5.2f} " + " ".join(f"{c['accuracy'][str(b)]:>5.2f}" for b in budgets)
                     + f" {c['b_star']!s:>5} {ci:>13}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """B* against length, per task and selection (a missing B* is drawn above the budgets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    for task in TASKS:
        for selection, style in zip(SELECTIONS, ("-", "--", ":"), strict=True):
            ys = [result["cells"][f"{task}@{n}/{selection}"]["b_star"] for n in result["lengths"]]
            ax.plot(result["lengths"], [1.05 if y is None else y for y in ys], style, marker="o",
                    label=f"{task} ({selection})")
    ax.set(xlabel="context tokens", ylabel="B* (budget ratio)", xscale="log", ylim=(0, 1.1),
           title=f"B*: smallest budget within 2 points of the full cache ({result['items_per_cell']} items/cell)")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
