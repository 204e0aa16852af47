"""``bench shift``: multi-turn sessions over long documents where later turns follow up, ask about other
records, or switch task. Compares (a) full cache, (b) per-turn SnapKV without recovery, (c) SnapKV with drift
re-prefill, (d) re-prefill every turn, (e) the tiered memory (evicted KV kept in the host tier, no re-prefill);
reports accuracy, re-prefills, degeneration, agreement with (d) turn by turn (the best any selection does at
the budget), and the detector's precision and recall on labelled follow-up versus shift turns.
"""

from __future__ import annotations

import copy
import hashlib
import random
import statistics
import time
from dataclasses import dataclass

import torch

from ..config import CompressionConfig
from ..generation import GenerationConfig
from ..policy import Policy
from ..session import Session
from ..store import SessionStore
from .variants import compressed_variants

FIRST = ["Alice", "Rahul", "Mei", "Jonas", "Fatima", "Pedro", "Olga", "Kwame", "Sofia", "Hiro", "Lena", "Omar",
         "Priya", "Tomas", "Aisha", "Bruno", "Chen", "Dana", "Emil", "Greta", "Ivan", "Jade", "Karl", "Lucia"]
LAST = ["Moreau", "Singh", "Tanaka", "Berg", "Haddad", "Silva", "Ivanova", "Mensah", "Rossi", "Sato", "Weber",
        "Farouk", "Nair", "Novak", "Bello", "Costa", "Wang", "Levi", "Dahl", "Kraus", "Petrov", "Park", "Horn", "Ruiz"]
DEPTS = ["Finance", "Research", "Logistics", "Legal"]
RULE = "RULE: whenever you give a phone extension, write it as EXT-<number>, for example EXT-1234."


@dataclass
class Turn:
    question: str
    expect: list[str]  # the reply is right if it contains any of these (case-insensitive)
    label: str  # "first", "follow" or "shift"
    kind: str = "lookup"  # lookup, summary, copy or rule: what the turn asks for


@dataclass
class Scenario:
    document: str
    turns: list[Turn]


def make_scenario(seed: int, records: int = 40) -> Scenario:
    rng = random.Random(seed)
    people = rng.sample([(f, la) for f in FIRST for la in LAST], records)
    rows = []
    for i, (first, last) in enumerate(people):
        rows.append({"id": f"EMP-{rng.randrange(1000, 9999)}", "name": f"{first} {last}", "dept": DEPTS[i % 4],
                     "office": f"{rng.choice('ABCD')}-{rng.randrange(100, 400)}", "ext": str(rng.randrange(2000, 8000)),
                     "year": str(rng.randrange(2005, 2024))})
    # "Name: field value, ..." lines: this small model looks records up far better in this form than in
    # pipe tables, CSV or JSON lines (measured: 6/8 lookups versus 3/8, 1/8 and 4/8 with the full cache).
    lines = [f"{r['name']}: office {r['office']}, department {r['dept']}, extension {r['ext']}, id {r['id']}, "
             f"since {r['year']}." for r in rows]
    document = "STAFF DIRECTORY\n" + RULE + "\n\n" + "\n".join(lines)
    a, b, c, d = rng.sample(rows, 4)
    dept = rng.choice(DEPTS)
    members = [r["name"].split()[0] for r in rows if r["dept"] == dept]  # a right summary names one of them
    line_c = lines[rows.index(c)]
    turns = [
        Turn(f"What is the office of {a['name']}?", [a["office"]], "first"),
        Turn(f"Which office did you say {a['name']} is in? Repeat it.", [a["office"]], "follow"),
        Turn(f"What is the office of {b['name']}?", [b["office"]], "shift"),
        Turn("And in which department does that person work?", [b["dept"]], "follow"),  # no name: a pronoun
        Turn(f"Summarise in one sentence who works in the {dept} department.", members, "shift", "summary"),
        Turn(f"Name one person who works in the {dept} department.", members, "follow"),
        Turn(f"Copy the directory line of the employee with id {c['id']} exactly, nothing else.", [line_c], "shift",
             "copy"),
        Turn(f"What extension does the employee with id {c['id']} have?", [c["ext"]], "follow"),
        Turn(f"What is the phone extension of {d['name']}? Follow the rule at the top.", [f"EXT-{d['ext']}"], "shift",
             "rule"),
        Turn(f"And the office of {d['name']}?", [d["office"]], "follow"),
    ]
    return Scenario(document, turns)


def first_turn(scenario: Scenario, kind: str) -> Turn:
    """The scenario's first turn of ``kind`` (lookup, summary, copy, rule)."""
    return next(t for t in scenario.turns if t.kind == kind)


def is_correct(reply: str, expect: list[str]) -> bool:
    text = " ".join(reply.split()).lower()
    return any(" ".join(e.split()).lower() in text for e in expect)


def is_degenerate(tokens: list[int], stop_reason: str) -> bool:
    """A phrase of 1-8 tokens repeated back to back until max_new_tokens, covering at least half the reply."""
    if stop_reason != "length" or len(tokens) < 12:
        return False
    tail = tokens[len(tokens) // 2 :]
    for n in range(1, 9):
        unit = tail[-n:]
        reps, i = 0, len(tail)
        while i >= n and tail[i - n : i] == unit:
            reps, i = reps + 1, i - n
        if reps * n >= len(tail) and reps >= 3:
            return True
    return False


def detect(scenario: Scenario, vectors, threshold: float, subjects: bool = True) -> list[bool]:
    """The session's text-side detector (embedding drift, new subject) over a scenario, without a model: the
    working set is reset after each detected shift, as a session does. One flag per turn ("first" is False)."""
    from ..drift import WorkingSet, key_terms, new_subject, refers_back, shift_score

    work = WorkingSet(vectors.shape[1])
    flags = []
    for turn, vector in zip(scenario.turns, vectors, strict=True):
        drift = work.drift(vector)
        fresh = subjects and drift is not None and new_subject(key_terms(turn.question), work.terms)
        follow = refers_back(turn.question)  # as a new session's policy states (drift.follow_ups)
        shift = drift is not None and shift_score(drift, fresh, False, follow_up=follow) > threshold
        if shift:
            work.reset()
        work.add(turn.question, vector)
        flags.append(shift)
    return flags


def calibrate_threshold(seeds: range, grid_step: float = 0.01, margin: float = 0.05) -> dict:
    """The drift threshold, chosen on scenarios disjoint from the evaluated ones (``seeds``).

    Sweeps thresholds, scores the detector's F1 on the labelled follow-up and shift turns, and returns the
    smallest threshold with the best F1 plus ``margin`` (kept inside the best-F1 range): a threshold sitting on
    the highest follow-up score of the calibration set would flip on the next paraphrase.
    """
    from ..drift import make_embedder

    emb = make_embedder("minilm")
    scenarios = [make_scenario(seed) for seed in seeds]
    vectors = [emb.embed([t.question for t in sc.turns]) for sc in scenarios]  # (turns, 384) each
    sweep = []
    for step in range(int(round(1 / grid_step)) + 1):
        threshold = round(step * grid_step, 4)
        tp = fp = fn = 0
        for sc, vec in zip(scenarios, vectors, strict=True):
            for turn, flag in zip(sc.turns, detect(sc, vec, threshold), strict=True):
                tp += flag and turn.label == "shift"
                fp += flag and turn.label == "follow"
                fn += not flag and turn.label == "shift"
        sweep.append((threshold, 2 * tp / (2 * tp + fp + fn) if tp else 0.0, tp, fp, fn))
    best = max(f1 for _, f1, *_ in sweep)
    lo = next(t for t, f1, *_ in sweep if f1 == best)
    hi = lo  # the end of the contiguous best-F1 run from lo
    for t, f1, *_ in sweep:
        if t > hi and f1 == best and round(t - hi, 4) <= grid_step:
            hi = t
    chosen = round(min(lo + margin, hi), 4)
    at = next(row for row in sweep if row[0] == lo)
    return {"seeds": [seeds.start, seeds.stop - 1], "scenarios": len(scenarios), "best_f1": round(best, 3),
            "best_range": [lo, hi], "threshold": chosen, "at_lowest_best": {"tp": at[2], "fp": at[3], "fn": at[4]}}


NO_TIER = {"cold": False}
CONDITIONS = {
    "a_full": {"compression": {"budget": 32768, "window": 32}, "drift": {"embedder": "none"}, "memory": NO_TIER},
    "b_snapkv": {"drift": {"embedder": "none"}, "memory": NO_TIER},
    "c_drift": {"drift": {"embedder": "minilm", "threshold": 0.6, "action": "reprefill"},  # threshold: run()
                "memory": NO_TIER},
    # every turn re-prefilled: a threshold of 0 and every question scored by its wording, follow-ups included
    "d_every_turn": {"drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill",
                               "follow_ups": False},
                     "recovery": {"min_turns_between": 0}, "memory": NO_TIER},
    # the tiered memory: evicted KV waits in the host tier; drift is still assessed (and recorded), but a shift
    # is served by the tier ("tiered") instead of a re-prefill
    "e_tiered": {"drift": {"embedder": "minilm", "threshold": 0.6, "action": "reprefill"},
                 "memory": {"cold": True, "on_shift": "tier"}},
    # the same, keeping each reply's decoded KV instead of feeding the reply again (memory.refeed_reply: false)
    "f_tiered_keep_reply": {"drift": {"embedder": "minilm", "threshold": 0.6, "action": "reprefill"},
                            "memory": {"cold": True, "on_shift": "tier", "refeed_reply": False}},
}


def condition_policy(name: str, ratio: float, window: int, threshold: float | None = None) -> Policy:
    base = {"name": name, "compression": {"budget_ratio": ratio, "window": window, "kernel": 7},
            "pins": {"roles": ["system"], "sink_tokens": 4}}
    spec = copy.deepcopy(CONDITIONS[name])
    if name in ("c_drift", "e_tiered", "f_tiered_keep_reply") and threshold is not None:
        spec["drift"]["threshold"] = threshold
    base["compression"].update(spec.pop("compression", {}))
    if "budget" in base["compression"]:
        base["compression"].pop("budget_ratio")
    base.update(spec)
    return Policy.from_dict(base)


SYSTEM = "You answer questions about the staff directory. Be short and exact."


def run_session(runner, scenario: Scenario, policy: Policy, max_new_tokens: int) -> list[dict]:
    store = SessionStore("sqlite://")  # in memory: the benchmark keeps nothing
    session = Session.create(runner, policy=policy, store=store, system=SYSTEM)
    session.add_document(scenario.document, name="directory")
    rows = []
    for turn in scenario.turns:
        t0 = time.perf_counter()
        reply = session.chat(turn.question, max_new_tokens=max_new_tokens)
        rec = store.turns(session.id)[-1]
        reprefill = next((p for k, p in reply.events if k == "reprefill"), None)
        drift = next((p for k, p in reply.events if k == "drift"), {})
        rows.append({
            "label": turn.label, "kind": turn.kind, "correct": is_correct(reply.text, turn.expect),
            "degenerate": is_degenerate(reply.token_ids, reply.stop_reason),
            "decision": rec["drift_decision"], "drift": rec["drift_score"],
            "embedding_drift": drift.get("embedding_drift"), "missing_terms": drift.get("missing_terms", []),
            "new_terms": drift.get("new_terms", []),
            "history_attention": reply.report.history_attention if reply.report else None,
            "reprefill_ms": reprefill["ms"] if reprefill else None,
            "turn_ms": (time.perf_counter() - t0) * 1e3, "context": reply.context_tokens, "reply": reply.text.strip(),
            "tokens": reply.token_ids, "tier": reply.report.tier if reply.report else None,
            # the turn's kept set, as a digest: two conditions that kept the same positions agree here
            "kept": hashlib.sha256(rec["kept_positions"] or b"").hexdigest()[:16],
        })
    return rows


def single_turn_budget(runner, scenarios: list[Scenario], ratios: list[float], window: int, max_new_tokens: int) -> dict:
    """Accuracy of single-turn lookups, full cache versus a fresh prefill compressed at each ratio."""
    tok = runner.tokenizer
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    hits = {"full": 0, **{str(r): 0 for r in ratios}}
    total = 0
    for sc in scenarios:
        for turn in [t for t in sc.turns if t.question.startswith("What is the office")]:
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Document directory:\n{sc.document}"},
                    {"role": "user", "content": turn.question}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            total += 1
            configs = [None if k == "full" else CompressionConfig.make(budget_ratio=float(k), window=window) for k in hits]
            for key, var in zip(hits, compressed_variants(runner, ids, window, configs), strict=True):
                out = list(runner.generate(var.state, var.logits, gen))
                hits[key] += is_correct(tok.decode(out, skip_special_tokens=True), turn.expect)
    acc = {k: round(v / total, 3) for k, v in hits.items()}
    matching = [r for r in ratios if acc[str(r)] >= acc["full"]]
    return {"lookups": total, "accuracy": acc, "chosen_ratio": min(matching) if matching else max(ratios)}


def summarise(rows: list[dict]) -> dict:
    scored = [r for r in rows if r["label"] != "first"]
    reprefills = [r for r in rows if r["decision"] == "reprefill"]
    return {
        "turns": len(rows),
        "accuracy": round(sum(r["correct"] for r in rows) / len(rows), 3),
        "accuracy_after_first": round(sum(r["correct"] for r in scored) / max(1, len(scored)), 3),
        "reprefills": len(reprefills),
        "reprefill_ms_median": round(statistics.median([r["reprefill_ms"] for r in reprefills]), 1) if reprefills else None,
        "degenerate_rate": round(sum(r["degenerate"] for r in rows) / len(rows), 3),
        "turn_ms_median": round(statistics.median(r["turn_ms"] for r in rows), 1),
        "by_kind": {kind: round(sum(r["correct"] for r in rows if r.get("kind") == kind)
                                / sum(r.get("kind") == kind for r in rows), 3)
                    for kind in sorted({r.get("kind") for r in rows if r.get("kind")})},
    }


def detector_quality(rows: list[dict]) -> dict:
    labelled = [r for r in rows if r["label"] in ("follow", "shift")]
    tp = sum(r["label"] == "shift" and r["decision"] == "reprefill" for r in labelled)
    fp = sum(r["label"] == "follow" and r["decision"] == "reprefill" for r in labelled)
    fn = sum(r["label"] == "shift" and r["decision"] != "reprefill" for r in labelled)
    caught = [r for r in labelled if r["label"] == "shift" and r["decision"] == "reprefill"]
    return {"labelled_turns": len(labelled), "tp": tp, "fp": fp, "fn": fn,
            "precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "recall": round(tp / (tp + fn), 3) if tp + fn else None,
            # which signal caught each detected shift (a turn can count under several)
            "caught_by": {"embedding": sum((r.get("embedding_drift") or 0) > r.get("threshold", 1e9) for r in caught),
                          "evidence": sum(bool(r.get("missing_terms")) for r in caught),
                          "new_subject": sum(bool(r.get("new_terms")) for r in caught)}}


def auc(scores: list[float], positives: list[bool]) -> float | None:
    """Probability that a random shift turn scores above a random follow-up turn (ties count half)."""
    pos = [s for s, p in zip(scores, positives, strict=True) if p]
    neg = [s for s, p in zip(scores, positives, strict=True) if not p]
    if not pos or not neg:
        return None
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return round(wins / (len(pos) * len(neg)), 3)


def second_signal(snapkv_rows: list[dict], drift_rows: list[dict]) -> dict:
    """Does the window's attention mass on the history (on the compressed cache of (b)) separate shift turns
    from follow-ups, and does it add anything to the detector of (c)?"""
    pairs = [(b, c) for b, c in zip(snapkv_rows, drift_rows, strict=True)
             if b["label"] in ("follow", "shift") and b["history_attention"] is not None]
    labels = [b["label"] == "shift" for b, _ in pairs]
    low_attention = [-b["history_attention"] for b, _ in pairs]  # less attention on history = more shift-like
    detector = [c["drift"] if c["drift"] is not None else 0.0 for _, c in pairs]
    best = None
    for cut in sorted({b["history_attention"] for b, _ in pairs}):
        combined = [c["decision"] == "reprefill" or b["history_attention"] <= cut for b, c in pairs]
        tp = sum(p and y for p, y in zip(combined, labels, strict=True))
        fp = sum(p and not y for p, y in zip(combined, labels, strict=True))
        fn = sum(y and not p for p, y in zip(combined, labels, strict=True))
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        if best is None or f1 > best["f1"]:
            best = {"cut": round(cut, 4), "f1": round(f1, 3), "tp": tp, "fp": fp, "fn": fn}
    tp = sum(c["decision"] == "reprefill" and y for (_, c), y in zip(pairs, labels, strict=True))
    fp = sum(c["decision"] == "reprefill" and not y for (_, c), y in zip(pairs, labels, strict=True))
    fn = sum(c["decision"] != "reprefill" and y for (_, c), y in zip(pairs, labels, strict=True))
    return {"turns": len(pairs), "auc_history_attention": auc(low_attention, labels),
            "auc_detector_score": auc(detector, labels),
            "detector_f1": round(2 * tp / (2 * tp + fp + fn), 3) if tp else 0.0,
            "best_combined_with_attention": best}


def run(model_name: str, sessions: int, ratios: list[float], window: int, max_new_tokens: int,
        ratio: float | None = None, threshold: float | None = None, calibration: int = 40, log=print) -> dict:
    from .. import runner as runner_mod
    from ..models import load_model

    model, tok = load_model(model_name)
    runner = runner_mod.ModelRunner(model, tok)
    torch.manual_seed(0)
    scenarios = [make_scenario(seed) for seed in range(sessions)]
    t0 = time.perf_counter()
    budget = single_turn_budget(runner, scenarios, ratios, window, max_new_tokens) if ratio is None else None
    chosen = ratio if ratio is not None else budget["chosen_ratio"]
    log(f"budget ratio {chosen} ({budget})")
    # the threshold comes from scenarios the evaluation never sees (seeds 1000+)
    calib = calibrate_threshold(range(1000, 1000 + calibration)) if threshold is None else None
    threshold = threshold if threshold is not None else calib["threshold"]
    log(f"drift threshold {threshold} ({calib})")
    per_condition: dict[str, list[dict]] = {name: [] for name in CONDITIONS}
    for i, sc in enumerate(scenarios):
        for name in CONDITIONS:
            rows = run_session(runner, sc, condition_policy(name, chosen, window, threshold), max_new_tokens)
            per_condition[name] += [{**r, "threshold": threshold} for r in rows] if name == "c_drift" else rows
            log(f"session {i} {name}: {summarise(per_condition[name])}")
    conditions = {name: summarise(rows) for name, rows in per_condition.items()}
    for name, rows in per_condition.items():  # the best any selection does at the budget: re-prefill every turn
        conditions[name]["agreement_with_every_turn"] = agreement(rows, per_condition["d_every_turn"])
        conditions[name]["kept_agreement_with_every_turn"] = agreement(rows, per_condition["d_every_turn"], "kept")
    return {
        "benchmark": "shift", "model": model_name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "sessions": sessions, "turns_per_session": len(scenarios[0].turns), "window": window,
        "max_new_tokens": max_new_tokens, "budget_ratio": chosen, "single_turn_budget_search": budget,
        "drift_threshold": threshold, "threshold_calibration": calib,
        "conditions": conditions,
        "detector": detector_quality(per_condition["c_drift"]),
        "second_signal": second_signal(per_condition["b_snapkv"], per_condition["c_drift"]),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "turns": {name: rows for name, rows in per_condition.items()},
    }


def agreement(rows: list[dict], reference: list[dict], key: str = "tokens") -> float:
    """Share of turns whose reply tokens (or kept sets, ``key="kept"``) equal the reference condition's on the
    same scenario and turn."""
    same = [a[key] == b[key] for a, b in zip(rows, reference, strict=True)]
    return round(sum(same) / len(same), 3)


def table(result: dict) -> str:
    head = (f"{'condition':<14} {'accuracy':>8} {'after t1':>8} {'re-prefills':>11} {'re-prefill ms':>13} "
            f"{'degenerate':>10} {'= every turn':>12} {'turn ms':>8}")
    lines = [head, "-" * len(head)]
    for name, c in result["conditions"].items():
        ms = "-" if c["reprefill_ms_median"] is None else f"{c['reprefill_ms_median']:.0f}"
        lines.append(f"{name:<14} {c['accuracy']:>8.3f} {c['accuracy_after_first']:>8.3f} {c['reprefills']:>11} "
                     f"{ms:>13} {c['degenerate_rate']:>10.3f} {c.get('agreement_with_every_turn', 0):>12.3f} "
                     f"{c.get('turn_ms_median', 0):>8.0f}")
    d = result["detector"]
    lines.append(f"detector (c): precision {d['precision']} recall {d['recall']} on {d['labelled_turns']} labelled turns")
    lines.append(f"detector (c) caught shifts by signal: {d['caught_by']}")
    lines.append(f"drift threshold {result['drift_threshold']}; calibration {result['threshold_calibration']}")
    lines.append(f"budget ratio {result['budget_ratio']}; single-turn search {result['single_turn_budget_search']}")
    lines.append(f"second signal (history attention): {result['second_signal']}")
    return "\n".join(lines)
