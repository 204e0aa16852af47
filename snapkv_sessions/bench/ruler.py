"""``bench ruler``: RULER's tasks (generated offline, :mod:`.ruler_data`) under compression, in three settings.

- **query-aware**: the whole prompt (context, question, answer prefix) prefilled, compressed with its last
  ``window`` tokens as the observation window (which holds the question), then decoded;
- **query-agnostic**: the context alone prefilled and compressed (the window is the end of the context), then
  the question and the answer prefix prefilled onto the compressed cache, then decoded (kvpress's setting);
- **multi-turn**: through :class:`~snapkv_sessions.Session`: the context as the first user turn, then the
  item's question and, for the needle tasks, up to two more questions on needles of the same haystack in later
  turns, untiered (``multi-turn/untiered``: what turn 1 evicted is gone) and tiered (``multi-turn/tiered``:
  the host tier recalls it). A session has no assistant prefill, so these turns carry no answer prefix.

In the first two settings an item's context is prefilled once for both (:class:`~.variants.Prefix`), the rest
once per setting, and every (method, budget) compresses a copy (:func:`~.variants.compressed_variants`); a
session re-prefills per (method, budget). Every finished
(item, setting, method, budget) appends one JSON line to the results file (the reply, RULER's score, timings);
a rerun skips what the file holds, so a grid accumulates across runs. The knee per (task, length, setting,
method) is :func:`.knee.knee_cell`'s: B*, the smallest budget within 2 points of the full cache, with a
bootstrap 90% interval over the items, and the reply agreement with the full cache.
"""

from __future__ import annotations

import json
import os
import time

from ..config import CompressionConfig, RecallConfig
from ..errors import ConfigError
from ..generation import GenerationConfig
from .knee import knee_cell
from .recall import split_recall
from .ruler_data import Item, encode, generate, metric, render, score, task_table
from .variants import Prefix, compressed_variants

TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "qa_1")
SETTINGS = ("query-aware", "query-agnostic", "multi-turn")
METHODS = ("full", "snapkv", "lines", "sentences", "pyramid", "adakv", "streaming")
FIRST_TURN_TOKENS = 8  # the reply to the context turn of the multi-turn setting (not scored)


def method_fields(method: str) -> dict:
    """The compression fields of each method, besides budget and window (a recall suffix left aside)."""
    return {"snapkv": {}, "lines": {"span_aware": True, "span_unit": "line"},
            "sentences": {"span_aware": True, "span_unit": "sentence"}, "pyramid": {"strategy": "pyramid"},
            "adakv": {"allocator": "adakv"}, "streaming": {"method": "streaming"}}[split_recall(method)[0]]


def check_method(method: str) -> None:
    """Raise ValueError naming what is wrong with a ``--methods`` entry."""
    try:
        base, recall = split_recall(method)
        if base not in METHODS or (recall is not None and base == "full"):
            raise ValueError(f"the method is one of {list(METHODS)}, with recall '+rRATIO[:SELECTOR]' (not on full)")
        if recall is not None:
            RecallConfig.make(**recall)
    except (ValueError, ConfigError) as exc:
        raise ValueError(f"{method[:80]!r}: {exc}") from None


def variant(method: str, budget: float | None) -> str:
    return "full" if method == "full" else f"{method}@{budget}"


def sub_settings(settings: list[str]) -> list[str]:
    out = []
    for s in settings:
        out += ["multi-turn/untiered", "multi-turn/tiered"] if s == "multi-turn" else [s]
    return out


def prompt_ids(tok, item: Item) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of the rendered prompt: the chat template's text up to the end of the context,
    and the rest (question, end of the user turn, assistant tag, answer prefix). Both settings feed the same
    tokens, so they differ only in when compression happens."""
    text = render(tok, item.user, item.answer_prefix)
    cut = text.index(item.user) + len(item.context)
    return encode(tok, text[:cut]), encode(tok, text[cut:])


def load_rows(path: str | None) -> list[dict]:
    """The results file's rows (a last line cut short by a kill is dropped)."""
    if not path or not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def row_key(r: dict) -> tuple:
    """A row's identity: a rerun with another model, dtype or window computes its own rows."""
    return (r["model"], r["dtype"], r["window"], r["task"], r["length"], r["item"], r["setting"], r["variant"])


class Results:
    """The JSONL file: rows already there, and one line appended (and flushed) per finished row. ``key``: a row's
    identity (``bench ruler``'s :func:`row_key` unless told)."""

    def __init__(self, path: str | None, key=row_key):
        self.path, self.rows, self.key = path, load_rows(path), key
        self.keys = {key(r): r for r in self.rows}
        self.computed = 0
        if path and self.rows:
            with open(path, "rb+") as fh:  # a line cut short by a kill: end the file with a newline
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.keys[self.key(row)] = row
        self.computed += 1
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def run(runner, model: str, tasks: list[str], lengths: list[int], n: int, budgets: list[float], settings: list[str],
        methods: list[str], window: int = 32, max_new_tokens: int | None = None, results: str | None = None,
        dtype: str = "bfloat16", log=print) -> dict:
    tok = runner.tokenizer
    table = task_table()
    for t in tasks:
        if t not in table:
            raise ValueError(f"task={t!r}: not a RULER task (one of {sorted(table)})")
    methods = ["full", *[m for m in methods if m != "full"]]  # the full cache first: agreement is measured on it
    wanted = [variant(m, b) for m in methods for b in ([None] if m == "full" else budgets)]
    store = Results(results)
    reused = 0
    t0 = time.perf_counter()
    for task in tasks:
        mnt = max_new_tokens or table[task]["tokens_to_generate"]
        for length in lengths:
            items = generate(task, tok, length, n)
            for item in items:
                singles = {}
                for setting in sub_settings(settings):
                    base = {"model": model, "dtype": dtype, "window": window, "task": task, "length": length,
                            "item": item.index, "setting": setting}
                    here = [v for v in wanted if setting != "multi-turn/untiered" or not _recall_config(v)]
                    missing = [v for v in here if row_key({**base, "variant": v}) not in store.keys]
                    reused += len(here) - len(missing)
                    if not missing:
                        continue
                    cell = {"base": base, "item": item, "mnt": mnt, "window": window, "store": store}
                    if setting.startswith("multi-turn"):
                        _multi_turn(runner, cell, missing)
                    else:
                        singles[setting] = (cell, missing)
                if singles:
                    _singles(runner, item, window, singles)
                log(f"{task} @ {length} item {item.index}: {store.computed} rows computed "
                    f"({(time.perf_counter() - t0) / 60:.1f} min)")
    return {"benchmark": "ruler", "model": model, "dtype": dtype, "tasks": tasks, "lengths": lengths,
            "budgets": budgets, "settings": sub_settings(settings), "methods": methods, "items_per_cell": n,
            "window": window, "results": results, "computed": store.computed, "reused": reused,
            "cells": summarise([r for r in store.rows if (r["dtype"], r["window"]) == (dtype, window)], model, tasks,
                               lengths, budgets, sub_settings(settings), methods),
            "minutes": round((time.perf_counter() - t0) / 60, 1)}


def _config(name: str, window: int) -> CompressionConfig | None:
    if name == "full":
        return None
    method, budget = name.split("@")
    return CompressionConfig.make(budget_ratio=float(budget), window=window, **method_fields(method))


def _row(cell: dict, name: str, reply: list[int], text: str, refs: list[str], sc: float, prompt: int, **extra) -> dict:
    base, item, store = cell["base"], cell["item"], cell["store"]
    full = store.keys.get(row_key({**base, "variant": "full"}))
    method, _, budget = name.partition("@")
    return {**base, "variant": name, "method": method, "budget": float(budget) if budget else None,
            "metric": metric(base["task"]), "score": sc,
            "reply": text, "tokens": reply, "references": refs,
            "same_as_full": name == "full" or (full is not None and full["tokens"] == reply),
            "prompt_tokens": prompt, "ruler_length": item.ruler_length, **extra}


def _singles(runner, item: Item, window: int, cells: dict[str, tuple[dict, list[str]]]) -> None:
    """query-aware and query-agnostic: the context up to its last ``window`` tokens prefilled once for both, then
    per setting the rest prefilled onto a copy with the window observed, and a compressed copy per (method, budget).

    The agnostic window is the end of the context; the aware one the end of the prompt (question and answer
    prefix), so both settings observe ``window`` tokens of the same cache and differ only in when compression
    happens."""
    tok = runner.tokenizer
    ctx, question = prompt_ids(tok, item)
    cut = max(len(ctx) - window, 0)
    recalling = {n: _recall_config(n) for settings_names in cells.values() for n in settings_names[1]}
    prefixes = {tiered: Prefix.of(runner, ctx[:cut], tiered=tiered)  # a tiered copy only for recall variants
                for tiered in {rc is not None for rc in recalling.values()}}
    for setting, (cell, all_names) in cells.items():
        agnostic = setting == "query-agnostic"
        gen = GenerationConfig(max_new_tokens=cell["mnt"])
        rest = ctx[cut:] if agnostic else ctx[cut:] + question
        for tiered, prefix in prefixes.items():
            names = [n for n in all_names if (recalling[n] is not None) == tiered]
            configs = [_config(n, window) for n in names]
            for name, var in zip(names, compressed_variants(runner, rest, window, configs, prefix), strict=True):
                if tiered:
                    var.state.cache.recall_config = recalling[name]  # what each decode step recalls
                logits, q_ms = var.logits, 0.0
                if agnostic:  # the question arrives after compression, onto the hot cache (as SnapKV alone)
                    t = time.perf_counter()
                    logits, _ = runner.prefill(var.state, question)
                    q_ms = (time.perf_counter() - t) * 1e3
                var.state.cache.prefill_done(var.state)  # the decode's recall starts here
                t = time.perf_counter()
                out = list(runner.generate(var.state, logits, gen))
                decode_ms = (time.perf_counter() - t) * 1e3
                figures = var.state.cache.decode_done(var.state) if tiered else None
                text = tok.decode(out, skip_special_tokens=True)
                rep = var.report
                cell["store"].add(_row(cell, name, out, text, item.outputs, score(item.task, text, item.outputs),
                                       len(ctx) + len(question), prefill_ms=round(var.prefill_ms, 1),
                                       question_prefill_ms=round(q_ms, 1), decode_ms=round(decode_ms, 1),
                                       compress_ms=round(rep.select_ms + rep.gather_ms, 1) if rep else 0.0,
                                       kept=round(sum(rep.tokens_after) / len(rep.tokens_after)) if rep else None,
                                       recall=figures))


def _variant_recall(name: str) -> dict | None:
    """A variant's (``METHOD[+rRATIO[:SPEC]]@BUDGET``) ``memory.recall`` keys, None without recall."""
    return split_recall(name.split("@")[0])[1]


def _recall_config(name: str) -> RecallConfig | None:
    recall = _variant_recall(name)
    return None if recall is None else RecallConfig.make(**recall)


def session_policy(name: str, window: int, tiered: bool):
    from ..policy import Policy

    memory = {"cold": True, "on_shift": "tier"} if tiered else {"cold": False}
    if tiered and name != "full":
        memory["recall"] = _variant_recall(name)  # None: no recall
    if name == "full":
        return Policy.from_dict({"name": "full", "compression": {"budget": 32768, "window": window},
                                 "drift": {"embedder": "none"}, "memory": {"cold": False}})
    method, budget = name.split("@")
    comp = {"budget_ratio": float(budget), "window": window, **method_fields(method)}
    return Policy.from_dict({"name": name, "compression": comp, "drift": {"embedder": "none"}, "memory": memory,
                             "pins": {"roles": [], "sink_tokens": 0, "keep_question": False}})


def _multi_turn(runner, cell: dict, names: list[str]) -> None:
    """The context as the first turn, then the questions in later turns, one session per (method, budget)."""
    from ..session import Session
    from ..store import SessionStore

    item, tiered = cell["item"], cell["base"]["setting"].endswith("/tiered")
    questions = [(item.question, item.outputs), *item.extra]
    for name in names:
        session = Session.create(runner, policy=session_policy(name, cell["window"], tiered),
                                 store=SessionStore("sqlite://"))
        t = time.perf_counter()
        session.chat(item.context, max_new_tokens=FIRST_TURN_TOKENS)
        first_ms = (time.perf_counter() - t) * 1e3
        replies, tokens, scores, turn_ms = [], [], [], []
        for q, refs in questions:
            t = time.perf_counter()
            reply = session.chat(q.strip(), max_new_tokens=cell["mnt"])
            turn_ms.append(round((time.perf_counter() - t) * 1e3, 1))
            replies.append(reply.text)
            tokens += list(reply.token_ids)
            scores.append(score(item.task, reply.text, refs))
        cell["store"].add(_row(cell, name, tokens, " || ".join(replies), item.outputs, sum(scores) / len(scores),
                               session.state.next_position, turn_scores=scores, first_turn_ms=round(first_ms, 1),
                               turn_ms=turn_ms, questions=len(questions)))


def summarise(rows: list[dict], model: str, tasks: list[str], lengths: list[int], budgets: list[float],
              settings: list[str], methods: list[str], resamples: int = 1000) -> dict:
    """Per (task, length, setting, method): :func:`.knee.knee_cell` over the items that have every budget."""
    by: dict[tuple, dict] = {}
    for r in rows:
        if r["model"] == model:
            by[(r["task"], r["length"], r["setting"], r["item"], r["variant"])] = {
                "correct": r["score"] / 100, "same_as_full": r["variant"] == "full" or r["same_as_full"]}
    cells = {}
    for task in tasks:
        for length in lengths:
            for setting in settings:
                sel = {(k[3], k[4]): v for k, v in by.items() if k[:3] == (task, length, setting)}
                for method in methods:
                    if method == "full":
                        continue
                    names = ["full", *[variant(method, b) for b in budgets]]
                    items = sorted({i for i, _ in sel if all((i, n) in sel for n in names)})
                    if items:
                        c = knee_cell(sel, items, method, budgets, resamples)
                        cells[f"{task}@{length}/{setting}/{method}"] = {**c, "items": len(items)}
    return cells


def table(result: dict) -> str:
    budgets = result["budgets"]
    head = (f"{'task@length/setting/method':<46} {'n':>3} {'full':>5} " + " ".join(f"{b:>5}" for b in budgets)
            + f" {'B*':>5} {'90% CI':>11}  agreement with full")
    lines = [head, "-" * len(head)]
    for name, c in result["cells"].items():
        ci = "-" if c["b_star_90ci"] == [None, None] else f"{c['b_star_90ci'][0]}..{c['b_star_90ci'][1]}"
        lines.append(f"{name:<46} {c['items']:>3} {100 * c['full']:>5.1f} "
                     + " ".join(f"{100 * c['accuracy'][str(b)]:>5.1f}" for b in budgets)
                     + f" {c['b_star']!s:>5} {ci:>11}  " + " ".join(f"{c['agreement_with_full'][str(b)]:.2f}"
                                                                   for b in budgets))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """B* against length, one panel per setting, a line per task and method (no B*: drawn above the budgets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = result["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 4), constrained_layout=True,
                             squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for task in result["tasks"]:
            for method in result["methods"][1:]:
                ys = [result["cells"].get(f"{task}@{n}/{setting}/{method}", {}).get("b_star", 2.0)
                      for n in result["lengths"]]
                ax.plot(result["lengths"], [1.05 if y is None or y > 1 else y for y in ys], marker="o",
                        label=f"{task} {method}")
        ax.set(xlabel="context tokens", ylabel="B* (budget ratio)", ylim=(0, 1.1), title=setting)
        if len(result["lengths"]) > 1:
            ax.set_xscale("log")
    axes[0][0].legend(fontsize=6)
    fig.savefig(path, dpi=100)
    plt.close(fig)
