"""``bench shift``: multi-turn sessions over long documents where later turns follow up, ask about other
records, or switch task. Compares (a) full cache, (b) per-turn SnapKV without recovery, (c) SnapKV with drift
re-prefill, (d) re-prefill every turn; reports accuracy, re-prefills, degeneration, and the detector's
precision and recall on labelled follow-up versus shift turns.
"""

from __future__ import annotations

import copy
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
        Turn(f"And in which department does {b['name']} work?", [b["dept"]], "follow"),
        Turn(f"Summarise in one sentence who works in the {dept} department.", members, "shift"),
        Turn(f"Copy the directory line of the employee with id {c['id']} exactly, nothing else.", [line_c], "shift"),
        Turn(f"What is the phone extension of {d['name']}? Follow the rule at the top.", [f"EXT-{d['ext']}"], "shift"),
    ]
    return Scenario(document, turns)


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


CONDITIONS = {
    "a_full": {"compression": {"budget": 32768, "window": 32}, "drift": {"embedder": "none"}},
    "b_snapkv": {"drift": {"embedder": "none"}},
    "c_drift": {"drift": {"embedder": "minilm", "threshold": 0.6, "action": "reprefill"}},
    "d_every_turn": {"drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill"},
                     "recovery": {"min_turns_between": 0}},
}


def condition_policy(name: str, ratio: float, window: int) -> Policy:
    base = {"name": name, "compression": {"budget_ratio": ratio, "window": window, "kernel": 7},
            "pins": {"roles": ["system"], "sink_tokens": 4}}
    spec = copy.deepcopy(CONDITIONS[name])
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
        rows.append({
            "label": turn.label, "correct": is_correct(reply.text, turn.expect),
            "degenerate": is_degenerate(reply.token_ids, reply.stop_reason),
            "decision": rec["drift_decision"], "drift": rec["drift_score"],
            "history_attention": reply.report.history_attention if reply.report else None,
            "reprefill_ms": reprefill["ms"] if reprefill else None,
            "turn_ms": (time.perf_counter() - t0) * 1e3, "context": reply.context_tokens, "reply": reply.text.strip(),
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
            base = runner.new_state()
            logits, probe = runner.prefill(base, ids, window=window)
            total += 1
            for key in hits:
                state = copy.deepcopy(base)
                if key != "full":
                    cfg = CompressionConfig.make(budget_ratio=float(key), window=window)
                    runner.compress(state, cfg, probe)
                out = list(runner.generate(state, logits, gen))
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
    }


def detector_quality(rows: list[dict]) -> dict:
    labelled = [r for r in rows if r["label"] in ("follow", "shift")]
    tp = sum(r["label"] == "shift" and r["decision"] == "reprefill" for r in labelled)
    fp = sum(r["label"] == "follow" and r["decision"] == "reprefill" for r in labelled)
    fn = sum(r["label"] == "shift" and r["decision"] != "reprefill" for r in labelled)
    return {"labelled_turns": len(labelled), "tp": tp, "fp": fp, "fn": fn,
            "precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "recall": round(tp / (tp + fn), 3) if tp + fn else None}


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
        ratio: float | None = None, log=print) -> dict:
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
    per_condition: dict[str, list[dict]] = {name: [] for name in CONDITIONS}
    for i, sc in enumerate(scenarios):
        for name in CONDITIONS:
            per_condition[name] += run_session(runner, sc, condition_policy(name, chosen, window), max_new_tokens)
            log(f"session {i} {name}: {summarise(per_condition[name])}")
    return {
        "benchmark": "shift", "model": model_name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "sessions": sessions, "turns_per_session": len(scenarios[0].turns), "window": window,
        "max_new_tokens": max_new_tokens, "budget_ratio": chosen, "single_turn_budget_search": budget,
        "conditions": {name: summarise(rows) for name, rows in per_condition.items()},
        "detector": detector_quality(per_condition["c_drift"]),
        "second_signal": second_signal(per_condition["b_snapkv"], per_condition["c_drift"]),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "turns": {name: rows for name, rows in per_condition.items()},
    }


def table(result: dict) -> str:
    head = f"{'condition':<14} {'accuracy':>8} {'after t1':>8} {'re-prefills':>11} {'re-prefill ms':>13} {'degenerate':>10}"
    lines = [head, "-" * len(head)]
    for name, c in result["conditions"].items():
        ms = "-" if c["reprefill_ms_median"] is None else f"{c['reprefill_ms_median']:.0f}"
        lines.append(f"{name:<14} {c['accuracy']:>8.3f} {c['accuracy_after_first']:>8.3f} {c['reprefills']:>11} "
                     f"{ms:>13} {c['degenerate_rate']:>10.3f}")
    d = result["detector"]
    lines.append(f"detector (c): precision {d['precision']} recall {d['recall']} on {d['labelled_turns']} labelled turns")
    lines.append(f"budget ratio {result['budget_ratio']}; single-turn search {result['single_turn_budget_search']}")
    lines.append(f"second signal (history attention): {result['second_signal']}")
    return "\n".join(lines)
