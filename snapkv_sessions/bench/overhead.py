"""Compression overhead as a share of prefill, measured side by side in one process.

For each context length the same prompt is prefilled twice per repeat: once plainly (no observation window)
and once as a SnapKV turn does it (window probe on), then compressed. The figure is
``(score + select + gather) / plain prefill``, the median over repeats.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import CompressionConfig
from ..runner import ModelRunner

FILLER = (
    "The archive lists shipments, couriers and depots. Entry {i}: parcel {p} left depot {d} on day {day}, "
    "carried by agent {a}, weight {w} kg, status {s}.\n"
)


def synthetic_ids(tokenizer, length: int) -> list[int]:
    """A deterministic document of exactly ``length`` tokens."""
    parts, i = [], 0
    ids: list[int] = []
    while len(ids) < length:
        chunk = "".join(
            FILLER.format(i=j, p=10000 + 37 * j, d=j % 17, day=j % 28 + 1, a=chr(65 + j % 26), w=j % 40 + 1,
                          s=("sent", "held", "lost")[j % 3])
            for j in range(i, i + 50)
        )
        parts.append(chunk)
        i += 50
        ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
    return ids[:length]


def measure(runner: ModelRunner, ids: list[int], cfg: CompressionConfig, repeats: int) -> dict:
    plain, probed, score, select, gather = [], [], [], [], []
    report = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.prefill(runner.new_state(), ids)
        plain.append((time.perf_counter() - t0) * 1e3)
        state = runner.new_state()
        t0 = time.perf_counter()
        _, probe = runner.prefill(state, ids, window=cfg.window)
        probed.append((time.perf_counter() - t0) * 1e3)
        report = runner.compress(state, cfg, probe)
        score.append(report.score_ms)
        select.append(report.select_ms)
        gather.append(report.gather_ms)
    med = statistics.median
    compress_ms = med(score) + med(select) + med(gather)
    return {
        "tokens": len(ids),
        "budget_per_layer": report.budgets[0],
        "prefill_ms": round(med(plain), 1),
        "prefill_with_probe_ms": round(med(probed), 1),
        "score_ms": round(med(score), 2),
        "select_ms": round(med(select), 2),
        "gather_ms": round(med(gather), 2),
        "compression_ms": round(compress_ms, 2),
        "compression_share_pct": round(100 * compress_ms / med(plain), 3),
        "kv_bytes_before": report.kv_bytes_before,
        "kv_bytes_after": report.kv_bytes_after,
    }


def run(model_name: str, lengths: list[int], cfg: CompressionConfig, repeats: int = 2) -> dict:
    from ..models import load_model

    model, tok = load_model(model_name)
    runner = ModelRunner(model, tok)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        runner.prefill(runner.new_state(), synthetic_ids(tok, 64))  # warm-up
        for length in lengths:
            rows.append(measure(runner, synthetic_ids(tok, length), cfg, repeats))
    return {
        "benchmark": "compression_overhead",
        "model": model_name,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(runner.device),
        "threads": torch.get_num_threads(),
        "compression": cfg.model_dump(),
        "repeats": repeats,
        "rows": rows,
    }


def table(result: dict) -> str:
    head = f"{'tokens':>7} {'prefill ms':>11} {'score ms':>9} {'select ms':>10} {'gather ms':>10} {'share %':>8}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['tokens']:>7} {r['prefill_ms']:>11.1f} {r['score_ms']:>9.2f} {r['select_ms']:>10.2f} "
            f"{r['gather_ms']:>10.2f} {r['compression_share_pct']:>8.3f}"
        )
    return "\n".join(lines)
