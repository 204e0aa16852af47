"""The stats stream (snapkv_sessions.stats): registry, sinks, the JSON log format and configure_logging. No model."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import threading
from datetime import datetime, timedelta

import pytest

from snapkv_sessions import stats
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.report import CompressionReport
from snapkv_sessions.stats import (
    CompressionStat,
    Counter,
    DecodeStepStat,
    FaultStat,
    JsonFormatter,
    LogSink,
    SchedulerStepStat,
    Stat,
    TierEvent,
    TurnStat,
)


def turn(n: int = 3, **overrides: object) -> TurnStat:
    fields: dict[str, object] = dict(
        session_id="1a2b3c4d-0000-4000-8000-000000000000", turn=n, model="tiny-llama", decision="tiered",
        reprefill_reason=None, prompt_tokens=30, prefilled_tokens=41, decoded_tokens=12, context_tokens=300,
        hot_tokens=(64, 64, 80), prefill_s=0.25, decode_s=0.15, compression_s=0.02, recalled_slots=5,
        hot_bytes=4096, cold_bytes=8192, replay=False,
    )
    fields.update(overrides)
    return TurnStat(**fields)  # type: ignore[arg-type]


def tier(kind: str = "streamed", nbytes: int = 1024, slots: int = 8, reason: str | None = None) -> TierEvent:
    return TierEvent(kind=kind, session_id="1a2b3c4d", nbytes=nbytes, slots=slots, reason=reason)  # type: ignore[arg-type]


class ListSink:
    def __init__(self) -> None:
        self.got: list[Stat] = []

    def record(self, stat: Stat) -> None:
        self.got.append(stat)


@pytest.fixture(autouse=True)
def clean_registry():
    """Every test starts with no sink, and whatever a test leaves registered is removed."""
    for sink in stats.registered():
        stats.remove_sink(sink)
    yield
    for sink in stats.registered():
        stats.remove_sink(sink)


@pytest.fixture
def package_logger():
    """The package logger's handlers and level, restored after a test that reconfigures them."""
    logger = logging.getLogger("snapkv_sessions")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture
def json_lines():
    """The ``snapkv_sessions.stats`` logger at INFO into a buffer through JsonFormatter; yields a reader."""
    logger = logging.getLogger("snapkv_sessions.stats")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in buf.getvalue().splitlines()]
    logger.removeHandler(handler)
    logger.setLevel(level)


# --- the registry -----------------------------------------------------------------------------------------------


def test_sink_receives_exactly_the_emitted_stats_in_order():
    sink = ListSink()
    sent: list[Stat] = [
        turn(0), tier("recalled"), DecodeStepStat(batch_size=4, tokens=4, seconds=0.01, kv_bytes_read=1 << 20),
        SchedulerStepStat(running=4, waiting=1, calls=2, step_s=0.012), FaultStat("store_retry", None, "timeout"),
        turn(1),
    ]
    stats.add_sink(sink)
    for s in sent:
        stats.emit(s)
    assert sink.got == sent
    assert all(a is b for a, b in zip(sink.got, sent, strict=True))  # the stat itself, not a copy


def test_remover_and_context_manager_remove_the_sink():
    a, b = ListSink(), ListSink()
    remove = stats.add_sink(a)
    stats.emit(turn(0))
    remove()
    remove()  # a second call is harmless, and does not remove another registration
    stats.emit(turn(1))
    assert [s.turn for s in a.got] == [0]
    assert stats.registered() == ()

    with stats.sinks(a, b) as added:
        assert added == (a, b)
        assert stats.registered() == (a, b)
        stats.emit(turn(2))
    stats.emit(turn(3))
    assert [s.turn for s in a.got] == [0, 2]
    assert [s.turn for s in b.got] == [2]
    assert stats.registered() == ()

    with pytest.raises(RuntimeError), stats.sinks(a):
        raise RuntimeError("boom")
    assert stats.registered() == ()  # removed on an exception too

    stats.add_sink(a)
    stats.remove_sink(a)
    stats.remove_sink(a)  # not registered: ignored
    assert stats.registered() == ()


def test_raising_sink_does_not_break_emit_and_warns_once(caplog):
    class Broken:
        def record(self, stat: Stat) -> None:
            raise ValueError("sink bug")

    before, after = ListSink(), ListSink()
    stats.add_sink(before)
    stats.add_sink(Broken())
    stats.add_sink(Broken())  # a second sink of the same type: still one warning
    stats.add_sink(after)
    with caplog.at_level(logging.WARNING, logger="snapkv_sessions"):
        for n in range(3):
            stats.emit(turn(n))  # never raises
    assert [s.turn for s in before.got] == [0, 1, 2]
    assert [s.turn for s in after.got] == [0, 1, 2]
    warnings = [r for r in caplog.records if r.name == "snapkv_sessions" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Broken" in warnings[0].getMessage() and "turn" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None and "sink bug" in str(warnings[0].exc_info[1])


def test_active_tells_whether_anyone_listens():
    assert stats.active() is False
    remove = stats.add_sink(ListSink())
    assert stats.active() is True
    remove()
    assert stats.active() is False
    stats.emit(turn())  # no sink: a no-op


def test_sinks_may_emit_and_register_from_record():
    # emit calls the sinks outside the registry lock, so a sink may re-enter the registry without deadlocking
    late = ListSink()

    class Reentrant:
        def record(self, stat: Stat) -> None:
            if isinstance(stat, TurnStat):
                stats.add_sink(late)
                stats.emit(FaultStat("turn_failed", stat.session_id, "nested"))

    stats.add_sink(Reentrant())
    stats.emit(turn())
    assert [type(s) for s in late.got] == [FaultStat]  # the snapshot taken for the turn did not include it


def test_concurrent_emits_reach_a_counter_exactly():
    counter = Counter()
    stats.add_sink(counter)
    threads, per_thread = 8, 500
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            if i % 2 == 0:
                stats.emit(turn(i, prompt_tokens=1, prefilled_tokens=2, decoded_tokens=3, recalled_slots=1,
                                decision="reprefill" if i % 10 == 0 else "kept"))
            elif i % 4 == 1:
                stats.emit(DecodeStepStat(batch_size=t + 1, tokens=t + 1, seconds=0.001, kv_bytes_read=0))
            else:
                stats.emit(tier("lost", nbytes=100, reason="memory_limit"))

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()

    turns, steps, losses = threads * per_thread // 2, threads * per_thread // 4, threads * per_thread // 4
    out = counter.to_dict()
    assert out["counts"] == {"decode_step": steps, "tier": losses, "turn": turns}
    assert sum(out["counts"].values()) == threads * per_thread
    assert (out["prompt_tokens"], out["prefilled_tokens"], out["decoded_tokens"]) == (turns, 2 * turns, 3 * turns)
    assert out["recalled_slots"] == turns
    assert out["reprefills"] == threads * (per_thread // 10)
    assert out["decode_steps"] == steps
    assert out["decode_tokens"] == sum((t + 1) * (per_thread // 4) for t in range(threads))
    assert out["tier"] == {"lost": {"events": losses, "bytes": 100 * losses}}


# --- Counter ----------------------------------------------------------------------------------------------------


def test_counter_sums_are_exact_for_a_known_sequence():
    counter = Counter()
    with stats.sinks(counter):
        stats.emit(turn(0, decision="kept", prompt_tokens=100, prefilled_tokens=100, decoded_tokens=20, recalled_slots=0))
        stats.emit(turn(1, decision="tiered", prompt_tokens=30, prefilled_tokens=230, decoded_tokens=15, recalled_slots=7))
        stats.emit(turn(2, decision="reprefill", reprefill_reason="shift", prompt_tokens=25, prefilled_tokens=400,
                        decoded_tokens=10, recalled_slots=0))
        stats.emit(turn(3, decision="kept", prompt_tokens=5, prefilled_tokens=5, decoded_tokens=1, recalled_slots=2,
                        replay=True))
        stats.emit(tier("streamed", nbytes=1000))
        stats.emit(tier("streamed", nbytes=500))
        stats.emit(tier("recalled", nbytes=64))
        stats.emit(tier("evicted", nbytes=2048, reason="memory_limit"))
        stats.emit(DecodeStepStat(batch_size=3, tokens=3, seconds=0.01, kv_bytes_read=10))
        stats.emit(DecodeStepStat(batch_size=2, tokens=1, seconds=0.01, kv_bytes_read=10))
        stats.emit(SchedulerStepStat(running=3, waiting=0, calls=1, step_s=0.02))
        stats.emit(CompressionStat(context_tokens=100, window=8, budgets=(32, 32), kept=((32, 32), (32, 32)),
                                   score_s=0.001, select_s=0.002, gather_s=0.003, history_attention=None))
        stats.emit(FaultStat("store_retry", "1a2b3c4d", "database is locked"))
        stats.emit(FaultStat("store_retry", "1a2b3c4d", "database is locked"))
        stats.emit(FaultStat("tier_lost", None, "host memory"))

    expected = {
        "counts": {"compression": 1, "decode_step": 2, "fault": 3, "scheduler_step": 1, "tier": 4, "turn": 4},
        "turns": 4,
        "replayed_turns": 1,
        "prompt_tokens": 160,
        "prefilled_tokens": 735,
        "decoded_tokens": 46,
        "reprefills": 1,
        "recalled_slots": 9,
        "tier": {"evicted": {"events": 1, "bytes": 2048}, "recalled": {"events": 1, "bytes": 64},
                 "streamed": {"events": 2, "bytes": 1500}},
        "decode_steps": 2,
        "decode_tokens": 4,
        "faults": {"store_retry": 2, "tier_lost": 1},
    }
    out = counter.to_dict()
    assert out == expected
    assert json.loads(json.dumps(out)) == expected  # JSON-ready as it is
    assert counter.count("turn") == 4 and counter.count("nothing") == 0

    out["counts"]["turn"] = 99  # a snapshot, not a view
    assert counter.to_dict()["counts"]["turn"] == 4
    counter.reset()
    assert counter.to_dict()["counts"] == {} and counter.prefilled_tokens == 0


# --- the stats themselves ---------------------------------------------------------------------------------------


def test_fault_detail_is_truncated_to_500_characters():
    long = FaultStat("turn_failed", "s", "x" * 10_000)
    assert len(long.detail) == 500 and long.detail.endswith("...")
    exact = FaultStat("turn_failed", "s", "y" * 500)
    assert exact.detail == "y" * 500  # at the limit: untouched
    assert FaultStat("store_retry", None, "short").detail == "short"
    with pytest.raises(dataclasses.FrozenInstanceError):
        long.detail = "z"  # type: ignore[misc]


def test_stats_are_frozen_and_slotted():
    for stat in (turn(), tier(), FaultStat("k", None, "d"), SchedulerStepStat(1, 0, 0, 0.0),
                 DecodeStepStat(1, 1, 0.0, 0)):
        assert not hasattr(stat, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(stat, dataclasses.fields(stat)[0].name, None)  # a field: a non-field name trips a CPython slots bug
    assert turn().total_s == pytest.approx(0.42)


def test_compression_stat_from_report_converts_units():
    report = CompressionReport(context_tokens=200, window=8, budgets=[40, 48], tokens_before=[200, 200],
                               tokens_after=[40, 48], kept=[[40, 40], [48, 48]], score_ms=1.5, select_ms=2.0,
                               gather_ms=0.5, history_attention=0.25)
    stat = CompressionStat.from_report(report)
    assert stat.budgets == (40, 48) and stat.kept == ((40, 40), (48, 48))
    assert (stat.score_s, stat.select_s, stat.gather_s) == pytest.approx((0.0015, 0.002, 0.0005))
    assert stat.history_attention == 0.25 and stat.context_tokens == 200 and stat.window == 8


# --- LogSink and JsonFormatter ----------------------------------------------------------------------------------


def test_logsink_and_json_formatter_write_one_json_line_per_turn(json_lines):
    with stats.sinks(LogSink()):
        stats.emit(turn(3))
        stats.emit(DecodeStepStat(batch_size=1, tokens=1, seconds=0.01, kv_bytes_read=0))  # not logged
        stats.emit(SchedulerStepStat(running=1, waiting=0, calls=0, step_s=0.01))  # not logged
        stats.emit(tier("streamed"))  # routine: not logged
        stats.emit(turn(4, decision="reprefill", reprefill_reason="shift", replay=True))
    lines = json_lines()
    assert len(lines) == 2
    first, second = lines
    assert first["message"] == "turn 3 of 1a2b3c4d: tiered, 41 prefilled, 12 decoded, 0.42 s"
    assert second["message"] == "turn 4 of 1a2b3c4d (replay): reprefill (shift), 41 prefilled, 12 decoded, 0.42 s"
    assert first["level"] == "INFO" and first["logger"] == "snapkv_sessions.stats"
    assert first["stat_type"] == "turn"
    assert first["stat"] == json.loads(json.dumps(dataclasses.asdict(turn(3))))  # every field, tuples as lists
    assert first["stat"]["hot_tokens"] == [64, 64, 80] and first["stat"]["session_id"].startswith("1a2b3c4d")
    when = datetime.fromisoformat(first["time"])
    assert when.utcoffset() == timedelta(0)


def test_logsink_logs_faults_and_tier_losses_at_warning(json_lines):
    with stats.sinks(LogSink()):
        stats.emit(FaultStat("store_retry", "1a2b3c4d-ffff", "database is locked"))
        stats.emit(tier("lost", nbytes=4096, slots=12, reason="memory_limit"))
        stats.emit(tier("spilled", nbytes=2048, slots=6))
        stats.emit(tier("evicted", nbytes=1024, slots=3, reason="idle"))
        stats.emit(tier("restored"))  # routine: not logged
    lines = json_lines()
    assert [(x["level"], x["stat_type"]) for x in lines] == [("WARNING", "fault"), ("WARNING", "tier"),
                                                            ("INFO", "tier"), ("INFO", "tier")]
    assert lines[0]["message"] == "fault store_retry in 1a2b3c4d: database is locked"
    assert lines[1]["message"] == "tier lost in 1a2b3c4d: 12 slots, 4096 bytes (memory_limit)"
    assert lines[2]["message"] == "tier spilled in 1a2b3c4d: 6 slots, 2048 bytes"
    assert lines[1]["stat"] == {"kind": "lost", "session_id": "1a2b3c4d", "nbytes": 4096, "slots": 12,
                                "reason": "memory_limit"}


def test_logsink_builds_nothing_when_the_logger_drops_the_record(monkeypatch):
    logger = logging.getLogger("snapkv_sessions.stats")
    level = logger.level
    calls: list[object] = []
    monkeypatch.setattr(stats.dataclasses, "asdict", lambda s: calls.append(s) or {})
    logger.setLevel(logging.ERROR)
    try:
        LogSink().record(turn())
    finally:
        logger.setLevel(level)
    assert calls == []


def test_json_formatter_never_raises_on_odd_values():
    fmt = JsonFormatter()

    def record(**extra: object) -> logging.LogRecord:
        rec = logging.LogRecord("snapkv_sessions.x", logging.INFO, __file__, 1, "value %d", ("not a number",), None)
        rec.__dict__.update(extra)
        return rec

    odd = json.loads(fmt.format(record(stat={"obj": object(), "set": {1, 2}, "bytes": b"\x00"})))
    assert odd["message"].startswith("value") and "obj" in odd["stat"]
    cyclic: dict[str, object] = {}
    cyclic["self"] = cyclic
    assert "self" in json.loads(fmt.format(record(stat=cyclic)))["stat"]  # rendered as text
    assert isinstance(json.loads(fmt.format(record(stat={(1, 2): "tuple key"})))["stat"], str)
    try:
        raise KeyError("why")
    except KeyError:
        import sys

        rec = logging.LogRecord("snapkv_sessions", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = fmt.format(rec)
    assert "\n" not in line and "KeyError" in json.loads(line)["exc"]


# --- configure_logging ------------------------------------------------------------------------------------------


def test_configure_logging_is_idempotent(package_logger, capsys):
    ours = [h for h in package_logger.handlers if isinstance(h, stats._StreamHandler)]
    stats.configure_logging("info")
    stats.configure_logging("DEBUG", fmt="json")
    mine = [h for h in package_logger.handlers if isinstance(h, stats._StreamHandler)]
    assert len(mine) == 1 and len(package_logger.handlers) == len(ours) + (0 if ours else 1)
    assert package_logger.level == logging.DEBUG
    assert isinstance(mine[0].formatter, JsonFormatter)

    logging.getLogger("snapkv_sessions.stats").debug("hello %s", "json")
    err = capsys.readouterr().err.strip().splitlines()
    assert json.loads(err[-1])["message"] == "hello json"

    stats.configure_logging("WARNING", fmt="text")
    assert len([h for h in package_logger.handlers if isinstance(h, stats._StreamHandler)]) == 1
    assert not isinstance(mine[0].formatter, JsonFormatter) and package_logger.level == logging.WARNING


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"level": "LOUD"}, "level"),
    ({"level": 10}, "level"),
    ({"level": ""}, "level"),
    ({"fmt": "xml"}, "fmt"),
])
def test_configure_logging_rejects_bad_arguments(package_logger, kwargs, param):
    handlers = list(package_logger.handlers)
    with pytest.raises(ConfigError) as info:
        stats.configure_logging(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    assert package_logger.handlers == handlers  # nothing installed on a rejected call


def test_pinned_per_role_counts_the_head_holding_fewest_pins():
    """Pinned positions per role and their retention, on a constructed transcript: 4 system positions (0-3, all
    pinned), 4 user positions (4-7, 6 pinned); the retention is the share held by the layer and head holding fewest."""
    import numpy as np
    from conftest import word_tokenizer

    from snapkv_sessions.policy import PinPolicy
    from snapkv_sessions.transcript import Transcript

    transcript = Transcript(word_tokenizer(), PinPolicy())
    transcript.runs = [(1, 0, 4), (2, 4, 8)]
    roles = {1: "system", 2: "user"}
    pinned = np.array([True] * 4 + [False, False, True, False])
    every = [np.array([[0, 1, 2, 3, 6, 7], [0, 1, 2, 3, 5, 6]])]  # one layer, two heads: every pin held
    assert transcript.pinned_per_role(every, 8, roles, pinned) == {"system": (4, 1.0), "user": (1, 1.0)}
    # a second layer whose second head lost system position 2 (and holds -1 padding)
    lossy = [*every, np.array([[0, 1, 2, 3, 6, -1], [0, 1, 3, 6, -1, -1]])]
    assert transcript.pinned_per_role(lossy, 8, roles, pinned) == {"system": (4, 0.75), "user": (1, 1.0)}
    # positions past the context are not counted; nothing pinned: nothing to report
    assert transcript.pinned_per_role(every, 4, roles, pinned) == {"system": (4, 1.0)}
    assert transcript.pinned_per_role(every, 8, roles, np.zeros(8, dtype=bool)) == {}


def test_kept_jaccard_compares_the_positions_both_turns_saw():
    import numpy as np

    from snapkv_sessions.turn import kept_jaccard

    before = [np.array([[0, 1, 2, 3], [0, 1, 2, -1]])]  # one layer, two heads; -1: padding
    now = [np.array([[0, 1, 2, 3, 8, 9], [0, 4, 5, 8, 9, -1]])]  # 8 and 9 are new: not seen before
    # head 0: {0,1,2,3} vs {0,1,2,3}: 1.0; head 1: {0,1,2} vs {0,4,5}: 1/5
    assert kept_jaccard(before, now, seen=8) == 0.6
    assert kept_jaccard(before, before, seen=8) == 1.0
