"""``bench recall``: decode-time recall from the tier against the full cache, turn by turn, and what it costs.

Quality: the scripted multi-turn sessions of ``bench shift`` (a staff directory, ten turns of lookups, follow-ups
and task switches) run under the full cache and, tiered, under each hot budget alone and with each recall budget
and selector. Every turn's reply is compared with the full cache's; accuracy is bench shift's. Device-resident
bytes are the hot cache plus the selector's summary, against the whole context's KV (hot plus cold). One JSON
line per (scenario, condition) is appended to the results file; a rerun skips what the file holds.

Cost: at each length, one prefill of a document; then, from copies of that state, the full cache, the hot cache
alone and the hot cache with each recall each decode the same tokens; the time per output token (TPOT) and the
bytes each step reads are measured side by side in one run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import BUILTIN_SELECTORS, CompressionConfig, RecallConfig
from ..policy import Policy
from ..recall import SELECTORS as REGISTRY
from ..recall import Exact, LowRank, page_slots, register_selector
from ..session import Session
from ..store import SessionStore
from .shift import SYSTEM, make_scenario, run_session

SELECTORS = BUILTIN_SELECTORS


# a spec's "+word" -> its recall keys; "+tailN" is "+tail" with pages of N slots
OPTIONS = {"mass": {"reduce": "mass"}, "layer": {"share": "layer"}, "tail": {"tail": "pages"}}


def recall_spec(spec: str) -> dict:
    """A selector spec of the grid, ``NAME[+mass][+layer][+tail[N]][+escM]`` (``exact``, ``lowrank+mass``,
    ``exact+mass+layer``, ``lowrank+mass+tail16``, ``lowrank+mass+esc1.0``: steps whose two best logits are
    within M are taken again over the whole history) -> its ``memory.recall`` keys (not counting the budget).
    Unknown words raise ValueError naming them."""
    name, *words = spec.split("+")
    out: dict = {"selector": name}
    for word in words:
        if word.startswith("tail") and word[4:].isdigit():
            out.update(tail="pages", tail_page=int(word[4:]))
        elif word.startswith("esc") and _number(word[3:]):
            out.update(escalate=float(word[3:]))
        elif word in OPTIONS:
            out.update(OPTIONS[word])
        else:
            raise ValueError(f"unknown option {word!r} (known: {sorted(OPTIONS)}, tailN, escM)")
    return out


def split_recall(method: str) -> tuple[str, dict | None]:
    """A method with decode-time recall, ``METHOD+rRATIO[:SPEC]`` (``snapkv+r0.1:exact+mass``: the hot set chosen
    by snapkv, each decode step also recalling 10% of the context from the tier, the slots ranked by SPEC, a
    selector spec of ``bench recall``), into the method and its ``memory.recall`` keys (None: no recall)."""
    base, sep, rest = method.partition("+r")
    if not sep:
        return method, None
    ratio, _, spec = rest.partition(":")
    return base, {"ratio": float(ratio), **recall_spec(spec or "exact")}


def _number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def conditions(hots: list[float], recalls: list[float], selectors: tuple[str, ...] = SELECTORS) -> dict[str, dict]:
    """Condition name -> policy spec: the full cache, then per hot ratio the tier alone and with each recall (a
    selector spec's options after the ratio: ``hot0.2+exact0.1+mass``)."""
    out = {"full": {"compression": {"budget": 1 << 20, "window": 32}, "memory": {"cold": False}}}
    for hot in hots:
        out[f"hot{hot}"] = {"compression": {"budget_ratio": hot, "window": 32}, "memory": {"cold": True}}
        for ratio in recalls:
            for spec in selectors:
                sel, *words = spec.split("+")
                name = f"hot{hot}+{sel}{ratio}" + "".join(f"+{w}" for w in words)
                out[name] = {"compression": {"budget_ratio": hot, "window": 32},
                             "memory": {"cold": True, "recall": {"ratio": ratio, **recall_spec(spec)}}}
    return out


def policy_for(name: str, spec: dict) -> Policy:
    return Policy.from_dict({"name": name, "pins": {"roles": ["system"], "sink_tokens": 4},
                             "drift": {"embedder": "none"}, **spec})


def _done(path: Path | None) -> dict[tuple[int, str], dict]:
    if path is None or not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["seed"], row["condition"])] = row
    return rows


def run_quality(runner, seeds: list[int], hots: list[float], recalls: list[float], max_new_tokens: int,
                results: str | None = None, records: int = 40, selectors: tuple[str, ...] = SELECTORS,
                log=print) -> dict:
    """Run (or resume) the grid; returns the summary over every row the results file holds for these seeds."""
    path = Path(results) if results else None
    done = _done(path)
    conds = conditions(hots, recalls, selectors)
    t0 = time.perf_counter()
    for seed in seeds:
        scenario = make_scenario(seed, records=records)
        for name, spec in conds.items():
            if (seed, name) in done:
                continue
            t1 = time.perf_counter()
            turns = run_session(runner, scenario, policy_for(name, spec), max_new_tokens)
            row = {"seed": seed, "condition": name, "minutes": round((time.perf_counter() - t1) / 60, 2),
                   "turns": [_turn(t) for t in turns]}
            done[(seed, name)] = row
            if path is not None:
                with path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
            log(f"seed {seed} {name}: {sum(t['correct'] for t in row['turns'])}/{len(turns)} right "
                f"({row['minutes']} min, {(time.perf_counter() - t0) / 60:.1f} min in all)")
    return summarise([done[(s, n)] for s in seeds for n in conds if (s, n) in done], list(conds))


def _turn(t: dict) -> dict:
    tier = t.get("tier") or {}
    recall = tier.get("recall") or {}
    out = {"correct": t["correct"], "tokens": t["tokens"], "context": t["context"],
           "hot_bytes": tier.get("hot_bytes"), "cold_bytes": tier.get("cold_bytes"),
           "summary_bytes": recall.get("summary_bytes", 0), "recalled_per_step": recall.get("recalled_per_step"),
           "repeat_rate": recall.get("repeat_rate"), "read_per_step": recall.get("read_bytes_per_step")}
    if "escalated" in recall:  # only rows of escalating conditions carry it
        out.update(steps=recall["steps"], escalated=recall["escalated"], refed=recall.get("refed"))
    return out


def summarise(rows: list[dict], names: list[str]) -> dict:
    """Per condition: turns, accuracy, the share of turns whose reply equals the full cache's (same seed and
    turn), device-resident bytes against the whole context's, recalled slots per step and their repeat rate."""
    full = {r["seed"]: r["turns"] for r in rows if r["condition"] == "full"}
    out = {}
    for name in names:
        mine = [r for r in rows if r["condition"] == name]
        turns = [t for r in mine for t in r["turns"]]
        if not turns:
            continue
        same = [t["tokens"] == full[r["seed"]][i]["tokens"] for r in mine if r["seed"] in full
                for i, t in enumerate(r["turns"])]
        shares = [(t["hot_bytes"] + t["summary_bytes"]) / (t["hot_bytes"] + t["cold_bytes"])
                  for t in turns if t["hot_bytes"] and t["cold_bytes"] is not None]
        recalled = [t["recalled_per_step"] for t in turns if t["recalled_per_step"] is not None]
        repeats = [t["repeat_rate"] for t in turns if t["repeat_rate"] is not None]
        steps = sum(t.get("steps", 0) for t in turns)
        escalated = {"escalated_share": round(sum(t["escalated"] for t in turns) / steps, 3)} if any(
            "escalated" in t for t in turns) and steps else {}
        out[name] = {**escalated, "sessions": len(mine), "turns": len(turns),
                     "accuracy": round(sum(t["correct"] for t in turns) / len(turns), 3),
                     "equal_to_full": round(sum(same) / len(same), 3) if same else None,
                     "device_bytes_share": round(statistics.mean(shares), 3) if shares else 1.0,
                     "recalled_per_step": round(statistics.mean(recalled), 1) if recalled else None,
                     "repeat_rate": round(statistics.mean(repeats), 3) if repeats else None}
    return out


def quality_table(summary: dict) -> str:
    head = f"{'condition':<28} {'turns':>5} {'acc':>6} {'=full':>6} {'device':>7} {'recall/step':>11} {'repeat':>7}"
    lines = [head, "-" * len(head)]
    for name, c in summary.items():
        lines.append(f"{name:<28} {c['turns']:>5} {c['accuracy']:>6.2f} {c['equal_to_full'] or 0:>6.2f} "
                     f"{c['device_bytes_share']:>7.2f} {c['recalled_per_step'] or 0:>11} {c['repeat_rate'] or 0:>7}")
    return "\n".join(lines)


@torch.inference_mode()
def run_cost(runner, lengths: list[int], hot: float, recall: float, steps: int, log=print,
             selectors: tuple[str, ...] = SELECTORS, rounds: int = 1) -> dict:
    """TPOT of the full cache, the hot cache alone and hot + recall (each selector) at each length, side by
    side from one prefill per length; and the bytes one step reads.

    Each round decodes ``steps`` tokens under every condition from a fresh copy of the prefill (a turn's setup,
    such as a selector's summary, counted every time), the order turned by one condition a round so no condition
    always runs first; a cell's TPOT is the median over rounds (each round's kept in ``tpot_rounds_ms``)."""
    from ..transcript import observation_window

    tok = runner.tokenizer
    out = {}
    specs = conditions([hot], [recall], selectors)
    names = list(specs)
    for length in lengths:
        scenario = make_scenario(7, records=max(8, length // 40))
        text = f"{SYSTEM}\n{scenario.document}\n{scenario.turns[0].question}"
        ids = tok(text)["input_ids"][:length]
        base = runner.new_state(tiered=True)
        window = observation_window(32, len(ids), len(ids))
        t0 = time.perf_counter()
        logits, probe = runner.prefill(base, ids, window=window)
        prefill_s = time.perf_counter() - t0
        timed: dict[str, list[float]] = {name: [] for name in names}
        cells = {}
        for turn in range(rounds):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                spec = specs[name]
                rc = None if "recall" not in spec["memory"] else RecallConfig.make(**spec["memory"]["recall"])
                state = base.clone()
                if name != "full":
                    runner.compress(state, CompressionConfig.make(budget_ratio=hot, window=32), probe)
                state.cache.recall_config = rc
                state.cache.prefill_done(state)
                state.cache.reserve(steps)
                token = int(logits.argmax())
                t1 = time.perf_counter()
                for _ in range(steps):
                    token = int(runner.step(state, token).argmax())
                timed[name].append((time.perf_counter() - t1) / steps * 1e3)
                figures = state.cache.decode_done(state) or {}
                read = figures.get("read_bytes_per_step") or {"hot": state.kv_bytes(), "select": 0, "recalled": 0}
                cells[name] = {"hot_bytes": state.kv_bytes(), "read_bytes_per_step": read,
                               "summary_bytes": figures.get("summary_bytes", 0)}
                log(f"length {length} round {turn + 1}/{rounds} {name}: {timed[name][-1]:.1f} ms/token")
        for name, cell in cells.items():
            cell["tpot_ms"] = round(statistics.median(timed[name]), 2)
            cell["tpot_rounds_ms"] = [round(t, 2) for t in timed[name]]
        full_read = cells["full"]["read_bytes_per_step"]["hot"]
        for cell in cells.values():
            cell["read_vs_full"] = round(sum(cell["read_bytes_per_step"].values()) / full_read, 3)
            cell["tpot_vs_full"] = round(cell["tpot_ms"] / cells["full"]["tpot_ms"], 3)
        out[str(length)] = {"tokens": len(ids), "prefill_s": round(prefill_s, 1), "rounds": rounds,
                            "cells": {name: cells[name] for name in names}}
    return out


def cost_table(cost: dict) -> str:
    lines = [f"{'length':>6} {'condition':<22} {'TPOT ms':>8} {'x full':>7} {'read x full':>11}"]
    for length, res in cost.items():
        for name, c in res["cells"].items():
            lines.append(f"{length:>6} {name:<22} {c['tpot_ms']:>8} {c['tpot_vs_full']:>7} {c['read_vs_full']:>11}")
    return "\n".join(lines)


# ------------------------------------------------------------------ how well each selector ranks


@dataclass
class _Capture:
    """Chooses as ``exact`` does and keeps every ``every``-th step's inputs (query and the cold layer it scored)."""

    layers: int
    every: int = 3
    seen: list = field(default_factory=list)
    calls: int = 0

    def choose(self, query, keys, real, k, positions):
        if (self.calls // self.layers) % self.every == 0:
            self.seen.append((query.float(), keys, real, positions, k))
        self.calls += 1
        return Exact().choose(query, keys, real, k, positions)

    def summary_bytes(self, keys: torch.Tensor) -> int:
        return Exact().summary_bytes(keys)

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        return Exact().read_bytes(keys, k)


def _mass(p: torch.Tensor, idx: torch.Tensor, attend: torch.Tensor) -> float:
    """The share of the cold attention mass ``p`` (B, Hkv, G, C) on the attended slots of ``idx`` (B, Hkv, K),
    mean over heads."""
    chosen = torch.zeros(p.shape[0], p.shape[1], p.shape[-1], dtype=torch.bool)  # (B, Hkv, C)
    chosen.scatter_(-1, idx, attend)
    return float((p * chosen[:, :, None]).sum(-1).mean())


@torch.inference_mode()
def run_selection(runner, seeds: list[int], hot: float, ratio: float, max_new_tokens: int,
                  selectors: dict[str, RecallConfig], every: int = 3, log=print) -> dict:
    """How much of each decode step's cold attention each selector's choice holds, on bench shift's sessions.

    The sessions run tiered at ``hot`` with exact recall of ``ratio`` of the context; at every ``every``-th decode
    step, for every layer, the step's query and cold keys are kept, and each selector chooses its ``k`` slots
    from them. The figure is the share of the step's attention over the cold slots (softmax over the cold slots
    alone, averaged over the query heads) that the chosen slots hold, next to two references: the exact top-k
    (``oracle``: the most any choice of k slots can hold, up to the group's max) and the best whole pages ranked
    by their best exact score (``page_oracle<p>``: the most a page selector of that size can hold)."""
    capture = _Capture(runner.num_layers, every)
    register_selector("_capture", lambda cfg, rotary: capture, replace=True)
    try:
        spec = {"compression": {"budget_ratio": hot, "window": 32},
                "memory": {"cold": True, "recall": {"ratio": ratio, "selector": "_capture"}}}
        held: dict[str, list[float]] = {}
        for seed in seeds:
            capture.seen.clear()
            capture.calls = 0
            run_session(runner, make_scenario(seed), policy_for("selection", spec), max_new_tokens)
            built = {name: REGISTRY[cfg.selector](cfg, runner.rotary) for name, cfg in selectors.items()}
            for name, cfg in selectors.items():  # ShadowKV's point, measured: the same fit after RoPE
                if cfg.selector == "lowrank" and runner.rotary is not None:
                    built[f"{name} (after RoPE)"] = LowRank(cfg.rank, None)
            pages = sorted({cfg.page for cfg in selectors.values() if cfg.selector == "pages"})
            for query, keys, real, positions, k in capture.seen:
                logits = torch.einsum("bhgd,bhcd->bhgc", query, keys.float()) / keys.shape[-1] ** 0.5  # (B, Hkv, G, C)
                if real is not None:
                    logits = logits.masked_fill(~real[:, :, None], float("-inf"))
                p = logits.softmax(-1)  # (B, Hkv, G, C) attention over the cold slots alone
                best = logits.amax(2)  # (B, Hkv, C)
                top = best.topk(k, -1)
                held.setdefault("oracle", []).append(_mass(p, top.indices, top.values > float("-inf")))
                for size in pages:
                    cold = best.shape[-1]
                    n = -(-cold // size)
                    padded = torch.cat([best, best.new_full((*best.shape[:2], n * size - cold), float("-inf"))], -1)
                    rank = padded.view(*best.shape[:2], n, size).amax(-1)  # (B, Hkv, n) a page's best score
                    chosen = rank.topk(min(-(-k // size), n), -1).indices
                    slots, ok = page_slots(chosen, size, cold)  # (B, Hkv, n*size) each
                    held.setdefault(f"page_oracle{size}", []).append(_mass(p, slots, ok))
                for name, sel in built.items():
                    idx, attend = sel.choose(query, keys, real, k, positions)
                    held.setdefault(name, []).append(_mass(p, idx, attend))
            log(f"seed {seed}: {len(capture.seen)} layer-steps scored")
    finally:
        REGISTRY.pop("_capture", None)
    return {name: {"mass": round(statistics.mean(v), 3), "of_oracle": round(statistics.mean(v) /
                                                                             statistics.mean(held["oracle"]), 3),
                   "layer_steps": len(v)} for name, v in held.items()}


def selection_table(res: dict) -> str:
    lines = [f"{'selector':<24} {'cold mass held':>14} {'x oracle':>9}"]
    for name, c in res.items():
        lines.append(f"{name:<24} {c['mass']:>14.3f} {c['of_oracle']:>9.3f}")
    return "\n".join(lines)


def run_misses(runner, results: str, names: list[str], max_new_tokens: int, records: int = 40, log=print) -> dict:
    """Why a condition's reply parted from the full cache's: for each session's first differing turn (later turns
    follow different histories, so only the first is read), the full cache's logits at the first differing
    token, by one exact prefill of the conversation up to it. ``margin``: the full cache's logit of its own token
    minus that of the token the condition chose (>= 0: the full cache chose its own greedily); ``rank``: where the
    condition's token stands in the full cache's logits (1: a tie broken the other way).

    Replays only the full-cache sessions of the seeds with a miss (what the results file's rows say), with the
    grid's ``max_new_tokens``; ``replayed_equal`` says the replay gave the full cache's recorded replies."""
    rows = _done(Path(results))
    full = {seed: row for (seed, name), row in rows.items() if name == "full"}
    wanted: dict[int, list[tuple[str, int, int]]] = {}  # seed -> (condition, turn, token) of its first miss
    for name in names:
        for (seed, cond), row in rows.items():
            if cond != name or seed not in full:
                continue
            for i, (mine, ref) in enumerate(zip(row["turns"], full[seed]["turns"], strict=True)):
                if mine["tokens"] != ref["tokens"]:
                    d = next((j for j, (a, b) in enumerate(zip(mine["tokens"], ref["tokens"], strict=False)) if a != b),
                             min(len(mine["tokens"]), len(ref["tokens"])))
                    wanted.setdefault(seed, []).append((name, i, d))
                    break
    spec = conditions([], [])["full"]
    misses = []
    for seed in sorted(wanted):
        scenario = make_scenario(seed, records=records)
        session = Session.create(runner, policy=policy_for("full", spec), store=SessionStore("sqlite://"),
                                 system=SYSTEM)
        session.add_document(scenario.document, name="directory")
        ends = []  # per turn: the conversation's tokens up to its reply, and its reply
        same = True  # the replay gave the recorded full-cache replies so far
        for turn in scenario.turns[: max(i for _n, i, _d in wanted[seed]) + 1]:
            before = list(session.state.token_ids) + list(session.state.pending)
            reply = session.chat(turn.question, max_new_tokens=max_new_tokens)
            seq = list(session.state.token_ids) + list(session.state.pending)
            prompt_end = _reply_start(seq, list(reply.token_ids), len(before))
            same = same and list(reply.token_ids) == full[seed]["turns"][len(ends)]["tokens"]
            ends.append((seq[:prompt_end], list(reply.token_ids)))
        for name, i, d in wanted[seed]:
            prompt, _reply = ends[i]
            mine = rows[(seed, name)]["turns"][i]["tokens"]
            ref = full[seed]["turns"][i]["tokens"]
            if d >= len(mine) or d >= len(ref):  # one reply is a prefix of the other: it ended sooner
                misses.append({"seed": seed, "condition": name, "turn": i + 1, "token": d, "kind": "length"})
                continue
            state = runner.new_state()
            logits, _ = runner.prefill(state, prompt + ref[:d])  # (V,)
            logits = logits.float()
            probs = torch.softmax(logits, dim=-1)  # (V,)
            margin = float(logits[ref[d]] - logits[mine[d]])
            rank = int((logits > logits[mine[d]]).sum()) + 1
            misses.append({"seed": seed, "condition": name, "turn": i + 1, "token": d, "kind": "token",
                           "margin": round(margin, 4), "rank": rank,
                           "p_full": round(float(probs[ref[d]]), 4), "p_chosen": round(float(probs[mine[d]]), 4),
                           "replayed_equal": same})
            log(f"seed {seed} {name}: turn {i + 1} token {d}: margin {margin:.3f}, rank {rank}")
    margins = [m["margin"] for m in misses if m["kind"] == "token"]
    return {"misses": misses, "by_condition": {
        name: {"first_misses": sum(m["condition"] == name for m in misses),
               "margin_median": round(statistics.median(ms), 3) if (ms := [m["margin"] for m in misses
                                                                         if m["condition"] == name and "margin" in m])
               else None,
               "under_1_logit": sum(m.get("margin", 99) < 1.0 for m in misses if m["condition"] == name),
               "rank_2": sum(m.get("rank") == 2 for m in misses if m["condition"] == name)}
        for name in names}, "margins": margins}


def _reply_start(seq: list[int], reply: list[int], floor: int) -> int:
    """Where ``reply`` starts in ``seq`` (the conversation after its turn), at or after ``floor``."""
    for start in range(len(seq) - len(reply), floor - 1, -1):
        if seq[start:start + len(reply)] == reply:
            return start
    raise ValueError("the reply is not in the conversation's tokens")
