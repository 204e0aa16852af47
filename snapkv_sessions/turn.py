"""What a turn produces: the :class:`Reply` a caller gets, and the record the turns table stores."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from . import stats
from .drift import Assessment
from .errors import ConfigError
from .generation import cut_at_stop
from .report import CompressionReport
from .runner import TurnResult
from .store.blobs import pack_positions
from .transcript import MASKED, TurnPlan


@dataclass
class Reply:
    """What one turn produced."""

    text: str
    turn: int
    session_id: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int
    cache_tokens: list[int]
    kept_per_role: dict[str, float]
    timings: dict[str, float]
    report: CompressionReport | None
    stop_reason: str
    events: list[tuple[str, dict]] = field(default_factory=list)

    @classmethod
    def of_turn(cls, session_id: str, turn: int, text: str, plan: TurnPlan, tokens: list[int],
                reply_tokens: tuple[list[int], list[int]], kept_per_role: dict[str, float], timings: dict[str, float],
                stop_reason: str, *, report: CompressionReport | None = None, cache_tokens: list[int] | None = None,
                events: list[tuple[str, dict]] | None = None) -> Reply:
        """The reply of a turn that ran ``plan``: ``tokens`` the reply's ids, ``reply_tokens`` (decoded into the
        cache, left pending). A live turn and a stored one (:func:`stored_reply`) are built here alike."""
        decoded, pending = reply_tokens
        return cls(text=text, turn=turn, session_id=session_id, token_ids=tokens, prompt_tokens=len(plan.tokens),
                   completion_tokens=len(tokens), context_tokens=plan.end_position + len(decoded) + len(pending),
                   cache_tokens=cache_tokens or [], kept_per_role=kept_per_role, timings=timings, report=report,
                   stop_reason=stop_reason, events=events or [])


@dataclass(frozen=True)
class TurnOutcome:
    """A live turn's bookkeeping beside its plan and run: whose turn, the drift decision, events, timings."""

    turn: int
    user_seq: int
    assessment: Assessment
    decision: str
    events: list[tuple[str, dict]]
    timings: dict[str, float]

    def record(self, plan: TurnPlan, result: TurnResult, reply_tokens: tuple[list[int], list[int]],
               kept: list[np.ndarray] | None, kept_per_role: dict[str, float]) -> dict:
        """The turns table's columns for this turn. ``reply_tokens``: (decoded into the cache, left pending);
        ``kept[l]``: (Hkv, K) true positions held by layer l after the compression, None when none ran."""
        report = result.report
        segments = plan.to_record()
        if result.protect_applied is not None:
            segments["protect_applied"] = result.protect_applied
        if result.chunks is not None:  # a replay feeds the same chunks (they change the last bits)
            segments["chunks"] = result.chunks
        if result.attention != MASKED:  # and attends the same way (a record without it: masked)
            segments["attention"] = result.attention
        return {
            "prefill_tokens": list(plan.tokens), "decode_tokens": reply_tokens[0], "pending_tokens": reply_tokens[1],
            "segments": segments, "tokens_in": len(plan.tokens), "tokens_out": len(result.tokens),
            "kept_per_role": kept_per_role, "retention": report.retention() if report else None,
            "kept_positions": pack_positions(kept) if kept is not None else None,
            "compression": report.to_dict() if report else None, "drift_score": self.assessment.score,
            "drift_decision": self.decision, "timings": self.timings, "stop_reason": result.stop_reason,
        }

    def all_events(self, report: CompressionReport | None) -> list[tuple[str, dict]]:
        """The turn's events, its compression's (when one evicted anything) last."""
        if report is None or not report.compressed:
            return list(self.events)
        return [*self.events, ("compression", {k: v for k, v in report.to_dict().items()
                                               if k not in ("kept", "kept_new")})]


@dataclass(frozen=True)
class TurnFigures:
    """What a live turn's stat carries besides the plan and result (:func:`emit_turn`): per role, the share kept
    and the pinned tokens with their retention; the kept set's Jaccard with the previous turn's."""

    kept_per_role: dict[str, float]
    pinned_per_role: dict[str, tuple[int, float]]
    kept_jaccard: float | None


def kept_jaccard(before: list[np.ndarray], now: list[np.ndarray], seen: int) -> float:
    """How stable the kept set is between two compressions: per layer and KV head, |A and B| / |A or B| of the
    true positions ``before`` kept and those ``now`` keeps among the first ``seen`` (the positions ``before``
    could keep), mean over layers and heads. Each is per layer (Hkv, K), -1 at padding."""
    shares = []
    for old, new in zip(before, now, strict=True):  # (Hkv, K), (Hkv, K')
        for a, b in zip(old, new, strict=True):
            a, b = a[a >= 0], b[(b >= 0) & (b < seen)]
            union = np.union1d(a, b).size
            shares.append(np.intersect1d(a, b).size / union if union else 1.0)
    return round(float(np.mean(shares)), 4)


def emit_turn(session_id: str, turn: int, model: str, decision: str, reason: str | None, plan: TurnPlan,
              result: TurnResult, state, replay: bool, figures: TurnFigures | None = None) -> None:
    """A finished turn to the stats stream (:mod:`snapkv_sessions.stats`): its :class:`~stats.TurnStat`, its
    compression's and the tier's streamed and recalled slots; nothing is built when no sink listens."""
    if not stats.active():
        return
    report = result.report
    tier = (report.tier if report is not None else None) or {}
    recall = tier.get("recall") or {}
    reads = recall.get("read_bytes_per_step") or {}
    hot = tier.get("hot_bytes", report.kv_bytes_after if report is not None else state.kv_bytes())
    stats.emit(stats.TurnStat(
        session_id, turn, model, decision, reason, len(plan.tokens), result.prefilled, len(result.tokens),
        result.prefill_end, tuple(report.tokens_after if report is not None else state.cache_lengths()),
        result.prefill_ms / 1e3, result.decode_ms / 1e3, report.total_ms / 1e3 if report is not None else 0.0,
        int(tier.get("recalled", 0)), int(hot), int(tier.get("cold_bytes", 0)), replay,
        kept_per_role=tuple(figures.kept_per_role.items()) if figures else (),
        pinned_per_role=tuple((r, n, kept) for r, (n, kept) in figures.pinned_per_role.items()) if figures else (),
        kept_jaccard=figures.kept_jaccard if figures else None,
        recall_repeat_rate=recall.get("repeat_rate"),
        recall_bytes_per_step=int(reads.get("select", 0) + reads.get("recalled", 0) + reads.get("escalated", 0)),
        summary_bytes=int(recall.get("summary_bytes", 0)), recall_steps=int(recall.get("steps", 0)),
        recall_escalated=int(recall.get("escalated", 0))))
    if report is not None:
        stats.emit(stats.CompressionStat.from_report(report))
    if tier.get("streamed_bytes"):
        stats.emit(stats.TierEvent("streamed", session_id, int(tier["streamed_bytes"]), 0, None))
    if tier.get("recalled"):
        stats.emit(stats.TierEvent("recalled", session_id, 0, int(tier["recalled"]), None))


def stored_reply(store, session_id: str, turn: int | None = None) -> Reply:
    """The reply of done turn ``turn`` (default the last one), as the store holds it (a retried request is
    answered with it)."""
    rows = {rec.turn: rec for rec in store.turns(session_id, status="done")}
    turn = max(rows, default=None) if turn is None else turn
    if turn not in rows:
        raise ConfigError("turn", turn, f"is not a done turn of session {session_id}")
    rec = rows[turn]
    content = next(m.content for m in store.messages(session_id) if m.seq == rec.assistant_seq)
    text = cut_at_stop(content, (rec.generation or {}).get("stop") or ())  # as the live reply showed it
    decoded, pending = list(rec.decode_tokens or []), list(rec.pending_tokens or [])
    tokens = decoded + (pending if rec.stop_reason != "eos" else [])
    plan = TurnPlan.from_record(rec.segments, rec.prefill_tokens)
    return Reply.of_turn(session_id, turn, text, plan, tokens, (decoded, pending), rec.kept_per_role or {},
                         rec.timings or {}, rec.stop_reason or "length")


def close_failed(store, session_id: str, turn: int, exc: BaseException) -> None:
    """Record a failed turn as abandoned, if the store can; else it stays pending, and the next use of the
    session resolves it by the pending rules. Never raises: the caller's own error is the one to report."""
    reason = "stream closed before the reply" if isinstance(exc, GeneratorExit) else type(exc).__name__
    error = {"type": type(exc).__name__, "message": str(exc)[:2000]} if isinstance(exc, Exception) else None
    try:
        store.abandon_turn(session_id, turn, reason=reason, error=error)
    except Exception as store_exc:  # noqa: BLE001 - the store is failing too; the turn stays pending
        warnings.warn(f"turn {turn} could not be closed ({type(store_exc).__name__}); it stays pending and is "
                      "resolved when the session is next used", RuntimeWarning, stacklevel=3)
