"""Append-only schema migrations, applied in order on open. Never edit or reorder an applied one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import Column, DateTime, MetaData, String, Table, insert, inspect, select, text
from sqlalchemy.engine import Connection

from . import schema

_meta = MetaData()
applied = Table(
    "schema_migrations",
    _meta,
    Column("name", String(128), primary_key=True),
    Column("applied_at", DateTime(timezone=True), nullable=False),
)


def m001_initial(conn: Connection) -> None:
    """Sessions, messages (hash-chained), turns and events."""
    schema.metadata.create_all(conn)


def m002_counts_pins_threads(conn: Connection) -> None:
    """messages.token_count and messages.pins (computed once at commit), sessions.thread_id (indexed).

    A database created by m001 on this schema version already has them (m001 creates the current tables), so
    only what is missing is added.
    """
    inspector = inspect(conn)
    for table, column in ((schema.messages, "token_count"), (schema.messages, "pins"),
                          (schema.sessions, "thread_id")):
        if column not in {c["name"] for c in inspector.get_columns(table.name)}:
            col = table.c[column]
            kind = col.type.compile(dialect=conn.dialect)
            conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN {column} {kind}'))
    if "ix_sessions_thread" not in {i["name"] for i in inspector.get_indexes("sessions")}:
        next(i for i in schema.sessions.indexes if i.name == "ix_sessions_thread").create(conn)


MIGRATIONS: list[tuple[str, Callable[[Connection], None]]] = [
    ("m001_initial", m001_initial),
    ("m002_counts_pins_threads", m002_counts_pins_threads),
]


def migrate(conn: Connection) -> list[str]:
    """Apply the migrations not yet recorded; returns the names applied now.

    On PostgreSQL, workers starting together take turns (a transaction-level advisory lock), so a migration
    never runs twice.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(7241900211)"))  # a fixed key: "snapkv migrations"
    _meta.create_all(conn)
    done = set(conn.execute(select(applied.c.name)).scalars())
    now = []
    for name, fn in MIGRATIONS:
        if name not in done:
            fn(conn)
            conn.execute(insert(applied).values(name=name, applied_at=datetime.now(timezone.utc)))
            now.append(name)
    return now
