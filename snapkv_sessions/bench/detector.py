"""``bench detector``: the drift detector's precision and recall on labelled follow-up and shift turns, by shape.

Model-free (MiniLM embeddings and the text signals only), so it runs in seconds. Two shapes of conversation:

* ``message``: the document is its own message, the user turns are questions;
* ``pasted``: the document is pasted into the first user message, before its question;

and two kinds of records: ``people`` (capitalised names: the staff directory of ``bench shift``) and ``items``
(a catalogue whose names are pairs of lowercase words, "steel bracket"). The threshold is calibrated on held-out
scenarios of every shape and kind (seeds 1000+), never on the evaluated ones.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ..drift import WorkingSet, key_terms, make_embedder, new_subject, question_text, refers_back, shift_score
from .shift import Scenario, Turn, make_scenario

ADJECTIVES = ["steel", "blue", "copper", "round", "small", "heavy", "silver", "red", "oak", "glass", "green", "brass"]
NOUNS = ["bracket", "widget", "hinge", "valve", "lamp", "spring", "pulley", "gasket", "clamp", "socket", "rivet", "cable"]
SHAPES = ("message", "pasted")
KINDS = ("people", "items")


def make_catalog(seed: int, records: int = 40) -> Scenario:
    """A catalogue of items named by two lowercase words, with follow-ups and shifts labelled like bench shift's."""
    rng = random.Random(seed)
    names = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], records)
    rows = [{"name": n, "price": f"{rng.randrange(2, 90)}.{rng.randrange(10, 99)}", "stock": str(rng.randrange(5, 900)),
             "sku": f"SKU-{rng.randrange(1000, 9999)}", "bin": f"{rng.choice('ABCD')}-{rng.randrange(10, 99)}"}
            for n in names]
    lines = [f"{r['name']}: price {r['price']}, stock {r['stock']}, sku {r['sku']}, bin {r['bin']}." for r in rows]
    document = "PARTS CATALOGUE\n\n" + "\n".join(lines)
    a, b, c, d = rng.sample(rows, 4)
    turns = [
        Turn(f"What is the price of the {a['name']}?", [a["price"]], "first"),
        Turn("How many of them are in stock?", [a["stock"]], "follow"),
        Turn(f"What is the price of the {b['name']}?", [b["price"]], "shift"),
        Turn("Which bin is that one kept in?", [b["bin"]], "follow"),
        Turn(f"Draft a short reorder note for the {c['name']}.", [c["name"]], "shift"),
        Turn("Make the note shorter.", [c["name"]], "follow"),
        Turn(f"Which item has the sku {d['sku']}?", [d["name"]], "shift"),
        Turn("And what does it cost?", [d["price"]], "follow"),
        Turn(f"Is the {a['name']} cheaper than the {b['name']}?", [], "shift"),
        Turn("By how much?", [], "follow"),
    ]
    return Scenario(document, turns)


def scenario(seed: int, kind: str, shape: str) -> Scenario:
    """One labelled scenario of ``kind`` (people, items) and ``shape`` (message, pasted)."""
    sc = make_scenario(seed) if kind == "people" else make_catalog(seed)
    if shape == "pasted":  # the document arrives inside the first user message, before its question
        first = replace(sc.turns[0], question=f"Here is the document:\n\n{sc.document}\n\n{sc.turns[0].question}")
        sc = Scenario(sc.document, [first, *sc.turns[1:]])
    return sc


def flags(sc: Scenario, vectors, threshold: float, follow_ups: bool = True) -> list[bool]:
    """The session's text-side detector over a scenario: each turn's question (not a pasted document) against the
    working set, names read with the document as context; the working set resets after a detected shift.
    ``follow_ups``: a question that refers back is not scored by its wording (policy drift.follow_ups)."""
    work = WorkingSet(vectors.shape[1])
    out = []
    for turn, vector in zip(sc.turns, vectors, strict=True):
        question = question_text(turn.question)
        drift = work.drift(vector)
        fresh = drift is not None and new_subject(key_terms(question, sc.document), work.terms)
        follow = follow_ups and refers_back(question)
        shift = drift is not None and shift_score(drift, fresh, False, follow_up=follow) > threshold
        if shift:
            work.reset()
        work.add(question, vector, sc.document)
        out.append(shift)
    return out


def _embedded(seeds: range, kind: str, shape: str, emb) -> list[tuple[Scenario, object]]:
    scs = [scenario(seed, kind, shape) for seed in seeds]
    return [(sc, emb.embed([question_text(t.question) for t in sc.turns])) for sc in scs]


def score(cases: list[tuple[Scenario, object]], threshold: float, follow_ups: bool = True) -> dict:
    tp = fp = fn = tn = 0
    for sc, vectors in cases:
        for turn, flag in zip(sc.turns, flags(sc, vectors, threshold, follow_ups), strict=True):
            tp += flag and turn.label == "shift"
            fp += flag and turn.label == "follow"
            fn += not flag and turn.label == "shift"
            tn += not flag and turn.label == "follow"
    return {"precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "recall": round(tp / (tp + fn), 3) if tp + fn else None, "tp": tp, "fp": fp, "fn": fn, "tn": tn}


def calibrate(seeds: range, emb, margin: float = 0.05) -> dict:
    """The smallest threshold with the best F1 over every kind and shape of the held-out ``seeds``, plus
    ``margin`` (kept inside the best-F1 range)."""
    cases = [c for kind in KINDS for shape in SHAPES for c in _embedded(seeds, kind, shape, emb)]
    sweep = []
    for step in range(101):
        s = score(cases, step / 100)
        sweep.append((step / 100, 2 * s["tp"] / (2 * s["tp"] + s["fp"] + s["fn"]) if s["tp"] else 0.0))
    best = max(f1 for _, f1 in sweep)
    best_range = [t for t, f1 in sweep if f1 == best]
    lo = best_range[0]
    hi = lo
    for t in best_range[1:]:
        if round(t - hi, 4) <= 0.01:
            hi = t
    return {"seeds": [seeds.start, seeds.stop - 1], "best_f1": round(best, 3), "best_range": [lo, hi],
            "threshold": round(min(lo + margin, hi), 2)}


def run(scenarios: int, threshold: float | None = None, calibration: int = 40) -> dict:
    emb = make_embedder("minilm")
    calib = calibrate(range(1000, 1000 + calibration), emb)
    default = 0.75  # the policy's default drift.threshold
    cells = {}
    for kind in KINDS:
        for shape in SHAPES:
            cases = _embedded(range(scenarios), kind, shape, emb)
            cells[f"{kind}/{shape}"] = {"at_default": score(cases, default),
                                        "at_default_without_follow_ups": score(cases, default, follow_ups=False),
                                        "at_calibrated": score(cases, calib["threshold"]),
                                        **({"at_given": score(cases, threshold)} if threshold is not None else {})}
    return {"benchmark": "detector", "scenarios_per_cell": scenarios, "default_threshold": default,
            "calibration": calib, "cells": cells}


def table(result: dict) -> str:
    head = f"{'kind/shape':<16} {'threshold':>16} {'precision':>9} {'recall':>7} {'tp':>4} {'fp':>4} {'fn':>4}"
    lines = [head, "-" * len(head)]
    for name, cell in result["cells"].items():
        for label, s in cell.items():
            t = {"at_default": result["default_threshold"], "at_calibrated": result["calibration"]["threshold"],
                 "at_default_without_follow_ups": f"{result['default_threshold']} (no f-u)"}.get(label, "given")
            lines.append(f"{name:<16} {t!s:>16} {s['precision']!s:>9} {s['recall']!s:>7} {s['tp']:>4} {s['fp']:>4} "
                         f"{s['fn']:>4}")
    lines.append(f"calibration: {result['calibration']}")
    return "\n".join(lines)
