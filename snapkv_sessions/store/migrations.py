"""Append-only schema migrations, applied in order on open. Never edit or reorder an applied one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import Column, DateTime, MetaData, String, Table, insert, select
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


MIGRATIONS: list[tuple[str, Callable[[Connection], None]]] = [
    ("m001_initial", m001_initial),
]


def migrate(conn: Connection) -> list[str]:
    """Apply the migrations not yet recorded; returns the names applied now."""
    _meta.create_all(conn)
    done = set(conn.execute(select(applied.c.name)).scalars())
    now = []
    for name, fn in MIGRATIONS:
        if name not in done:
            fn(conn)
            conn.execute(insert(applied).values(name=name, applied_at=datetime.now(timezone.utc)))
            now.append(name)
    return now
