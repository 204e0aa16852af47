"""``bench detector``: the drift detector's precision and recall on labelled follow-up and shift turns, by shape.

Model-free (MiniLM embeddings and the text signals only), so it runs in seconds. Two shapes of conversation:

* ``message``: the document is its own message, the user turns are questions;
* ``pasted``: the document is pasted into the first user message, before its question;

and the kinds of records of :data:`KINDS`: ``people`` (capitalised names: the staff directory of ``bench shift``),
``items`` (a catalogue whose names are pairs of lowercase words, "steel bracket"), ``titles``, ``codes`` and
``tables`` (reports or projects named by three or one lowercase words, every question in one template; ``tables``
lays its records out in a layout drawn per seed) and ``two-docs`` (shifts between two documents). The threshold
is calibrated on held-out scenarios of every shape and kind (seeds 1000+), never on the evaluated ones.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ..drift import WorkingSet, key_terms, make_embedder, new_subject, question_text, refers_back, shift_score
from .shift import Scenario, Turn, auc, make_scenario

ADJECTIVES = ["steel", "blue", "copper", "round", "small", "heavy", "silver", "red", "oak", "glass", "green", "brass"]
NOUNS = ["bracket", "widget", "hinge", "valve", "lamp", "spring", "pulley", "gasket", "clamp", "socket", "rivet", "cable"]
SHAPES = ("message", "pasted")
KINDS = ("people", "items", "titles", "codes", "tables", "two-docs")
# titles: reports named by three lowercase words; codes: projects named by one lowercase word; tables: the same
# projects in a layout drawn per seed (:data:`LAYOUTS`). All three ask every question in one template, the wording
# of a shift and of a follow-up differing only in the name or the field.
TITLE_WORDS = (["annual", "coastal", "quiet", "northern", "early", "open", "lower", "final"],
               ["harbor", "river", "market", "forest", "bridge", "garden", "valley", "station"],
               ["survey", "review", "plan", "audit", "study", "report", "budget", "proposal"])
CODES = ["falcon", "maple", "comet", "otter", "cedar", "quartz", "willow", "ember", "heron", "basalt", "juniper",
         "lynx", "orchid", "pebble", "raven", "saffron", "tundra", "violet", "walnut", "zephyr", "birch", "coral",
         "dune", "fjord", "glacier", "harvest", "iris", "jasper", "kestrel", "lagoon", "meadow", "nectar"]


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


# how a ``tables`` document lays out a record (name, owner, due, pages, room)
LAYOUTS = {
    "csv": "{name},{owner},{due},{pages},{room}",
    "tsv": "{name}\t{owner}\t{due}\t{pages}\t{room}",
    "markdown": "| {name} | {owner} | {due} | {pages} | {room} |",
    "bullets": "- {name} (owner {owner}, due {due}, {pages} pages, room {room})",
    "numbered": "{i}. {name} \u2014 owner {owner}, due {due}, {pages} pages, room {room}",
}
HEADERS = {"csv": "name,owner,due,pages,room", "tsv": "name\towner\tdue\tpages\troom",
           "markdown": "| name | owner | due | pages | room |\n|---|---|---|---|---|"}


def make_templated(seed: int, kind: str, records: int = 32) -> Scenario:
    """Records named by lowercase titles (``titles``: three words) or code words (``codes``: one; ``tables``: one,
    laid out as one of :data:`LAYOUTS`), every question asked in one template; follow-ups ask another field of the
    same record, by name or by pronoun."""
    rng = random.Random(seed)
    if kind == "titles":
        names = rng.sample([f"{a} {b} {c}" for a in TITLE_WORDS[0] for b in TITLE_WORDS[1] for c in TITLE_WORDS[2]],
                           records)
    else:
        names = rng.sample(CODES, records)
    rows = [{"name": n, "owner": f"{rng.choice('BCDFGHKLMNPRST')}{rng.choice('aeiou')}{rng.choice('lnrst')}o",
             "due": f"{rng.randrange(1, 28)} {rng.choice(['March', 'May', 'July', 'October'])}",
             "pages": str(rng.randrange(3, 300)), "room": f"R{rng.randrange(100, 999)}"} for n in names]
    if kind == "tables":
        layout = rng.choice(sorted(LAYOUTS))
        lines = [HEADERS[layout]] if layout in HEADERS else []
        lines += [LAYOUTS[layout].format(i=i + 1, **r) for i, r in enumerate(rows)]
    else:
        lines = [f"{r['name']}: owner {r['owner']}, due {r['due']}, pages {r['pages']}, room {r['room']}." for r in rows]
    document = ("REPORTS" if kind == "titles" else "PROJECTS") + "\n\n" + "\n".join(lines)
    a, b, c, d = rng.sample(rows, 4)

    def ask(field: str, row: dict) -> str:
        return f"What is the {field} of {row['name']}?"

    turns = [
        Turn(ask("due date", a), [a["due"]], "first"),
        Turn(ask("page count", a), [a["pages"]], "follow"),  # the template again, the same record
        Turn(ask("due date", b), [b["due"]], "shift"),  # the template again, another record
        Turn("And who owns it?", [b["owner"]], "follow"),
        Turn(ask("room", c), [c["room"]], "shift"),
        Turn(ask("owner", c), [c["owner"]], "follow"),
        Turn(ask("page count", d), [d["pages"]], "shift"),
        Turn("Which room is that one in?", [d["room"]], "follow"),
    ]
    return Scenario(document, turns)


def make_two_documents(seed: int) -> Scenario:
    """A staff directory and a parts catalogue in one conversation: the shifts move to the other document."""
    people, parts = make_scenario(seed, records=24), make_catalog(seed, records=24)
    p, q = people.turns, parts.turns
    turns = [p[0], p[3], replace(q[0], label="shift"), q[1], replace(p[2], label="shift"), p[3],
             replace(q[2], label="shift"), q[3], replace(p[8], label="shift"), p[9]]
    return Scenario(people.document + "\n\n" + parts.document, turns)


def scenario(seed: int, kind: str, shape: str) -> Scenario:
    """One labelled scenario of ``kind`` (:data:`KINDS`) and ``shape`` (message, pasted)."""
    if kind == "people":
        sc = make_scenario(seed)
    elif kind == "items":
        sc = make_catalog(seed)
    elif kind in ("titles", "codes", "tables"):
        sc = make_templated(seed, kind)
    elif kind == "two-docs":
        sc = make_two_documents(seed)
    else:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
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
    return _confusion([(flag, turn.label) for sc, vectors in cases
                       for turn, flag in zip(sc.turns, flags(sc, vectors, threshold, follow_ups), strict=True)])


def _confusion(pairs: list[tuple[bool, str]]) -> dict:
    """Precision and recall of (flagged, label) pairs: a flagged shift is a hit, a flagged follow-up a false alarm
    (first turns count as neither)."""
    tp = sum(f and lab == "shift" for f, lab in pairs)
    fp = sum(f and lab == "follow" for f, lab in pairs)
    fn = sum(not f and lab == "shift" for f, lab in pairs)
    tn = sum(not f and lab == "follow" for f, lab in pairs)
    return {"precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "recall": round(tp / (tp + fn), 3) if tp + fn else None, "tp": tp, "fp": fp, "fn": fn, "tn": tn}


def _f1(s: dict) -> float:
    return 2 * s["tp"] / (2 * s["tp"] + s["fp"] + s["fn"]) if s["tp"] else 0.0


def calibrate(seeds: range, emb, margin: float = 0.05) -> dict:
    """The smallest threshold with the best F1 over every kind and shape of the held-out ``seeds``, plus
    ``margin`` (kept inside the best-F1 range)."""
    cases = [c for kind in KINDS for shape in SHAPES for c in _embedded(seeds, kind, shape, emb)]
    sweep = []
    for step in range(101):
        s = score(cases, step / 100)
        sweep.append((step / 100, _f1(s)))
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


# ---------------------------------------------------------------------------------------------- with the tier


def tiered_session(runner, sc: Scenario, shape: str, budget_ratio: float):
    """A new tiered session of ``sc`` on ``runner`` (budget ``budget_ratio``, drift never acted on, no embedder),
    its document added as its own message in the ``message`` shape (pasted in the first question otherwise)."""
    from ..policy import Policy
    from ..session import Session
    from ..store import SessionStore

    policy = Policy.from_dict({"compression": {"budget_ratio": budget_ratio},
                               "drift": {"action": "never", "embedder": "none"}}).stated()
    session = Session.create(runner, policy=policy, store=SessionStore("sqlite://"))
    if shape == "message":
        session.add_document(sc.document, name="document")
    return session


def tiered_turns(runner, sc: Scenario, shape: str, budget_ratio: float, max_new_tokens: int) -> list[dict]:
    """One scenario as a tiered session on ``runner``: per turn its label, the attention signal's reading
    (:mod:`snapkv_sessions.reach`: score and recalled share) and the slots recalled from cold, as recorded."""
    session = tiered_session(runner, sc, shape, budget_ratio)
    out = []
    for turn in sc.turns:
        reply = session.chat(turn.question, max_new_tokens=max_new_tokens)
        reach = reply.report.reach if reply.report is not None else None
        out.append({"label": turn.label, "attention": reach and reach["score"],
                    "recalled": reach and reach["recalled"],
                    "recalled_slots": reply.report.tier["recalled"] if reply.report and reply.report.tier else None})
    return out


def attention_score(rows: list[dict], threshold: float) -> dict:
    """Precision and recall of ``attention > threshold`` over the labelled turns of ``rows``."""
    return _confusion([(r["attention"] > threshold, r["label"]) for r in rows
                       if r["label"] != "first" and r["attention"] is not None])


def calibrate_attention(rows: list[dict]) -> dict:
    """The threshold with the best F1 over ``rows`` (every kind and shape of the calibration seeds)."""
    values = sorted({r["attention"] for r in rows if r["label"] != "first" and r["attention"] is not None})
    best = (-1.0, 0.0)
    for lo, hi in zip(values, values[1:] + [values[-1] + 1e-3], strict=True):
        t = round((lo + hi) / 2, 4)
        f1 = _f1(attention_score(rows, t))
        if f1 > best[0]:
            best = (f1, t)
    return {"best_f1": round(best[0], 3), "threshold": best[1]}


def run_tiered(model: str, scenarios: int, calibration: int, budget_ratio: float = 0.3, max_new_tokens: int = 12,
               results: str | None = None, kinds: tuple[str, ...] = KINDS, log=None) -> dict:
    """The attention signal beside the text detector, per kind and shape, on tiered sessions of ``model``.

    Seeds 1000+ (``calibration`` per cell) choose the attention threshold; seeds 0.. (``scenarios`` per cell)
    give the figures. ``results``: a JSONL file, one line per scenario, appended; a rerun resumes."""
    import json

    from ..models import runner_for
    from ..policy import Policy
    from .ruler import load_rows

    runner, model_id = runner_for(model)
    done = {(r["kind"], r["shape"], r["seed"]): r for r in load_rows(results)
            if r.get("model") == model_id and r.get("budget_ratio") == budget_ratio
            and r.get("max_new_tokens") == max_new_tokens}
    emb = make_embedder("minilm")
    seeds = list(range(scenarios)) + list(range(1000, 1000 + calibration))
    for kind in kinds:
        for shape in SHAPES:
            for seed in seeds:
                if (kind, shape, seed) in done:
                    continue
                turns = tiered_turns(runner, scenario(seed, kind, shape), shape, budget_ratio, max_new_tokens)
                row = {"model": model_id, "budget_ratio": budget_ratio, "max_new_tokens": max_new_tokens,
                       "kind": kind, "shape": shape, "seed": seed, "turns": turns}
                done[(kind, shape, seed)] = row
                if results:
                    with open(results, "a") as fh:
                        fh.write(json.dumps(row) + "\n")
                if log:
                    log(f"{kind}/{shape} seed {seed}: {[t['attention'] for t in turns]}")
    calib_rows = [t for (k, _s, seed), r in done.items() if seed >= 1000 and seed < 1000 + calibration
                  and k in kinds for t in r["turns"]]
    calib = calibrate_attention(calib_rows) if calib_rows else {"best_f1": None, "threshold": None}
    default = Policy().drift.attention_threshold
    text_default = Policy().drift.threshold
    cells = {}
    for kind in kinds:
        for shape in SHAPES:
            held = [done[(kind, shape, seed)] for seed in range(scenarios)]
            rows = [t for r in held for t in r["turns"]]
            text = _embedded(range(scenarios), kind, shape, emb)
            cells[f"{kind}/{shape}"] = {
                "attention_at_default": attention_score(rows, default),
                "attention_at_calibrated": attention_score(rows, calib["threshold"]) if calib["threshold"] is not None
                else None,
                "text_at_default": score(text, text_default),
                "attention_by_label": _by_label(rows),
                "auc": {"attention": _auc(rows, "attention"), "recalled": _auc(rows, "recalled")}}
    return {"benchmark": "detector", "tier": True, "model": model_id, "budget_ratio": budget_ratio,
            "scenarios_per_cell": scenarios, "calibration_per_cell": calibration,
            "default_attention_threshold": default, "default_text_threshold": text_default,
            "calibration": calib, "cells": cells}


def _auc(rows: list[dict], key: str) -> float | None:
    """:func:`~snapkv_sessions.bench.shift.auc` of ``key`` over the labelled turns: 0.5 is chance, 1.0 separates."""
    labelled = [r for r in rows if r["label"] in ("follow", "shift") and r[key] is not None]
    return auc([r[key] for r in labelled], [r["label"] == "shift" for r in labelled])


def _by_label(rows: list[dict]) -> dict:
    out = {}
    for label in ("follow", "shift"):
        vals = sorted(r["attention"] for r in rows if r["label"] == label and r["attention"] is not None)
        if vals:
            out[label] = {"min": vals[0], "median": vals[len(vals) // 2], "max": vals[-1]}
    return out


def table_tiered(result: dict) -> str:
    head = f"{'kind/shape':<18} {'signal':<26} {'precision':>9} {'recall':>7} {'tp':>4} {'fp':>4} {'fn':>4}"
    lines = [f"model {result['model']}, budget {result['budget_ratio']}, held-out seeds 0-"
             f"{result['scenarios_per_cell'] - 1}", head, "-" * len(head)]
    names = {"attention_at_default": f"attention > {result['default_attention_threshold']}",
             "attention_at_calibrated": f"attention > {result['calibration']['threshold']} (cal.)",
             "text_at_default": f"text > {result['default_text_threshold']}"}
    for name, cell in result["cells"].items():
        for label, shown in names.items():
            s = cell[label]
            if s is None:
                continue
            lines.append(f"{name:<18} {shown:<26} {s['precision']!s:>9} {s['recall']!s:>7} {s['tp']:>4} {s['fp']:>4} "
                         f"{s['fn']:>4}")
    lines.append(f"calibration (seeds 1000+): {result['calibration']}")
    lines.append("AUC, shift against follow-up (0.5: chance): " + ", ".join(
        f"{name} {cell['auc']['attention']}/{cell['auc']['recalled']}" for name, cell in result["cells"].items())
        + " (attention / recalled share)")
    return "\n".join(lines)
