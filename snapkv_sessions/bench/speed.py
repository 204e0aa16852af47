"""``bench speed``: prefill, compression overhead, TTFT, TPOT and KV bytes per context length and budget.

For each context length the prompt is prefilled once (window probe on); each budget then compresses a copy of
that cache and decodes ``steps`` tokens on it, side by side in one process. The bytes-read bound on the decode
speedup of a budget is ``(weights + full KV) / (weights + kept KV)``: a decode step reads every weight and every
cached key and value once.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import CompressionConfig
from ..runner import ModelRunner
from .overhead import synthetic_ids
from .variants import compressed_variants


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def decode_times(runner: ModelRunner, state, logits: torch.Tensor, steps: int, warmup: int = 2) -> list[float]:
    """Milliseconds of each of ``steps`` decode steps, after ``warmup`` untimed ones."""
    if hasattr(state.cache, "reserve"):
        state.cache.reserve(steps + warmup)
    times = []
    tok = int(logits.argmax())
    with torch.inference_mode():
        for _ in range(warmup):
            tok = int(runner.step(state, tok).argmax())
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = runner.step(state, tok)
            tok = int(logits.argmax())
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_length(runner: ModelRunner, ids: list[int], budgets: list[float | None], window: int, steps: int,
                   weight_bytes: int) -> list[dict]:
    configs = [None if r is None else CompressionConfig.make(budget_ratio=r, window=window) for r in budgets]
    rows = []
    for ratio, var in zip(budgets, compressed_variants(runner, ids, window, configs), strict=True):
        state, logits, prefill_ms = var.state, var.logits, var.prefill_ms
        full_kv = var.report.kv_bytes_before if var.report is not None else state.kv_bytes()
        compress_ms = var.report.total_ms if var.report is not None else 0.0
        t1 = time.perf_counter()
        int(logits.argmax())  # the first reply token comes from the prefill's logits: part of TTFT
        ttft = prefill_ms + compress_ms + (time.perf_counter() - t1) * 1e3
        kept = state.cache_lengths()[0]
        kept_kv = state.kv_bytes()
        resident = state.cache.allocated_bytes() if hasattr(state.cache, "allocated_bytes") else kept_kv
        times = decode_times(runner, state, logits, steps)
        rows.append({
            "tokens": len(ids), "budget": "full" if ratio is None else ratio, "kept_per_layer": kept,
            "prefill_ms": round(prefill_ms, 1), "compression_ms": round(compress_ms, 2),
            "compression_pct_of_prefill": round(100 * compress_ms / prefill_ms, 3),
            "ttft_ms": round(ttft, 1),
            "tpot_ms_median": round(statistics.median(times), 2), "tpot_ms_p95": round(_percentile(times, 95), 2),
            "tpot_ms_p99": round(_percentile(times, 99), 2),
            "kv_bytes_resident_after_compression": resident, "kv_bytes_read_per_step": kept_kv,
            "bytes_bound_speedup": round((weight_bytes + full_kv) / (weight_bytes + kept_kv), 3),
        })
    full_tpot = rows[0]["tpot_ms_median"]
    for row in rows:
        row["tpot_speedup"] = round(full_tpot / row["tpot_ms_median"], 3)
        row["share_of_bound"] = round(row["tpot_speedup"] / row["bytes_bound_speedup"], 3)
    return rows


def run(model_name: str, lengths: list[int], budgets: list[float], window: int = 32, steps: int = 32) -> dict:
    from ..models import load_model

    model, tok = load_model(model_name)
    runner = ModelRunner(model, tok, cache="compact")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.inference_mode():
        runner.prefill(runner.new_state(), synthetic_ids(tok, 64))  # warm-up
    rows = []
    for length in lengths:
        rows += measure_length(runner, synthetic_ids(tok, length), [None, *budgets], window, steps, weight_bytes)
    return {"benchmark": "speed", "model": model_name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device": str(runner.device), "threads": torch.get_num_threads(), "cache": "compact", "window": window,
            "decode_steps": steps, "weight_bytes": weight_bytes, "rows": rows}


def table(result: dict) -> str:
    head = (f"{'tokens':>6} {'budget':>6} {'kept':>5} {'prefill ms':>10} {'comp %':>7} {'TTFT ms':>8} {'TPOT p50':>8} "
            f"{'p95':>7} {'p99':>7} {'KV read/step':>12} {'speedup':>7} {'bound':>6} {'of bound':>8}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['tokens']:>6} {str(r['budget']):>6} {r['kept_per_layer']:>5} {r['prefill_ms']:>10.0f} "
                     f"{r['compression_pct_of_prefill']:>7.2f} {r['ttft_ms']:>8.0f} {r['tpot_ms_median']:>8.2f} "
                     f"{r['tpot_ms_p95']:>7.2f} {r['tpot_ms_p99']:>7.2f} {r['kv_bytes_read_per_step']:>12,} "
                     f"{r['tpot_speedup']:>7.2f} {r['bytes_bound_speedup']:>6.2f} {r['share_of_bound']:>8.0%}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    budgets = sorted({str(r["budget"]) for r in result["rows"]}, key=lambda b: (b == "full", b))
    for b in budgets:
        rows = [r for r in result["rows"] if str(r["budget"]) == b]
        ax1.plot([r["tokens"] for r in rows], [r["tpot_ms_median"] for r in rows], marker="o", label=f"budget {b}")
        if b != "full":
            ax2.plot([r["tokens"] for r in rows], [r["tpot_speedup"] for r in rows], marker="o", label=f"{b} measured")
            ax2.plot([r["tokens"] for r in rows], [r["bytes_bound_speedup"] for r in rows], linestyle="--",
                     label=f"{b} bytes bound")
    ax1.set(xlabel="context tokens", ylabel="TPOT median (ms)", title=f"{result['model']}: decode time per token")
    ax2.set(xlabel="context tokens", ylabel="TPOT(full) / TPOT(budget)", title="decode speedup vs bytes-read bound")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
