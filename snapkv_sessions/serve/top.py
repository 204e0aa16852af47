"""``snapkv-sessions top``: a running server's live metrics in the terminal, read from its ``GET /metrics``.

The figures are the dashboard's (deploy/grafana), evaluated over the last scrapes by the same small PromQL
evaluator as ``bench dashboard`` (:func:`snapkv_sessions.bench.dashboard.evaluate`): nothing is computed that the
scrape does not hold.
"""

from __future__ import annotations

import math

from ..bench.dashboard import Scrape, evaluate

# (name, PromQL, unit): what one screen shows. Rates and quantiles span the scrapes of the window.
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("requests running", "sum(vllm:num_requests_running)", ""),
    ("requests waiting", "sum(vllm:num_requests_waiting)", ""),
    ("requests answered /s", "sum(rate(vllm:request_success_total[1m]))", "/s"),
    ("errors /s", "sum(rate(snapkv:request_errors_total[1m]))", "/s"),
    ("tokens generated /s", "sum(rate(vllm:generation_tokens_total[1m]))", "/s"),
    ("tokens prefilled /s", "sum(rate(snapkv:prefilled_tokens_total[1m]))", "/s"),
    ("TTFT p50", "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))", "s"),
    ("TTFT p95", "histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))", "s"),
    ("TPOT p50", "histogram_quantile(0.5, sum by (le) (rate(vllm:request_time_per_output_token_seconds_bucket[1m])))",
     "s"),
    ("inter-token p95", "histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))",
     "s"),
    ("re-prefills /min", "60 * sum(rate(snapkv:reprefills_total[1m]))", "/min"),
    ("hot share p50", "histogram_quantile(0.5, sum by (le) (rate(snapkv:turn_hot_share_bucket[1m])))", ""),
    ("pinned tokens evicted (must be 0)", "sum(snapkv:pinned_tokens_evicted_total)", ""),
    ("cold-tier pool bytes", "sum(snapkv:tier_pool_bytes)", "B"),
    ("cold-tier pool cap", "sum(snapkv:tier_pool_cap_bytes)", "B"),
    ("tier events lost", "sum(snapkv:tier_events_total{kind=\"lost\"})", ""),
    ("faults", "sum(snapkv:faults_total)", ""),
)


def snapshot(scrapes: list[Scrape], window: int) -> dict[str, float | None]:
    """Each figure at the last scrape (None: no value yet, for example a quantile with no observation in the
    window)."""
    out: dict[str, float | None] = {}
    for name, expr, _unit in FIGURES:
        value = evaluate(expr, scrapes, len(scrapes) - 1, window)
        if isinstance(value, dict):  # a vector: its series summed (none: no value)
            value = sum(value.values()) if value else None
        out[name] = None if value is None or math.isnan(value) else round(value, 4)
    return out


def render(values: dict[str, float | None]) -> str:
    width = max(len(n) for n, _e, _u in FIGURES)
    lines = []
    for name, _expr, unit in FIGURES:
        v = values.get(name)
        if v is None:
            text = "-"
        elif unit == "B":
            text = f"{v / 2**20:,.1f} MiB"
        elif unit == "s":
            text = f"{v * 1e3:,.0f} ms"
        else:
            text = f"{v:,.2f}{unit}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v):,}{unit}"
        lines.append(f"{name:<{width}}  {text:>14}")
    return "\n".join(lines)
