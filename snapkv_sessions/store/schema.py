"""Tables of the raw store (SQLAlchemy Core). Changing them needs a new migration in ``migrations.py``."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

MAX_SEED = 2**31 - 1  # turns.seed is an INTEGER column: 32 bits on PostgreSQL; larger seeds are refused up front

sessions = Table(
    "sessions",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("model_id", String(512), nullable=False),
    Column("policy_json", Text, nullable=False),
    Column("policy_sha256", String(64), nullable=False),
    Column("title", String(256)),
    Column("turns_done", Integer, nullable=False, default=0),
    Column("head_hash", String(64), nullable=False),
    Column("meta", JSON, nullable=False, default=dict),
    Column("thread_id", String(256)),  # an agent framework's thread (LangChain's thread_id), m002
    Column("message_count", Integer),  # messages in the chain, so a deleted last message shows, m003
    Column("seal", String(64)),  # hashing.row_seal over the SEALED columns, m003
    Column("owner", String(64)),  # who may use it (the server's API key, as a digest; None: anyone local), m004
)

messages = Table(
    "messages",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("session_id", String(36), ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("role", String(16), nullable=False),
    Column("name", String(256)),
    Column("content", Text, nullable=False),
    Column("pinned", Boolean, nullable=False, default=False),
    Column("status", String(16), nullable=False, default="active"),  # active | abandoned
    Column("turn", Integer),
    Column("token_start", Integer),
    Column("token_end", Integer),
    Column("token_count", Integer),  # content tokens, counted once at commit (admission sums them), m002
    Column("pins", JSON(none_as_null=True)),  # MessagePins: pinned character ranges of its rendered span, m002
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("seal", String(64)),  # m003
    UniqueConstraint("session_id", "seq", name="uq_messages_session_seq"),
)

turns = Table(
    "turns",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("session_id", String(36), ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    Column("turn", Integer, nullable=False),
    Column("status", String(16), nullable=False),  # pending | done | abandoned
    Column("user_seq", Integer, nullable=False),
    Column("assistant_seq", Integer),
    Column("prefill_tokens", JSON),  # ids fed by the prefill (after the previous turn's pending token)
    Column("decode_tokens", JSON),  # ids fed one by one while decoding
    Column("pending_tokens", JSON),  # sampled but not yet fed (fed first by the next turn)
    Column("segments", JSON),  # [[message seq, first position, end position], ...] for every fed token
    Column("tokens_in", Integer),
    Column("tokens_out", Integer),
    Column("kept_per_role", JSON),
    Column("retention", JSON),
    Column("kept_positions", LargeBinary),  # safetensors (numpy), "layer.{i}": (Hkv, K) int32
    Column("compression", JSON),
    Column("drift_score", Float),
    Column("drift_decision", String(16)),
    Column("timings", JSON),
    Column("policy_sha256", String(64), nullable=False),
    Column("model_id", String(512), nullable=False),
    Column("generation", JSON),
    Column("seed", Integer),  # at most MAX_SEED
    Column("stop_reason", String(16)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    Column("seal", String(64)),  # m003
    UniqueConstraint("session_id", "turn", name="uq_turns_session_turn"),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("session_id", String(36), ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    Column("turn", Integer),
    Column("kind", String(32), nullable=False),  # compression | reprefill | error | recovered | warning
    Column("payload", JSON, nullable=False, default=dict),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

Index("ix_messages_session", messages.c.session_id, messages.c.seq)
Index("ix_sessions_thread", sessions.c.thread_id)
Index("ix_sessions_owner", sessions.c.owner, sessions.c.head_hash)
Index("ix_events_session", events.c.session_id, events.c.id)
