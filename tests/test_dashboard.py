"""The Grafana dashboard (deploy/grafana/snapkv-sessions.json, issue 28) against what ``GET /metrics`` exports.

Every metric a panel or the model variable queries must be a sample the server's sink really exports, and every
label a query groups by or matches on must be one of that sample's labels: the sink is fed one stat of each kind (it
reads nothing else; tests/test_metrics.py checks the same sink against real requests) and scraped with
prometheus_client's own parser. So a metric renamed or a label dropped in serve/metrics.py fails here, not on an
operator's empty panel. No model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from snapkv_sessions import stats
from snapkv_sessions.serve.metrics import PrometheusSink

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "snapkv-sessions.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# every exported name has a prefix with a colon (vllm:, snapkv:); PromQL functions, labels and variables have none
METRIC = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def _every_stat() -> list[stats.Stat]:
    """One stat of each kind, with the optional figures present, so every metric of the sink gets a sample."""
    turn = stats.TurnStat(session_id="s", turn=2, model="m", decision="reprefill",
                          reprefill_reason=stats.REPREFILL_DRIFT, prompt_tokens=3, prefilled_tokens=9,
                          decoded_tokens=4, context_tokens=9, hot_tokens=(8, 8), prefill_s=0.5, decode_s=0.2,
                          compression_s=0.05, recalled_slots=2, hot_bytes=1 << 20, cold_bytes=1 << 18, replay=False,
                          kept_per_role=(("system", 1.0), ("user", 0.4)), pinned_per_role=(("system", 12, 1.0),),
                          kept_jaccard=0.8, recall_repeat_rate=0.5, recall_bytes_per_step=4096, summary_bytes=1024,
                          recall_steps=10, recall_escalated=2)
    return [
        stats.RequestStat(status=200, code="ok", stopped=None, stream=True, finish_reason="stop", queue_s=0.01,
                          ttft_s=0.6, decode_s=0.3, e2e_s=1.0, prompt_tokens=3, completion_tokens=4),
        stats.RequestStat(status=504, code="deadline_exceeded", stopped="deadline", stream=False, finish_reason=None,
                          queue_s=0.01, ttft_s=None, decode_s=None, e2e_s=9.0, prompt_tokens=0, completion_tokens=0),
        stats.QueueStat(running=1, waiting=2),
        turn,
        stats.CompressionStat(context_tokens=9, window=2, budgets=(8, 8), kept=((8, 7), (6, 8)), score_s=0.01,
                              select_s=0.01, gather_s=0.01, history_attention=0.4, window_top_mass=0.6,
                              window_entropy=0.7),
        stats.DecodeStepStat(batch_size=2, tokens=2, seconds=0.05, kv_bytes_read=1 << 20, gaps=(0.05, 0.07)),
        stats.PoolStat(host_bytes=1 << 20, cap_bytes=1 << 30, tiers=3, spilled=1),
        stats.SchedulerStepStat(running=2, waiting=0, calls=1, step_s=0.05),
        stats.TierEvent(kind="lost", session_id="s", nbytes=4096, slots=12, reason="memory_limit"),
        stats.TierEvent(kind="recalled", session_id="s", nbytes=0, slots=2, reason=None),
        stats.FaultStat(kind="store_unavailable", session_id=None, detail="no connection free within 5 s"),
    ]


def _exported() -> dict[str, set[str]]:
    """Sample name -> its label names, as a scrape of the fed sink reads."""
    sink = PrometheusSink("tiny", batch_slots=4)
    for stat in _every_stat():
        sink.record(stat)
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and of every query variable."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found.append((f"variable {var['name']!r}", var["query"]["query"]))
    return found


def test_every_query_reads_metrics_and_labels_the_server_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queries = _queries(dashboard)
    assert len(queries) == 59  # 58 panel targets and the model variable
    used: set[str] = set()
    for where, expr in queries:
        names = set(METRIC.findall(expr))
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - exported.keys()
        assert not missing, f"{where}: {sorted(missing)} not exported"
        labels = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
        labels |= set(MATCHER.findall(expr))
        labels |= {m.split(",")[-1].strip() for m in LABEL_VALUES.findall(expr)}  # label_values(metric, label)
        allowed = set.union(*(exported[n] for n in names))
        assert labels <= allowed, f"{where}: labels {sorted(labels - allowed)} not on {sorted(names)}"
        used |= names
    # the panels the operations page lists: latency quantiles, load, tokens, errors, re-prefills, tier, kept share,
    # compression share, KV read, recall, and the compression-safety row (pins, roles, stability, ITL, pool)
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "snapkv:request_errors_total",
            "snapkv:reprefills_total", "snapkv:tier_events_total", "snapkv:kept_share_bucket",
            "snapkv:compression_prefill_ratio_bucket", "snapkv:decode_kv_bytes_read_sum",
            "snapkv:recalled_slots_total", "vllm:inter_token_latency_seconds_bucket",
            "snapkv:pinned_tokens_evicted_total", "snapkv:pinned_tokens_total", "snapkv:kept_share_by_role_bucket",
            "snapkv:kept_jaccard_bucket", "snapkv:window_top_mass_bucket", "snapkv:window_entropy_bucket",
            "snapkv:turn_hot_share_bucket", "snapkv:turn_device_bytes_bucket", "snapkv:tier_pool_bytes",
            "snapkv:tier_pool_cap_bytes", "snapkv:tier_pool_tiers", "snapkv:recall_repeat_rate_bucket",
            "snapkv:recall_bytes_per_step_bucket", "snapkv:recall_escalated_steps_total",
            "snapkv:recall_steps_total"} <= used


def test_the_dashboard_imports_with_a_prometheus_input_and_a_clean_grid():
    dashboard = json.loads(DASHBOARD.read_text())
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) == 33
    charts = [p for p in panels if p["type"] != "row"]
    assert len(charts) == 27
    for p in charts:
        assert p["datasource"] == DATASOURCE and all(t["datasource"] == DATASOURCE for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]) > 0
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    cells = {(x, y) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])}
    assert len(cells) == sum(p["gridPos"]["w"] * p["gridPos"]["h"] for p in panels)  # no two panels overlap
    (model,) = dashboard["templating"]["list"]
    assert model["datasource"] == DATASOURCE and model["name"] == "model_name"
    assert all('model_name=~"$model_name"' in t["expr"] for p in charts for t in p["targets"])


def _scrapes_of(steps: list[list[stats.Stat]], dt: float = 2.0):
    """A PrometheusSink fed ``steps[i]`` before scrape i, scraped after each step ``dt`` seconds apart."""
    from snapkv_sessions.bench.dashboard import Scrape

    sink, out = PrometheusSink("tiny", batch_slots=4), []
    for i, batch in enumerate(steps):
        for stat in batch:
            sink.record(stat)
        out.append(Scrape.parse(i * dt, generate_latest(sink.registry).decode()))
    return out


def test_the_evaluator_computes_rates_sums_and_quantiles_as_prometheus_does():
    """bench dashboard's PromQL subset: rate over a window of scrapes, sum and sum by, histogram_quantile with
    Prometheus' linear interpolation inside a bucket, arithmetic between vectors, matchers."""
    from snapkv_sessions.bench.dashboard import evaluate

    ok = dict(status=200, code="ok", stopped=None, stream=True, finish_reason="stop", queue_s=0.01, decode_s=0.3,
              e2e_s=1.0, prompt_tokens=3, completion_tokens=4)
    steps = [[], [stats.RequestStat(ttft_s=0.3, **ok)] * 3,
             [stats.RequestStat(ttft_s=0.6, **ok), stats.FaultStat("lock_timeout", None, "x")]]
    scrapes = _scrapes_of(steps)
    model = {"model_name": ".*"}
    # 4 successes between scrape 0 (t=0) and scrape 2 (t=4): 1 per second
    assert evaluate('sum(rate(vllm:request_success_total{model_name=~"$model_name"}[5m]))', scrapes, 2, 2,
                    model) == {(): 1.0}
    assert evaluate('sum by (kind) (rate(snapkv:faults_total{model_name=~"$model_name"}[5m]))', scrapes, 2, 1,
                    model) == {(("kind", "lock_timeout"),): 0.5}
    # TTFT: 3 in (0.25, 0.5] and 1 in (0.5, 0.75]; the median's rank 2 of 4 falls in (0.25, 0.5] at 2/3 of it
    q = evaluate('histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
                 '{model_name=~"$model_name"}[5m])))', scrapes, 2, 2, model)
    assert q[()] == pytest.approx(0.25 + 0.25 * 2 / 3)
    q = evaluate('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))',
                 scrapes, 2, 2)
    assert q[()] == pytest.approx(0.5 + 0.25 * (3.96 - 3) / 1)
    ratio = evaluate('1 - sum(rate(vllm:request_success_total[1m])) / sum(rate(vllm:request_success_total[1m]))',
                     scrapes, 2, 2)
    assert ratio == {(): 0.0}
    assert evaluate('sum(snapkv:batch_slots{model_name="other"})', scrapes, 2, 1) == {}
    assert evaluate("sum(snapkv:batch_slots)", scrapes, 0, 1) == {(): 4.0}


def test_every_panel_query_evaluates_on_a_scrape():
    """Each of the dashboard's queries parses and gives a value on scrapes of a sink fed one stat of each kind
    twice (the picture bench dashboard draws reads these same queries)."""
    from snapkv_sessions.bench.dashboard import series

    dashboard = json.loads(DASHBOARD.read_text())
    panels = series(dashboard, _scrapes_of([_every_stat(), _every_stat()]), window=1)
    charts = [p for p in panels if not p.get("row")]
    assert len(charts) == 27
    empty = [(p["title"], t["expr"]) for p in charts for t in p["targets"] if t["points"] == 0]
    # the fault panel and the others all have a value at the second scrape; none is left empty
    assert not empty, empty
