"""``bench tier``: a turn served by the tiered memory against a re-prefill, side by side, at a long context.

For each context length a document of that many tokens is prefilled once into a tiered state and compressed to
the budget. Then, for ``repeats`` turns of ``new_tokens`` tokens each, the turn's prefill and compression run
twice in one process: (a) on the tiered state (the new tokens attend to hot and cold; the hot set is chosen
afresh), (b) as a re-prefill, a fresh full prefill of the whole history plus the new tokens, compressed with
the same window. Reported: both times and their ratio per turn, the hot bytes (what decode reads), the cold
bytes, the cold bytes streamed and the largest transient union buffer, and whether both chose the same kept set.
Decode is not timed: it reads the same hot cache in both.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import CompressionConfig
from ..generation import GenerationConfig
from ..runner import ModelRunner
from .overhead import synthetic_ids


def measure_length(runner: ModelRunner, length: int, ratio: float, window: int, new_tokens: int,
                   repeats: int) -> dict:
    tok = runner.tokenizer
    doc = synthetic_ids(tok, length + repeats * (new_tokens + 1))
    comp = CompressionConfig.make(budget=max(window + 8, int(ratio * length)), window=window)
    gen = GenerationConfig(max_new_tokens=1)  # the reply's first token: the turn's decode is not compared
    state = runner.new_state(tiered=True)
    t0 = time.perf_counter()
    first = runner.turn(state, doc[:length], comp, gen)
    first_ms = (time.perf_counter() - t0) * 1e3
    history = doc[:length] + first.tokens
    turns = []
    for i in range(repeats):
        ids = doc[length + i * new_tokens: length + (i + 1) * new_tokens]
        t1 = time.perf_counter()
        tiered = runner.turn(state, ids, comp, gen)
        tiered_ms = (time.perf_counter() - t1) * 1e3
        fresh = runner.new_state()
        t2 = time.perf_counter()
        ref = runner.turn(fresh, history + ids, comp, gen)
        reprefill_ms = (time.perf_counter() - t2) * 1e3
        same = all(torch.equal(a, b) for a, b in zip(tiered.kept, ref.kept, strict=True))
        turns.append({"context": tiered.prefill_end, "tiered_ms": round(tiered_ms, 1),
                      "reprefill_ms": round(reprefill_ms, 1), "speedup": round(reprefill_ms / tiered_ms, 1),
                      "same_kept": same, "same_reply": tiered.tokens == ref.tokens, **tiered.report.tier})
        history = history + ids + tiered.tokens
    return {"length": length, "budget": comp.budget, "window": window, "new_tokens": new_tokens,
            "first_prefill_ms": round(first_ms, 1),
            "speedup_median": statistics.median(t["speedup"] for t in turns), "turns": turns}


def run(model_name: str, lengths: list[int], ratio: float, window: int, new_tokens: int, repeats: int,
        dtype: str = "float32") -> dict:
    from ..models import load_model

    model, tok = load_model(model_name, dtype=getattr(torch, dtype))
    runner = ModelRunner(model, tok)
    torch.manual_seed(0)
    rows = [measure_length(runner, n, ratio, window, new_tokens, repeats) for n in lengths]
    return {"benchmark": "tier", "model": model_name, "dtype": dtype, "budget_ratio": ratio,
            "threads": torch.get_num_threads(), "lengths": rows}


def table(result: dict) -> str:
    head = (f"{'context':>7} {'budget':>6} {'tiered ms':>9} {'re-prefill ms':>13} {'speedup':>7} {'same kept':>9} "
            f"{'hot bytes':>11} {'cold bytes':>11} {'streamed':>11} {'peak union':>10}")
    lines = [head, "-" * len(head)]
    for row in result["lengths"]:
        for t in row["turns"]:
            lines.append(f"{t['context']:>7} {row['budget']:>6} {t['tiered_ms']:>9.0f} {t['reprefill_ms']:>13.0f} "
                         f"{t['speedup']:>7.1f} {t['same_kept']!s:>9} {t['hot_bytes']:>11,} {t['cold_bytes']:>11,} "
                         f"{t['streamed_bytes']:>11,} {t['peak_transient_bytes']:>10,}")
    return "\n".join(lines)
