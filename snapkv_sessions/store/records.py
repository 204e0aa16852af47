"""Typed rows of the store: what :class:`~snapkv_sessions.store.SessionStore` hands back.

One frozen dataclass per table, its fields the table's columns (``schema.py``), each documented here: this is the
turn record's schema, in one place. Code reads attributes (``rec.turn``, ``rec.decode_tokens``). A record also
reads as a read-only mapping (``rec["turn"]``, ``rec.get("owner")``, ``dict(rec)``), so callers written against
the plain dicts the store returned before keep working; :meth:`Record.to_dict` gives plain data for JSON.
Torch-free, like the rest of the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Record")


class Record(Mapping):
    """A frozen row; a read-only mapping of its columns as well."""

    _fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_row(cls: type[R], row: Mapping[str, Any]) -> R:
        """The record of a database row (a SQLAlchemy mapping); columns the record does not name are refused, so a
        schema change cannot pass by unnoticed."""
        unknown = set(row) - set(cls._fields)
        if unknown:
            raise TypeError(f"{cls.__name__}: columns {sorted(unknown)} are not fields of the record")
        return cls(**row)

    def __getitem__(self, key: str) -> Any:
        if key not in self._fields:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}


def _record(cls: type[R]) -> type[R]:
    """A frozen dataclass record whose mapping keys are its fields."""
    out = dataclasses.dataclass(frozen=True, eq=False)(cls)  # equality: Mapping's, so a record equals its dict
    out._fields = tuple(f.name for f in dataclasses.fields(out))
    return out


@_record
class SessionRecord(Record):
    """A session. ``turns_done``: done turns; ``head_hash``: the last message's hash (the chain's head);
    ``message_count``: messages in the chain (a deleted last message shows); ``seal``: the row's keyed seal over its
    sealed columns; ``owner``: the server key's digest that may use it (None: anyone local); ``meta``: free data
    (``model_fingerprint``); ``messages``: set by :meth:`SessionStore.list_sessions` only (its message count)."""

    id: str
    created_at: datetime
    updated_at: datetime
    model_id: str
    policy_json: str
    policy_sha256: str
    title: str | None
    turns_done: int
    head_hash: str
    meta: dict
    thread_id: str | None = None
    message_count: int | None = None
    seal: str | None = None
    owner: str | None = None
    messages: int | None = None


@_record
class MessageRecord(Record):
    """A message. ``seq``: its place in the session (1, 2, ...); ``status``: ``active`` or ``abandoned`` (the user
    message of a turn that failed); ``turn``: the turn it started or answered; ``token_count``: content tokens,
    counted once at commit; ``pins``: :class:`~snapkv_sessions.chat.MessagePins` as JSON; ``prev_hash``/``hash``:
    the chain; ``token_start``/``token_end``: unused since the turn plans record positions."""

    id: int
    session_id: str
    seq: int
    role: str
    name: str | None
    content: str
    pinned: bool
    status: str
    turn: int | None
    token_start: int | None
    token_end: int | None
    token_count: int | None
    pins: dict | None
    prev_hash: str
    hash: str
    created_at: datetime
    seal: str | None = None


@_record
class TurnRecord(Record):
    """A turn: what ran, so that running it again rebuilds the cache exactly.

    status: ``pending`` (begun, not finished), ``done`` or ``abandoned``. user_seq / assistant_seq: the messages it
    answered and wrote. prefill_tokens: ids the prefill fed, after the previous turn's pending token (with
    ``segments``, the :class:`~snapkv_sessions.transcript.TurnPlan`: ``{"runs": [[seq, start, end], ...], "window":
    W, "pinned": [[start, end], ...], "protect": [...], "reprefill": bool, "chunks": [tokens per forward of the
    prefill], ...}``; records older than ``chunks`` have none). decode_tokens: ids fed one by
    one while decoding; pending_tokens: sampled, not yet fed (the next turn feeds them first). tokens_in /
    tokens_out: the plan's tokens and the reply's. kept_per_role: share of each role's tokens held after the
    compression; retention: per-layer kept tokens and shares; kept_positions: safetensors bytes, per layer
    (Hkv, K) true positions held after the compression; compression: the
    :class:`~snapkv_sessions.report.CompressionReport` as JSON (``tier``: the tiered memory's figures). drift_score
    and drift_decision (``kept``, ``tiered``, ``reprefill``, ...). timings: milliseconds (``prefill_ms``,
    ``decode_ms``, ``compression_ms``). generation: the sampling settings; seed; stop_reason (``eos``, ``stop``,
    ``length``). policy_sha256 and model_id: what it ran under."""

    id: int
    session_id: str
    turn: int
    status: str
    user_seq: int
    assistant_seq: int | None
    prefill_tokens: list | None
    decode_tokens: list | None
    pending_tokens: list | None
    segments: dict | list | None
    tokens_in: int | None
    tokens_out: int | None
    kept_per_role: dict | None
    retention: dict | None
    kept_positions: bytes | None
    compression: dict | None
    drift_score: float | None
    drift_decision: str | None
    timings: dict | None
    policy_sha256: str
    model_id: str
    generation: dict | None
    seed: int | None
    stop_reason: str | None
    created_at: datetime
    finished_at: datetime | None
    seal: str | None = None


@_record
class EventRecord(Record):
    """An event of a session: ``kind`` (``compression``, ``reprefill``, ``drift``, ``tier_lost``, ``recovered``,
    ``error``, ...) and its JSON ``payload``, with the turn it belongs to."""

    id: int
    session_id: str
    turn: int | None
    kind: str
    payload: dict
    created_at: datetime
