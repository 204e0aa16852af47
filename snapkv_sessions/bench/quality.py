"""``bench quality`` and ``bench knee``: task accuracy under compression, per role split and per budget.

quality: single-turn document lookup, exact copy of a line, compliance with a format rule placed in each role
(system, developer, tool schema, user, document), and multi-turn task switching; compared across the full cache,
this project's session (pins + drift re-prefill), the session with the tiered memory, the session re-prefilling
every turn, StreamingLLM (sinks + recent window) and per-turn SnapKV without pins or recovery. Each method's
replies are also compared with re-prefill every turn's, item by item.

knee: see :mod:`snapkv_sessions.bench.knee` (B* by length, per task and selection).
"""

from __future__ import annotations

import json
import random
import time

import torch

from ..errors import ConfigError
from ..policy import Policy, PolicyError
from ..session import Session
from ..store import SessionStore
from .recall import split_recall
from .shift import SYSTEM, agreement, first_turn, is_correct, is_degenerate, make_scenario

# A format rule this model follows with the full cache wherever it is stated (measured on Qwen2.5-Coder-0.5B:
# 6/6 in the system prompt and in the user turn; "start with ANSWER:" and "answer in capitals" were ignored).
RULE = 'Always reply with JSON of the form {"answer": "..."}.'
COPY_PASS = 0.9  # a copy counts as right when it reproduces at least this share of the line's words, in order
ROLE_SPLITS = ("system", "developer", "tool_schema", "user", "document")
METHODS = ("full", "session", "tiered", "every", "streaming", "snapkv", "adakv", "tier-adakv", "tier-recall")
# tier-recall's second stage: each decode step also recalls 10% of the context from the tier, lowrank-ranked by
# attention mass (the best measured on bench recall; docs/tiered-memory.md)
RECALL = {"ratio": 0.1, "selector": "lowrank", "reduce": "mass"}
TIERED = ("tiered", "tier-adakv")  # the methods a recall suffix may go on


def method_policy(method: str, ratio: float, window: int) -> Policy:
    """The policy of a method, or of a tiered one with decode-time recall, ``tiered+rRATIO[:SPEC]`` (``SPEC`` a
    selector spec of ``bench recall``: ``tiered+r0.1:lowrank+mass+tail32+esc1``)."""
    base, recall = split_recall(method)
    if recall is not None and base not in TIERED:
        raise ValueError(f"{method[:80]!r}: recall '+rRATIO[:SPEC]' goes on a tiered method ({', '.join(TIERED)})")
    comp = {"budget_ratio": ratio, "window": window, "kernel": 7}
    no_pins = {"roles": [], "sink_tokens": 0, "keep_question": False}
    no_tier = {"cold": False}
    session = {"compression": comp, "pins": {"roles": ["system", "developer", "tool_schema"]},
               "drift": {"embedder": "minilm", "threshold": 0.75, "action": "reprefill"}}
    specs = {
        "full": {"compression": {"budget": 32768, "window": window}, "drift": {"embedder": "none"},
                 "memory": no_tier},
        "session": {**session, "memory": no_tier},
        "tiered": {**session, "memory": {"cold": True, "on_shift": "tier"}},  # the session with the tiered memory
        # the best any selection does at the budget: a fresh full prefill, compressed with each turn's window
        "every": {**session, "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill",
                                       "follow_ups": False},
                  "recovery": {"min_turns_between": 0}, "memory": no_tier},
        "streaming": {"compression": {**comp, "method": "streaming"}, "pins": no_pins, "drift": {"embedder": "none"},
                      "memory": no_tier},
        "snapkv": {"compression": comp, "pins": no_pins, "drift": {"embedder": "none"}, "memory": no_tier},
        # the same budgets shared among each layer's heads by Ada-KV (snapkv_sessions.allocate), alone and tiered
        "adakv": {"compression": {**comp, "allocator": "adakv"}, "pins": no_pins, "drift": {"embedder": "none"},
                  "memory": no_tier},
        "tier-adakv": {**session, "compression": {**comp, "allocator": "adakv"},
                         "memory": {"cold": True, "on_shift": "tier"}},
        # the tiered session whose decode also recalls from the tier (two-stage attention)
        "tier-recall": {**session, "memory": {"cold": True, "on_shift": "tier", "recall": RECALL}},
    }
    spec = specs[base]
    if recall is not None:
        spec = {**spec, "memory": {**spec["memory"], "recall": recall}}
    return Policy.from_dict({"name": method, **spec})


def check_method(method: str) -> None:
    """Raise ValueError naming what is wrong with a ``--methods`` entry."""
    try:
        if split_recall(method)[0] not in METHODS:
            raise ValueError(f"choose from {', '.join(METHODS)}, a tiered one with '+rRATIO[:SPEC]'")
        method_policy(method, 0.2, 16)
    except (ValueError, ConfigError, PolicyError) as exc:
        raise ValueError(f"{method[:80]!r}: {exc}") from None


def items(n: int, records: int = 40) -> list[dict]:
    """The quality items: (task, role split, setup messages, turns with expectations).

    Per seed: a lookup, a copy and a two-turn switch over the document, and the format rule stated in each
    role split (system, developer, tool schema, user, document), so every split is scored on every seed.
    """
    out = []
    for seed in range(n):
        sc = make_scenario(100 + seed, records=records)
        lookup, other, copy_turn = sc.turns[0], sc.turns[2], first_turn(sc, "copy")
        doc = {"role": "document", "content": sc.document, "name": "directory"}
        out.append({"task": "lookup", "split": "document", "setup": [doc], "turns": [(lookup.question, lookup.expect)]})
        out.append({"task": "copy", "split": "document", "setup": [doc], "turns": [(copy_turn.question, copy_turn.expect)]})
        out.append({"task": "switch", "split": "document", "setup": [doc],
                    "turns": [(lookup.question, lookup.expect), (other.question, other.expect)]})
        for role in ROLE_SPLITS:
            setup, question = [doc], lookup.question
            if role == "document":
                setup = [{**doc, "content": RULE + "\n" + sc.document}]
            elif role == "user":
                question = RULE + " " + question
            elif role == "tool_schema":
                setup = [{"role": "tool_schema", "content": json.dumps({"name": "reply", "description": RULE})}, doc]
            else:
                setup = [{"role": role, "content": RULE}, doc]
            out.append({"task": "rule", "split": role, "setup": setup, "turns": [(question, lookup.expect)]})
    return out


def rule_followed(reply: str) -> bool:
    """The reply is a JSON object with an "answer" key (code fences allowed)."""
    text = reply.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        return isinstance(json.loads(text), dict) and "answer" in json.loads(text)
    except json.JSONDecodeError:
        return False


def copy_score(reply: str, line: str) -> float:
    """Share of the line's words that the reply reproduces in order (longest common subsequence of words)."""
    want, got = line.lower().split(), reply.lower().split()
    if not want:
        return 0.0
    prev = [0] * (len(got) + 1)
    for w in want:
        row = [0]
        for j, g in enumerate(got):
            row.append(prev[j] + 1 if w == g else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1] / len(want)


def run_item(runner, item: dict, policy: Policy, max_new_tokens: int) -> dict:
    store = SessionStore("sqlite://")
    session = Session.create(runner, policy=policy, store=store, system=SYSTEM)
    for msg in item["setup"]:
        store.add_message(session.id, msg["role"], msg["content"], msg.get("name"))
    reply, reprefills, resident, cold = None, 0, 0, 0
    for question, _ in item["turns"]:
        reply = session.chat(question, max_new_tokens=max_new_tokens)
        reprefills += any(kind == "reprefill" for kind, _ in reply.events)  # the cache rebuilt from the store
        # what the session holds in KV memory between turns (hot), and in the host tier
        resident = max(resident, session.state.kv_bytes())
        cold = max(cold, session.state.cold.nbytes if session.state.cold is not None else 0)
    expect = item["turns"][-1][1]  # the last turn is the one scored
    score = None
    if item["task"] == "rule":
        ok = rule_followed(reply.text)
    elif item["task"] == "copy":
        score = round(copy_score(reply.text, expect[0]), 3)
        ok = score >= COPY_PASS
    else:
        ok = is_correct(reply.text, expect)
    return {"task": item["task"], "split": item["split"], "correct": ok, "copy_score": score,
            "degenerate": is_degenerate(reply.token_ids, reply.stop_reason), "reply": reply.text.strip()[:200],
            "tokens": list(reply.token_ids), "reprefills": reprefills, "kv_bytes": resident, "cold_bytes": cold}



def run_quality(runner, n: int, ratio: float, window: int, max_new_tokens: int, records: int = 40, log=print,
                methods: tuple[str, ...] = METHODS) -> dict:
    """Every item under each of ``methods`` (the full cache always among them: agreement is measured against it,
    and against re-prefill every turn when ``"every"`` runs)."""
    t0 = time.perf_counter()
    rows = {m: [] for m in ("full", *(m for m in methods if m != "full"))}
    for i, item in enumerate(items(n, records)):
        for method in rows:
            rows[method].append(run_item(runner, item, method_policy(method, ratio, window), max_new_tokens))
        log(f"item {i} {item['task']}/{item['split']}: " + " ".join(f"{m}={r[-1]['correct']}" for m, r in rows.items()))
    summary = {}
    for method, rs in rows.items():
        by = {}
        for key in sorted({(r["task"], r["split"]) for r in rs}):
            sel = [r for r in rs if (r["task"], r["split"]) == key]
            by[f"{key[0]}/{key[1]}"] = round(sum(r["correct"] for r in sel) / len(sel), 3)
        copies = [r["copy_score"] for r in rs if r["copy_score"] is not None]
        summary[method] = {"accuracy": round(sum(r["correct"] for r in rs) / len(rs), 3), "by_task_split": by,
                           "copy_score_mean": round(sum(copies) / len(copies), 3) if copies else None,
                           "degenerate_rate": round(sum(r["degenerate"] for r in rs) / len(rs), 3),
                           "reprefills": sum(r["reprefills"] for r in rs),
                           "agreement_with_every_turn": agreement(rs, rows["every"]) if "every" in rows else None,
                           "agreement_with_full": agreement(rs, rows["full"]), **_density(rs)}
    return {"benchmark": "quality", "budget_ratio": ratio, "window": window, "items": len(rows["full"]),
            "summary": summary, "minutes": round((time.perf_counter() - t0) / 60, 1), "rows": rows}


def _density(rows: list[dict]) -> dict:
    """KV memory per session (the most it held between turns, mean over items) and the sessions one GiB of KV
    memory holds at that size; the host tier's bytes beside it."""
    mean = sum(r["kv_bytes"] for r in rows) / len(rows)
    cold = sum(r["cold_bytes"] for r in rows) / len(rows)
    return {"kv_mib_per_session": round(mean / 2**20, 3), "sessions_per_gib": round(2**30 / mean, 1) if mean else None,
            "cold_mib_per_session": round(cold / 2**20, 3)}


def knee_item_ids(tok, document: str, question: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Document directory:\n{document}"},
            {"role": "user", "content": question}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def quality_plot(result: dict, path: str) -> None:
    """Grouped bars: accuracy per task/split (x) and method (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(result["summary"])
    keys = [*result["summary"][methods[0]]["by_task_split"], "all"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(10, 4.5), constrained_layout=True)
    for i, method in enumerate(methods):
        cell = result["summary"][method]
        values = [cell["by_task_split"].get(k, cell["accuracy"]) if k != "all" else cell["accuracy"] for k in keys]
        ax.bar([x + i * width for x in range(len(keys))], values, width, label=method)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], keys, rotation=30, ha="right")
    ax.set(ylabel="accuracy", ylim=(0, 1.05),
           title=f"bench quality, budget {result['budget_ratio']:.0%} ({result['items']} items)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def quality_table(result: dict) -> str:
    methods = list(result["summary"])
    keys = list(result["summary"]["full"]["by_task_split"])
    lines = [f"{'task/split':<22}" + "".join(f"{m:>11}" for m in methods)]
    for key in keys:
        lines.append(f"{key:<22}" + "".join(f"{result['summary'][m]['by_task_split'][key]:>11.2f}" for m in methods))
    lines.append(f"{'all':<22}" + "".join(f"{result['summary'][m]['accuracy']:>11.2f}" for m in methods))
    lines.append(f"{'= every turn':<22}" + "".join(
        f"{result['summary'][m].get('agreement_with_every_turn') or 0:>11.2f}" for m in methods))
    lines.append(f"{'re-prefills':<22}" + "".join(f"{result['summary'][m].get('reprefills', 0):>11}" for m in methods))
    for key, label in (("agreement_with_full", "= full cache"), ("kv_mib_per_session", "KV MiB/session"),
                       ("sessions_per_gib", "sessions/GiB KV")):
        lines.append(f"{label:<22}" + "".join(f"{result['summary'][m].get(key)!s:>11}" for m in methods))
    return "\n".join(lines)


def load_runner(model_name: str, dtype: str = "float32"):
    from ..models import load_model
    from ..runner import ModelRunner

    model, tok = load_model(model_name, dtype=getattr(torch, dtype))
    torch.manual_seed(0)
    random.seed(0)
    return ModelRunner(model, tok)
