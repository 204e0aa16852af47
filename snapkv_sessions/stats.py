"""A typed stats stream: the engine emits stats, pluggable sinks decide what to do with them.

Modelled on vLLM v1's StatLoggers. The runner, the session, the tier and the scheduler each know a few numbers
about what they just did (tokens prefilled, bytes streamed from the cold tier, a decode step's batch size, a
retried store write). Rather than each of them keeping its own counters, writing its own log lines and exposing
its own hooks for tests, they build one small frozen dataclass per event and hand it to :func:`emit`. Whoever
listens registers a :class:`StatSink`:

* :class:`Counter` aggregates in memory (the tests and the bench commands read it);
* :class:`LogSink` writes one structured log record per turn, fault and tier loss (with :class:`JsonFormatter`,
  one JSON line each);
* a metrics exporter is one more sink, added without touching the engine (Prometheus:
  :class:`snapkv_sessions.serve.metrics.PrometheusSink`, behind the server's ``GET /metrics``).

So metrics, logs and tests share one bookkeeping, and the engine never knows who listens. Three rules keep the
stream safe to call from the hot path:

* **Cheap when nobody listens.** :func:`active` is one attribute read; callers test it before they build a stat
  (``if stats.active(): stats.emit(TurnStat(...))``), and :func:`emit` with no sinks returns at once.
* **A sink never breaks the engine.** A sink that raises is logged once per sink type, at WARNING, and the other
  sinks still get the stat; the caller never sees the error.
* **Thread-safe.** The scheduler thread and the session threads emit concurrently. The registry replaces an
  immutable tuple of sinks under a lock; :func:`emit` takes that tuple under the lock and calls the sinks outside
  it, so a slow sink does not serialise the emitters and a sink may itself emit or (un)register.

Stats carry numbers and identifiers only, never message content: a sink may ship them anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    from .report import CompressionReport

__all__ = [
    "FAULT_DETAIL_LIMIT",
    "CompressionStat",
    "Counter",
    "DecodeStepStat",
    "QueueStat",
    "REPREFILL_AS_RECORDED",
    "REPREFILL_DRIFT",
    "REPREFILL_TIER_LOST",
    "FaultStat",
    "JsonFormatter",
    "PoolStat",
    "LogSink",
    "SchedulerStepStat",
    "Stat",
    "RequestStat",
    "StatSink",
    "TierEvent",
    "TurnStat",
    "active",
    "add_sink",
    "configure_logging",
    "emit",
    "registered",
    "remove_sink",
    "reprefill_cause",
    "sinks",
    "stat_kind",
]

PACKAGE_LOGGER = "snapkv_sessions"
STATS_LOGGER = "snapkv_sessions.stats"
FAULT_DETAIL_LIMIT = 500  # characters of a FaultStat's detail: a fault record stays small whatever went wrong

_log = logging.getLogger(PACKAGE_LOGGER)


# ---------------------------------------------------------------------------------------------------------------
# The stats
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnStat:
    """One finished turn of a session (emitted once per turn, after its compression).

    Attributes
    ----------
    session_id: the session's id
    turn: the turn's number in the session, as the store numbers turns (the first is 1)
    model: the model's name or path, as the runner was loaded with
    decision: the drift decision for the turn: ``"kept"``, ``"tiered"``, ``"reprefill"``, ... (a str: the
        session may grow new decisions without this module changing)
    reprefill_reason: why the turn re-prefilled its history (None when it did not)
    prompt_tokens: tokens the turn's plan fed (the new messages, templated)
    prefilled_tokens: tokens actually run through the model, including history fed again by the tier or by a
        re-prefill (>= prompt_tokens on a re-prefill)
    decoded_tokens: reply tokens: generated (a live turn), or fed from the record (a replay, which leaves the
        last one pending as the live turn did)
    context_tokens: true positions after the turn's prefill (the uncompressed context the reply is written to)
    hot_tokens: per layer, cache slots resident on the device after the compression
    prefill_s, decode_s, compression_s: wall-clock seconds of the prefill, of the decode and of the compression
    recalled_slots: cache slots recalled from the cold tier into the hot cache this turn
    hot_bytes, cold_bytes: key+value bytes in the hot cache (device) and in the cold tier (host) after the turn's
        compression (as its turn record's ``compression`` holds them; the hot cache after the prefill when none ran)
    replay: True for a replayed or catch-up turn (rebuilding a cache from the store), False for a live one
    kept_per_role: per role (``"system"``, ``"user"``, ...), the share of its positions still held after the
        compression, mean over layers and KV heads (empty when no compression ran)
    pinned_per_role: per role with pinned positions, ``(role, pinned tokens, retention)``: the retention is the
        share of that role's pinned positions held by the head that holds fewest of them, which must be 1.0 (a
        pin is never evicted); empty when no compression ran or nothing is pinned
    kept_jaccard: the kept set's Jaccard similarity with the previous turn's, on the positions both turns saw,
        mean over layers and KV heads; None on a session's first compressed turn in this process
    recall_repeat_rate: decode-time recall: the share of recalled slots the same layer and head had recalled the
        step before (what a device cache of the last step's recalls would hit); None when decode recalled nothing
    recall_bytes_per_step: decode-time recall: bytes one step read besides the hot cache (the selector's summary or
        cold keys, and the recalled keys and values); 0 without recall
    summary_bytes: bytes of the recall selector's summary of the cold tier (what stays on a device beside the hot
        cache); 0 without recall
    recall_steps, recall_escalated: decode steps that recalled, and those of them taken again over the whole history
        on a near-tie (``memory.recall.escalate``); 0 without recall
    """

    session_id: str
    turn: int
    model: str
    decision: str
    reprefill_reason: str | None
    prompt_tokens: int
    prefilled_tokens: int
    decoded_tokens: int
    context_tokens: int
    hot_tokens: tuple[int, ...]
    prefill_s: float
    decode_s: float
    compression_s: float
    recalled_slots: int
    hot_bytes: int
    cold_bytes: int
    replay: bool
    kept_per_role: tuple[tuple[str, float], ...] = ()
    pinned_per_role: tuple[tuple[str, int, float], ...] = ()
    kept_jaccard: float | None = None
    recall_repeat_rate: float | None = None
    recall_bytes_per_step: int = 0
    summary_bytes: int = 0
    recall_steps: int = 0
    recall_escalated: int = 0

    @property
    def total_s(self) -> float:
        """Seconds of the prefill, decode and compression together."""
        return self.prefill_s + self.decode_s + self.compression_s


@dataclass(frozen=True, slots=True)
class CompressionStat:
    """One SnapKV compression of a session's cache: the layer budgets and what each KV head kept.

    Attributes
    ----------
    context_tokens: true positions seen so far (the uncompressed context length)
    window: observation window actually used, in tokens (W, or fewer on a turn shorter than W)
    budgets: per layer, the tokens it may keep (window included)
    kept: per layer, per KV head, cache slots kept
    score_s, select_s, gather_s: seconds computing the window scores, selecting (pooling, head reduction,
        top-k) and gathering the compressed key/value tensors, all layers
    history_attention: the observation window's attention mass on the cache as it was before this prefill, in
        [0, 1] (see :class:`~snapkv_sessions.report.CompressionReport`); None on a first prefill
    window_top_mass: how concentrated the window's attention is: the share of its mass over the history (window
        excluded) on the top 10% of positions, mean over layers and query heads; None when not measured
    window_entropy: the entropy of that distribution over its log(positions), in [0, 1] (1: spread evenly, 0: one
        position), mean over layers and query heads; None when not measured
    """

    context_tokens: int
    window: int
    budgets: tuple[int, ...]
    kept: tuple[tuple[int, ...], ...]
    score_s: float
    select_s: float
    gather_s: float
    history_attention: float | None
    window_top_mass: float | None = None
    window_entropy: float | None = None

    @classmethod
    def from_report(cls, report: CompressionReport) -> CompressionStat:
        """The stat of a :class:`~snapkv_sessions.report.CompressionReport` (which keeps milliseconds and lists:
        converted here, so that the emitting code does not repeat the conversion)."""
        return cls(
            context_tokens=report.context_tokens,
            window=report.window,
            budgets=tuple(report.budgets),
            kept=tuple(tuple(heads) for heads in report.kept),
            score_s=report.score_ms / 1000.0,
            select_s=report.select_ms / 1000.0,
            gather_s=report.gather_ms / 1000.0,
            history_attention=report.history_attention,
            window_top_mass=report.window_top_mass,
            window_entropy=report.window_entropy,
        )


@dataclass(frozen=True, slots=True)
class DecodeStepStat:
    """One batched decode step (one new token for each row of the batch).

    Attributes
    ----------
    batch_size: rows (sessions) in the step
    tokens: tokens the step produced, all rows (== batch_size unless some rows had already finished)
    seconds: wall-clock seconds of the step
    kv_bytes_read: key+value bytes the step's attention read, all rows and layers
    gaps: per token the step produced, the seconds since its row's previous token (its inter-token latency, as
        the reader of that row saw it); empty when not measured
    """

    batch_size: int
    tokens: int
    seconds: float
    kv_bytes_read: int
    gaps: tuple[float, ...] = ()


TierEventKind = Literal["streamed", "recalled", "lost", "spilled", "evicted", "restored"]


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Something the tiered memory did with a session's evicted KV.

    Attributes
    ----------
    kind: ``"streamed"`` (cold KV read for a prefill), ``"recalled"`` (cold slots moved back into the hot cache),
        ``"lost"`` (cold KV that could not be kept or read: the session must re-prefill), ``"spilled"`` (cold KV
        written out of host memory), ``"evicted"`` (cold KV dropped to free memory), ``"restored"`` (cold KV
        brought back from a spill)
    session_id: the session concerned (None for a pool-wide event)
    nbytes: key+value bytes concerned
    slots: cache slots concerned (summed over layers and KV heads)
    reason: why, for lost/spilled/evicted (for example ``"memory_limit"``); None otherwise
    """

    kind: TierEventKind
    session_id: str | None
    nbytes: int
    slots: int
    reason: str | None


@dataclass(frozen=True, slots=True)
class PoolStat:
    """The process's pool of cold tiers (:mod:`snapkv_sessions.tierpool`) after a turn released its tier and the
    pool enforced its cap.

    Attributes
    ----------
    host_bytes: key+value bytes the cold tiers hold in host memory, all sessions
    cap_bytes: the pool's byte cap (``memory.max_bytes``)
    tiers: sessions with a cold tier in the pool
    spilled: of those, tiers spilled to disk (read back on their session's next turn)
    """

    host_bytes: int
    cap_bytes: int
    tiers: int
    spilled: int


@dataclass(frozen=True, slots=True)
class SchedulerStepStat:
    """One iteration of the scheduler's loop.

    Attributes
    ----------
    running: sessions in the running batch after the step
    waiting: sessions admitted but waiting for a slot in the batch
    calls: calls (prefills, compressions, store writes) the scheduler thread ran between two decode steps
    step_s: wall-clock seconds of the iteration
    """

    running: int
    waiting: int
    calls: int
    step_s: float


@dataclass(frozen=True, slots=True)
class FaultStat:
    """A fault the engine recovered from (or that failed one turn but not the engine).

    Attributes
    ----------
    kind: what happened, for example ``"store_retry"``, ``"tier_lost"``, ``"lock_contention"``, ``"turn_failed"``
    session_id: the session concerned (None when none is)
    detail: a short description (an exception's type and text, never message content), cut to
        :data:`FAULT_DETAIL_LIMIT` characters
    """

    kind: str
    session_id: str | None
    detail: str

    def __post_init__(self) -> None:
        # An exception's text can be huge (a tensor repr, a whole SQL statement): a fault record stays bounded.
        if len(self.detail) > FAULT_DETAIL_LIMIT:
            object.__setattr__(self, "detail", self.detail[: FAULT_DETAIL_LIMIT - 3] + "...")


# Why a turn re-prefilled (TurnStat.reprefill_reason starts with one of these; a lost tier adds its own text after
# a colon). Named here so that the session writing a reason and a sink labelling it by its cause share one list.
REPREFILL_DRIFT = "drift"
REPREFILL_TIER_LOST = "tier lost"
REPREFILL_AS_RECORDED = "as recorded"  # a replayed turn that re-prefilled when it ran live
REPREFILL_RENDER = "render"  # the conversation no longer renders to the cache's tokens (chat.RenderDiverged)
_REPREFILL_CAUSES = (REPREFILL_DRIFT, REPREFILL_TIER_LOST, REPREFILL_AS_RECORDED, REPREFILL_RENDER)


def reprefill_cause(reason: str | None) -> str | None:
    """The bounded cause of a :attr:`TurnStat.reprefill_reason` (``"drift"``, ``"tier_lost"``,
    ``"as_recorded"``, ``"render"``, ``"other"``; None when the turn did not re-prefill): a label a metric may
    carry, where the reason itself holds free text."""
    if reason is None:
        return None
    head = reason.split(":", 1)[0].strip()
    return head.replace(" ", "_") if head in _REPREFILL_CAUSES else "other"


@dataclass(frozen=True, slots=True)
class RequestStat:
    """One chat completion request of the server, once its response has ended (emitted by the HTTP layer, the one
    place that sees a request from arrival to its last byte).

    Attributes
    ----------
    status: the HTTP status the request was answered with; for a stream that had opened (200) and then ended with
        an error event, that error's status; 499 when the client left before its response ended (nginx's code)
    code: ``"ok"``, or the error's code as the client was told it (``"queue_full"``, ``"deadline_exceeded"``,
        ``"shutting_down"``, ``"invalid_value"``, ...; a bounded set written by the server, never client text) and
        ``"client_disconnected"`` for a 499
    stopped: why a request whose turn had started running was stopped before its reply (``"deadline"``,
        ``"shutdown"``, ``"client_left"``): its turn is abandoned; None otherwise
    stream: whether the client asked for a stream
    finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"`` for a reply, None otherwise
    queue_s: seconds the request waited in the server's queue before a worker started it (None: never started)
    ttft_s: seconds from the request's arrival to the first piece of its reply (None: no reply began)
    decode_s: seconds from that first piece to the reply's end (its commit); None without a reply
    e2e_s: seconds from the request's arrival to the end of its response
    prompt_tokens, completion_tokens: the usage the client was told (0 without a reply)
    """

    status: int
    code: str
    stopped: str | None
    stream: bool
    finish_reason: str | None
    queue_s: float | None
    ttft_s: float | None
    decode_s: float | None
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class QueueStat:
    """The server's requests now, emitted by its worker each time one is queued, started or ends.

    Attributes
    ----------
    running: requests whose job runs on a worker thread (prefilling, decoding or committing)
    waiting: requests in the queue, not started yet
    """

    running: int
    waiting: int


Stat = (TurnStat | CompressionStat | DecodeStepStat | TierEvent | PoolStat | SchedulerStepStat | FaultStat
        | RequestStat | QueueStat)

_KINDS: dict[type, str] = {
    TurnStat: "turn",
    CompressionStat: "compression",
    DecodeStepStat: "decode_step",
    TierEvent: "tier",
    PoolStat: "pool",
    SchedulerStepStat: "scheduler_step",
    FaultStat: "fault",
    RequestStat: "request",
    QueueStat: "queue",
}


def stat_kind(stat: Stat) -> str:
    """The stat's kind as a short name (``"turn"``, ``"compression"``, ``"decode_step"``, ``"tier"``,
    ``"pool"``, ``"scheduler_step"``, ``"fault"``, ``"request"``, ``"queue"``): the key in :meth:`Counter.to_dict` and the
    ``stat_type`` of a log record."""
    return _KINDS.get(type(stat)) or type(stat).__name__


# ---------------------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------------------


class StatSink(Protocol):
    """Anything that receives stats. ``record`` is called on the emitting thread (the scheduler's or a
    session's), so it should be quick; it may raise (the error is logged once and swallowed)."""

    def record(self, stat: Stat) -> None: ...


class _Registry:
    """The registered sinks, as an immutable tuple replaced wholesale under a lock.

    Readers (:func:`emit`, :func:`active`) see either the old tuple or the new one, never a half-updated list;
    registration is rare, emits are many.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sinks: tuple[StatSink, ...] = ()
        self.warned: set[type] = set()  # sink types whose failure has been logged already

    def add(self, sink: StatSink) -> None:
        with self.lock:
            self.sinks = (*self.sinks, sink)

    def remove(self, sink: StatSink) -> bool:
        with self.lock:
            for i, s in enumerate(self.sinks):
                if s is sink:  # identity: two equal sinks registered apart are two registrations
                    self.sinks = self.sinks[:i] + self.sinks[i + 1 :]
                    return True
        return False

    def snapshot(self) -> tuple[StatSink, ...]:
        with self.lock:
            return self.sinks

    def first_failure(self, sink: StatSink) -> bool:
        """Whether this is the first failure of a sink of this type (and mark it seen)."""
        kind = type(sink)
        with self.lock:
            if kind in self.warned:
                return False
            self.warned.add(kind)
            return True


_REGISTRY = _Registry()


def add_sink(sink: StatSink) -> Callable[[], None]:
    """Register ``sink``; returns a function that removes it (calling it again does nothing).

    A sink registered twice receives each stat twice, and needs removing twice.
    """
    _REGISTRY.add(sink)
    done = False

    def remove() -> None:
        nonlocal done
        if not done:
            done = True
            _REGISTRY.remove(sink)

    return remove


def remove_sink(sink: StatSink) -> None:
    """Unregister ``sink`` (one registration of it); a sink that is not registered is ignored, so that teardown
    code may call this unconditionally. Stats emitted concurrently may still reach it once more."""
    _REGISTRY.remove(sink)


@contextmanager
def sinks(*s: StatSink) -> Iterator[tuple[StatSink, ...]]:
    """Register the sinks for the ``with`` block, and remove them at its end (also on an exception)."""
    removers = [add_sink(sink) for sink in s]
    try:
        yield s
    finally:
        for remove in removers:
            remove()


def registered() -> tuple[StatSink, ...]:
    """The registered sinks, in registration order."""
    return _REGISTRY.snapshot()


def active() -> bool:
    """Whether any sink is registered: callers test it before building a stat nobody would receive.

    One attribute read, no lock: the tuple is replaced, never mutated, so the read is always consistent (at worst
    one stat is built for a sink just removed, or skipped for one being added).
    """
    return bool(_REGISTRY.sinks)


def emit(stat: Stat) -> None:
    """Hand ``stat`` to every registered sink, in registration order.

    Never raises because of a sink: a sink's exception is logged (once per sink type, at WARNING, with its
    traceback) and the remaining sinks still get the stat. The sinks run on the calling thread, outside the
    registry's lock.
    """
    current = _REGISTRY.snapshot()
    for sink in current:
        try:
            sink.record(stat)
        except Exception:  # noqa: BLE001 - metrics must never fail the engine
            if _REGISTRY.first_failure(sink):
                _log.warning(
                    "stats sink %s failed on a %s stat; further failures of this sink type are not logged",
                    type(sink).__qualname__, stat_kind(stat), exc_info=True,
                )


def fault(kind: str, session_id: str | None, detail: str) -> None:
    """Emit a :class:`FaultStat` (nothing is built when no sink listens)."""
    if active():
        emit(FaultStat(kind, session_id, detail))


# ---------------------------------------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------------------------------------


class Counter:
    """An in-memory aggregator: counts of each stat kind and the sums the tests and bench commands read.

    Thread-safe: :meth:`record` and :meth:`to_dict` take a lock, so concurrent emitters lose no update and a
    snapshot is consistent. Attributes may be read directly once the emitters are done.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every count and sum."""
        with self._lock:
            self.counts: dict[str, int] = {}  # stat kind (see stat_kind) -> stats received
            self.turns = 0
            self.replayed_turns = 0
            self.prompt_tokens = 0
            self.prefilled_tokens = 0
            self.decoded_tokens = 0
            self.reprefills = 0
            self.recalled_slots = 0
            self.tier_events: dict[str, int] = {}  # TierEvent.kind -> events
            self.tier_bytes: dict[str, int] = {}  # TierEvent.kind -> bytes
            self.decode_steps = 0
            self.decode_tokens = 0
            self.faults: dict[str, int] = {}  # FaultStat.kind -> faults

    def record(self, stat: Stat) -> None:
        kind = stat_kind(stat)
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if isinstance(stat, TurnStat):
                self.turns += 1
                self.replayed_turns += stat.replay
                self.prompt_tokens += stat.prompt_tokens
                self.prefilled_tokens += stat.prefilled_tokens
                self.decoded_tokens += stat.decoded_tokens
                self.reprefills += stat.decision == "reprefill"
                self.recalled_slots += stat.recalled_slots
            elif isinstance(stat, TierEvent):
                self.tier_events[stat.kind] = self.tier_events.get(stat.kind, 0) + 1
                self.tier_bytes[stat.kind] = self.tier_bytes.get(stat.kind, 0) + stat.nbytes
            elif isinstance(stat, DecodeStepStat):
                self.decode_steps += 1
                self.decode_tokens += stat.tokens
            elif isinstance(stat, FaultStat):
                self.faults[stat.kind] = self.faults.get(stat.kind, 0) + 1

    def count(self, kind: str) -> int:
        """Stats of one kind received (``"turn"``, ``"tier"``, ... as :func:`stat_kind` names them)."""
        with self._lock:
            return self.counts.get(kind, 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot (copies: later stats do not change it)."""
        with self._lock:
            return {
                "counts": dict(sorted(self.counts.items())),
                "turns": self.turns,
                "replayed_turns": self.replayed_turns,
                "prompt_tokens": self.prompt_tokens,
                "prefilled_tokens": self.prefilled_tokens,
                "decoded_tokens": self.decoded_tokens,
                "reprefills": self.reprefills,
                "recalled_slots": self.recalled_slots,
                "tier": {k: {"events": n, "bytes": self.tier_bytes[k]} for k, n in sorted(self.tier_events.items())},
                "decode_steps": self.decode_steps,
                "decode_tokens": self.decode_tokens,
                "faults": dict(sorted(self.faults.items())),
            }


_LOGGED_TIER_KINDS = frozenset({"lost", "spilled", "evicted"})  # the rest are routine, one per turn or more


def _short(session_id: str | None) -> str:
    # The first 8 characters name a session in a log line (the full id is in the record's stat dict).
    return session_id[:8] if session_id else "-"


class LogSink:
    """Writes one log record per :class:`TurnStat`, :class:`FaultStat` and lost/spilled/evicted
    :class:`TierEvent` to the ``snapkv_sessions.stats`` logger; other stats are ignored (too many per turn).

    Each record has a one-line human-readable message and the stat's fields as ``extra={"stat": {...},
    "stat_type": "turn"}``, which :class:`JsonFormatter` renders. Turns log at ``level`` (INFO), faults and lost
    cold KV at WARNING. Nothing is built when the logger would drop the record.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or logging.getLogger(STATS_LOGGER)
        self.level = level

    def record(self, stat: Stat) -> None:
        if isinstance(stat, TurnStat):
            level = self.level
            decision = f"{stat.decision} ({stat.reprefill_reason})" if stat.reprefill_reason else stat.decision
            msg, args = "turn %d of %s%s: %s, %d prefilled, %d decoded, %.2f s", (
                stat.turn, _short(stat.session_id), " (replay)" if stat.replay else "", decision,
                stat.prefilled_tokens, stat.decoded_tokens, stat.total_s)
        elif isinstance(stat, FaultStat):
            level = logging.WARNING
            msg, args = "fault %s in %s: %s", (stat.kind, _short(stat.session_id), stat.detail)
        elif isinstance(stat, TierEvent) and stat.kind in _LOGGED_TIER_KINDS:
            level = logging.WARNING if stat.kind == "lost" else self.level
            msg, args = "tier %s in %s: %d slots, %d bytes%s", (
                stat.kind, _short(stat.session_id), stat.slots, stat.nbytes,
                f" ({stat.reason})" if stat.reason else "")
        else:
            return
        if self.logger.isEnabledFor(level):  # asdict copies every field: skip it for a record that is dropped
            self.logger.log(level, msg, *args, extra={"stat": dataclasses.asdict(stat), "stat_type": stat_kind(stat)})


# ---------------------------------------------------------------------------------------------------------------
# Logging setup
# ---------------------------------------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """Renders a record as one JSON line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, and the
    ``stat`` dict and ``stat_type`` when the record has them (``exc`` with a traceback). Never raises: odd values
    are rendered with ``str``, and a record that still cannot be encoded is rendered without its stat."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad %-format in someone's log call must not lose the record
            message = f"{record.msg!s} {record.args!s}"
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        stat = getattr(record, "stat", None)
        if stat is not None:
            payload["stat"] = stat
            stat_type = getattr(record, "stat_type", None)
            if stat_type is not None:
                payload["stat_type"] = stat_type
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            payload["exc"] = record.exc_text
        try:
            return json.dumps(payload, default=str)
        except (TypeError, ValueError):
            # non-str dict keys or a reference cycle in the stat: keep the line, with the stat as text
            payload["stat"] = repr(payload.get("stat"))[:FAULT_DETAIL_LIMIT]
            return json.dumps(payload, default=str)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StreamHandler(logging.StreamHandler):
    """The handler :func:`configure_logging` installs: its own class, so a second call finds it (and replaces
    nothing that the application installed itself)."""


def configure_logging(level: str = "INFO", fmt: Literal["text", "json"] = "text") -> None:
    """Log the ``snapkv_sessions`` loggers to stderr at ``level``, as text lines or JSON lines.

    Idempotent: a second call reconfigures the one handler it installed (level, format, current ``sys.stderr``)
    rather than adding another. Records still propagate to the root logger, as the application configured it.

    Raises
    ------
    ConfigError: ``level`` is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case), or ``fmt`` is not
        ``"text"`` or ``"json"``.
    """
    if not isinstance(level, str) or level.upper() not in _LEVELS:
        raise ConfigError("level", level, f"must be one of {', '.join(_LEVELS)}")
    if fmt not in _FORMATS:
        raise ConfigError("fmt", fmt, f"must be one of {', '.join(_FORMATS)}")
    logger = logging.getLogger(PACKAGE_LOGGER)
    handler = next((h for h in logger.handlers if isinstance(h, _StreamHandler)), None)
    if handler is None:
        handler = _StreamHandler(sys.stderr)
        logger.addHandler(handler)
    else:
        handler.setStream(sys.stderr)  # a test harness (or a daemon) may have replaced stderr since
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    logger.setLevel(level.upper())
