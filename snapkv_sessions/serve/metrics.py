"""Prometheus metrics of the server, fed by the stats stream (:mod:`snapkv_sessions.stats`) and nothing else.

:class:`PrometheusSink` is one more stats sink: each stat the engine, the worker and the HTTP layer emit updates a
few prometheus-client metrics in the sink's own :class:`~prometheus_client.CollectorRegistry` (not the global one,
so several apps or tests in one process never collide), and ``GET /metrics`` renders that registry. There is no
second bookkeeping: a figure that is not in the stream is not exported (docs/operations.md lists what is not yet).

Names follow vLLM's where they mean the same (``vllm:time_to_first_token_seconds``, ``vllm:num_requests_running``,
...), so a dashboard written for vLLM reads them; the others start with ``snapkv:``. Every series carries
``model_name``; the other labels take values the code writes (a decision, a fault kind, a status and error code,
a layer index), never a session id, a key or client text, and each label is capped at :data:`LABEL_VALUES`
distinct values besides ``"other"``, so no workload can grow the number of series without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .. import stats

LABEL_VALUES = 128  # distinct values one label may take before the rest are counted as "other"
OTHER = "other"

# vLLM's buckets for the same figures (vllm/v1/metrics/loggers.py), so the two servers' histograms compare
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
BYTES_BUCKETS = tuple(float(4 ** k) for k in range(8, 18))  # 64 KiB .. 16 GiB, a factor of 4 apart
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class _Vocabulary:
    """The values each label (named by its metric's use: ``"tier_kind"``, ``"fault_kind"``, ...) has taken; past
    :data:`LABEL_VALUES` of them, any new value reads as ``"other"``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, set[str]] = {}

    def __call__(self, label: str, value: object) -> str:
        text = "none" if value is None else str(value)
        with self._lock:
            seen = self._seen.setdefault(label, set())
            if text in seen:
                return text
            if len(seen) >= LABEL_VALUES:
                return OTHER
            seen.add(text)
            return text


class PrometheusSink:
    """A stats sink that turns the stream into Prometheus metrics for one served model.

    ``model_name`` labels every series (one model per server process); ``batch_slots`` is the server's decode
    slots (0: one turn at a time), exported so that batch occupancy reads as ``snapkv:scheduler_running`` over it.
    Register it with :func:`stats.add_sink`; render :attr:`registry` with ``prometheus_client.generate_latest``.
    """

    def __init__(self, model_name: str, batch_slots: int | None = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._label = _Vocabulary()
        r, m = self.registry, ["model_name"]

        # ---- requests (RequestStat, QueueStat: the HTTP layer and the worker)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds from a request's arrival to the first "
                              "piece of its reply.", m, registry=r, buckets=TTFT_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to the end of "
                             "its response, whatever its outcome.", m, registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Seconds a started request waited in the queue.",
                               m, registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Seconds per output token after the "
                              "first, per request with two or more.", m, registry=r, buckets=TPOT_BUCKETS)
        self.success = Counter("vllm:request_success", "Requests answered with a reply, by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.failed = Counter("snapkv:request_errors", "Requests answered without a reply, by HTTP status and "
                              "error code (499: the client left).", [*m, "status", "code"], registry=r)
        self.stopped = Counter("snapkv:requests_stopped", "Requests stopped after their turn started (the turn "
                               "abandoned), by cause.", [*m, "cause"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running on a worker thread.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting in the queue.", m, registry=r)

        # ---- turns (TurnStat: every turn of a session in this process)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of live turns (the new messages, "
                                     "templated).", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated by live turns.", m, registry=r)
        self.prefilled_tokens = Counter("snapkv:prefilled_tokens", "Tokens run through the model by a prefill, "
                                        "history fed again included.", [*m, "replay"], registry=r)
        self.turns = Counter("snapkv:turns", "Turns run, by drift decision.", [*m, "decision", "replay"], registry=r)
        self.reprefills = Counter("snapkv:reprefills", "Live turns that re-prefilled their history, by cause.",
                                  [*m, "cause"], registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Seconds of a live turn's prefill.", m,
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Seconds of a live turn's decode.", m,
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.compression_time = Histogram("snapkv:compression_seconds", "Seconds of a live turn's compression.", m,
                                          registry=r, buckets=TTFT_BUCKETS)
        self.compression_share = Histogram("snapkv:compression_prefill_ratio", "A live turn's compression time over "
                                           "its prefill time.", m, registry=r, buckets=SHARE_BUCKETS)
        self.hot_bytes = Histogram("snapkv:turn_hot_bytes", "Key and value bytes in the hot cache (device) after a "
                                   "live turn.", m, registry=r, buckets=BYTES_BUCKETS)
        self.cold_bytes = Histogram("snapkv:turn_cold_bytes", "Key and value bytes in the cold tier (host) after a "
                                    "live turn.", m, registry=r, buckets=BYTES_BUCKETS)
        self.recalled = Counter("snapkv:recalled_slots", "Cache slots recalled from the cold tier.", m, registry=r)
        self.hot_share = Histogram("snapkv:turn_hot_share", "After a live turn, the hot cache's slots over the full "
                                   "cache's (every layer holding every position).", m, registry=r,
                                   buckets=SHARE_BUCKETS)
        self.device_bytes = Histogram("snapkv:turn_device_bytes", "Bytes a live turn keeps where decode runs: the hot "
                                      "cache plus the recall selector's summary.", m, registry=r,
                                      buckets=BYTES_BUCKETS)
        self.kept_role = Histogram("snapkv:kept_share_by_role", "Per compressed live turn and role, the share of the "
                                   "role's positions kept.", [*m, "role"], registry=r, buckets=SHARE_BUCKETS)
        self.pinned = Counter("snapkv:pinned_tokens", "Pinned positions of compressed live turns, by role.",
                              [*m, "role"], registry=r)
        self.pinned_lost = Counter("snapkv:pinned_tokens_evicted", "Pinned positions some layer or KV head no "
                                   "longer held after a compression, by role (must stay 0).", [*m, "role"],
                                   registry=r)
        self.pinned_retention = Histogram("snapkv:pinned_retention", "Per compressed live turn and role with pins, "
                                          "the share of its pins held by the head holding fewest (must be 1.0).",
                                          [*m, "role"], registry=r, buckets=SHARE_BUCKETS)
        self.jaccard = Histogram("snapkv:kept_jaccard", "The kept set's Jaccard similarity with the session's "
                                 "previous compressed turn, on the positions both saw.", m, registry=r,
                                 buckets=SHARE_BUCKETS)
        self.recall_repeat = Histogram("snapkv:recall_repeat_rate", "Per recalling live turn, the share of recalled "
                                       "slots recalled the step before (a device recall cache's hit rate).", m,
                                       registry=r, buckets=SHARE_BUCKETS)
        self.recall_bytes = Histogram("snapkv:recall_bytes_per_step", "Per recalling live turn, bytes a decode step "
                                      "read besides the hot cache (selector reads, recalled keys and values).", m,
                                      registry=r, buckets=BYTES_BUCKETS)
        self.recall_steps = Counter("snapkv:recall_steps", "Decode steps of live turns that recalled from the tier.",
                                    m, registry=r)
        self.recall_escalated = Counter("snapkv:recall_escalated_steps", "Recalling decode steps taken again over "
                                        "the whole history, their two best logits within memory.recall.escalate.", m,
                                        registry=r)

        # ---- compressions (CompressionStat)
        self.compressions = Counter("snapkv:compressions", "SnapKV compressions.", m, registry=r)
        self.kept_share = Histogram("snapkv:kept_share", "Per compression, one observation per KV head: the share "
                                    "of the context it kept.", [*m, "layer"], registry=r, buckets=SHARE_BUCKETS)
        self.history_attention = Histogram("snapkv:window_history_attention", "The observation window's attention "
                                           "mass on the cache as it was before the prefill.", m, registry=r,
                                           buckets=SHARE_BUCKETS)
        self.top_mass = Histogram("snapkv:window_top_mass", "The window's attention mass over the history on its "
                                  "top 10% of positions (mean over layers and heads).", m, registry=r,
                                  buckets=SHARE_BUCKETS)
        self.entropy = Histogram("snapkv:window_entropy", "The entropy of the window's attention over the history, "
                                 "over log(positions) (mean over layers and heads).", m, registry=r,
                                 buckets=SHARE_BUCKETS)

        # ---- decode steps and the scheduler (DecodeStepStat, SchedulerStepStat)
        self.steps = Counter("snapkv:decode_steps", "Decode steps (a batched step counts once).", m, registry=r)
        self.step_time = Histogram("snapkv:decode_step_seconds", "Seconds of one decode step's forward.", m,
                                   registry=r, buckets=TPOT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Seconds between two consecutive tokens of a "
                             "reply, as its reader saw them.", m, registry=r, buckets=TPOT_BUCKETS)
        self.batch = Histogram("snapkv:decode_batch_size", "Rows (turns) in a decode step.", m, registry=r,
                               buckets=BATCH_BUCKETS)
        self.kv_read = Histogram("snapkv:decode_kv_bytes_read", "Key and value bytes one decode step read, all rows "
                                 "and layers.", m, registry=r, buckets=BYTES_BUCKETS)
        self.sched_running = Gauge("snapkv:scheduler_running", "Turns decoding in the batch.", m, registry=r)
        self.sched_waiting = Gauge("snapkv:scheduler_waiting", "Turns decoding but waiting for a batch slot.", m,
                                   registry=r)
        self.slots = Gauge("snapkv:batch_slots", "Decode slots of the batch (0: one turn at a time).", m, registry=r)
        if batch_slots is not None:  # None: a process without decode slots (the Ray ingress)
            self.slots.labels(model_name).set(batch_slots)

        # ---- the tier and faults (TierEvent, FaultStat)
        self.tier_events = Counter("snapkv:tier_events", "Tier events: streamed, recalled, lost, spilled, evicted, "
                                   "restored; lost and spilled by reason.", [*m, "kind", "reason"], registry=r)
        self.tier_bytes = Counter("snapkv:tier_bytes", "Key and value bytes of tier events, by kind.", [*m, "kind"],
                                  registry=r)
        self.faults = Counter("snapkv:faults", "Faults the engine recovered from, by kind.", [*m, "kind"], registry=r)
        self.pool_bytes = Gauge("snapkv:tier_pool_bytes", "Key and value bytes every cold tier of the process "
                                "holds in host memory.", m, registry=r)
        self.pool_cap = Gauge("snapkv:tier_pool_cap_bytes", "The cold-tier pool's byte cap (memory.max_bytes).", m,
                              registry=r)
        self.pool_tiers = Gauge("snapkv:tier_pool_tiers", "Sessions with a cold tier in the pool: in host memory "
                                "or spilled to disk.", [*m, "where"], registry=r)

    # ------------------------------------------------------------------ the sink

    def record(self, stat: stats.Stat) -> None:
        handler = _HANDLERS.get(type(stat))
        if handler is not None:
            handler(self, stat)

    def _request(self, s: stats.RequestStat) -> None:
        m = self.model_name
        self.e2e.labels(m).observe(s.e2e_s)
        if s.queue_s is not None:
            self.queue.labels(m).observe(s.queue_s)
        if s.ttft_s is not None:
            self.ttft.labels(m).observe(s.ttft_s)
        if s.code == "ok":
            self.success.labels(m, self._label("finished_reason", s.finish_reason)).inc()
            if s.decode_s is not None and s.completion_tokens > 1:
                self.tpot.labels(m).observe(s.decode_s / (s.completion_tokens - 1))
        else:
            self.failed.labels(m, self._label("status", s.status), self._label("code", s.code)).inc()
        if s.stopped is not None:
            self.stopped.labels(m, self._label("stopped_cause", s.stopped)).inc()

    def _queue(self, s: stats.QueueStat) -> None:
        self.running.labels(self.model_name).set(s.running)
        self.waiting.labels(self.model_name).set(s.waiting)

    def _turn(self, s: stats.TurnStat) -> None:
        m, replay = self.model_name, str(s.replay).lower()
        self.turns.labels(m, self._label("decision", s.decision), replay).inc()
        self.prefilled_tokens.labels(m, replay).inc(s.prefilled_tokens)
        if s.replay:  # a cache rebuilt from the store: no request's tokens, no serving latency
            return
        self.prompt_tokens.labels(m).inc(s.prompt_tokens)
        self.generation_tokens.labels(m).inc(s.decoded_tokens)
        cause = stats.reprefill_cause(s.reprefill_reason)
        if cause is not None:
            self.reprefills.labels(m, self._label("reprefill_cause", cause)).inc()
        self.prefill_time.labels(m).observe(s.prefill_s)
        self.decode_time.labels(m).observe(s.decode_s)
        self.compression_time.labels(m).observe(s.compression_s)
        if s.prefill_s > 0:
            self.compression_share.labels(m).observe(s.compression_s / s.prefill_s)
        self.hot_bytes.labels(m).observe(s.hot_bytes)
        self.cold_bytes.labels(m).observe(s.cold_bytes)
        self.recalled.labels(m).inc(s.recalled_slots)
        if s.hot_tokens and s.context_tokens > 0:
            self.hot_share.labels(m).observe(sum(s.hot_tokens) / (len(s.hot_tokens) * s.context_tokens))
        self.device_bytes.labels(m).observe(s.hot_bytes + s.summary_bytes)
        for role, share in s.kept_per_role:
            self.kept_role.labels(m, self._label("role", role)).observe(share)
        for role, pinned, retention in s.pinned_per_role:
            label = self._label("role", role)
            self.pinned.labels(m, label).inc(pinned)
            self.pinned_lost.labels(m, label).inc(round(pinned * (1.0 - retention)))
            self.pinned_retention.labels(m, label).observe(retention)
        if s.kept_jaccard is not None:
            self.jaccard.labels(m).observe(s.kept_jaccard)
        if s.recall_repeat_rate is not None:
            self.recall_repeat.labels(m).observe(s.recall_repeat_rate)
            self.recall_bytes.labels(m).observe(s.recall_bytes_per_step)
        self.recall_steps.labels(m).inc(s.recall_steps)
        self.recall_escalated.labels(m).inc(s.recall_escalated)

    def _compression(self, s: stats.CompressionStat) -> None:
        m = self.model_name
        self.compressions.labels(m).inc()
        if s.context_tokens > 0:
            for layer, heads in enumerate(s.kept):
                hist = self.kept_share.labels(m, self._label("layer", layer))
                for kept in heads:
                    hist.observe(kept / s.context_tokens)
        if s.history_attention is not None:
            self.history_attention.labels(m).observe(s.history_attention)
        if s.window_top_mass is not None:
            self.top_mass.labels(m).observe(s.window_top_mass)
        if s.window_entropy is not None:
            self.entropy.labels(m).observe(s.window_entropy)

    def _decode_step(self, s: stats.DecodeStepStat) -> None:
        m = self.model_name
        self.steps.labels(m).inc()
        self.step_time.labels(m).observe(s.seconds)
        self.batch.labels(m).observe(s.batch_size)
        self.kv_read.labels(m).observe(s.kv_bytes_read)
        for gap in s.gaps:
            self.itl.labels(m).observe(gap)

    def _scheduler_step(self, s: stats.SchedulerStepStat) -> None:
        self.sched_running.labels(self.model_name).set(s.running)
        self.sched_waiting.labels(self.model_name).set(s.waiting)

    def _tier(self, s: stats.TierEvent) -> None:
        m, kind = self.model_name, self._label("tier_kind", s.kind)
        self.tier_events.labels(m, kind, self._label("tier_reason", s.reason)).inc()
        self.tier_bytes.labels(m, kind).inc(s.nbytes)

    def _pool(self, s: stats.PoolStat) -> None:
        m = self.model_name
        self.pool_bytes.labels(m).set(s.host_bytes)
        self.pool_cap.labels(m).set(s.cap_bytes)
        self.pool_tiers.labels(m, "host").set(s.tiers - s.spilled)
        self.pool_tiers.labels(m, "disk").set(s.spilled)

    def _fault(self, s: stats.FaultStat) -> None:
        self.faults.labels(self.model_name, self._label("fault_kind", s.kind)).inc()


_HANDLERS = {
    stats.RequestStat: PrometheusSink._request,
    stats.QueueStat: PrometheusSink._queue,
    stats.TurnStat: PrometheusSink._turn,
    stats.CompressionStat: PrometheusSink._compression,
    stats.DecodeStepStat: PrometheusSink._decode_step,
    stats.SchedulerStepStat: PrometheusSink._scheduler_step,
    stats.TierEvent: PrometheusSink._tier,
    stats.PoolStat: PrometheusSink._pool,
    stats.FaultStat: PrometheusSink._fault,
}


REPLICA_LABEL = "replica"


def exposition(registry: CollectorRegistry, replicas: Mapping[str, str]) -> bytes:
    """One Prometheus text exposition of ``registry`` and of each replica's own scrape text (``replicas``: replica
    name -> text), each replica's samples labelled ``replica``, families of one name merged under one HELP and
    TYPE (the Ray ingress's ``GET /metrics``: its own request metrics and every engine replica's)."""
    merged: dict[str, Metric] = {}

    def add(family: Metric, extra: dict[str, str]) -> None:
        out = merged.get(family.name)
        if out is None:
            out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            out.add_sample(sample.name, {**sample.labels, **extra}, sample.value, sample.timestamp, sample.exemplar)

    for family in registry.collect():
        add(family, {})
    for replica, text in sorted(replicas.items()):
        for family in text_string_to_metric_families(text):
            add(family, {REPLICA_LABEL: replica})

    class _Merged:
        def collect(self) -> Iterator[Metric]:
            yield from merged.values()

    out = CollectorRegistry(auto_describe=False)
    out.register(_Merged())
    return generate_latest(out)
