"""Append-only schema migrations, applied in order on open. Never edit or reorder an applied one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import Column, DateTime, MetaData, String, Table, func, insert, inspect, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from . import schema
from .hashing import row_seal

_meta = MetaData()
applied = Table(
    "schema_migrations",
    _meta,
    Column("name", String(128), primary_key=True),
    Column("applied_at", DateTime(timezone=True), nullable=False),
)


def m001_initial(conn: Connection, _key: bytes | None) -> None:
    """Sessions, messages (hash-chained), turns and events."""
    schema.metadata.create_all(conn)


def m002_counts_pins_threads(conn: Connection, _key: bytes | None) -> None:
    """messages.token_count and messages.pins (computed once at commit), sessions.thread_id (indexed).

    A database created by m001 on this schema version already has them (m001 creates the current tables), so
    only what is missing is added.
    """
    _add_missing(conn, ((schema.messages, "token_count"), (schema.messages, "pins"), (schema.sessions, "thread_id")))
    inspector = inspect(conn)
    if "ix_sessions_thread" not in {i["name"] for i in inspector.get_indexes("sessions")}:
        next(i for i in schema.sessions.indexes if i.name == "ix_sessions_thread").create(conn)


def m003_seals(conn: Connection, key: bytes | None) -> None:
    """sessions.message_count and a seal on every session, message and turn row (``hashing.row_seal``).

    Rows already stored are counted and sealed as they are now: what was edited before this migration cannot be
    told apart afterwards (the hash chain still catches content edits).
    """
    _add_missing(conn, ((schema.sessions, "message_count"), (schema.sessions, "seal"), (schema.messages, "seal"),
                        (schema.turns, "seal")))
    m = schema.messages.c
    n_msgs = (select(func.count()).select_from(schema.messages).where(m.session_id == schema.sessions.c.id)
              .scalar_subquery())
    conn.execute(update(schema.sessions).values(message_count=n_msgs))
    for table in (schema.sessions, schema.messages, schema.turns):
        reseal(conn, table, key, migrating=True)


def m004_owner(conn: Connection, key: bytes | None) -> None:
    """sessions.owner (indexed with head_hash): the server scopes sessions to the API key that created them and
    finds a conversation's session by its content hash. Sessions stored before have no owner (local use)."""
    _add_missing(conn, ((schema.sessions, "owner"),))
    if "ix_sessions_owner" not in {i["name"] for i in inspect(conn).get_indexes("sessions")}:
        next(i for i in schema.sessions.indexes if i.name == "ix_sessions_owner").create(conn)
    reseal(conn, schema.sessions, key, migrating=True)  # the seal now covers the owner


def _add_missing(conn: Connection, columns: tuple[tuple[Table, str], ...]) -> None:
    """ALTER TABLE ... ADD COLUMN for each column the table lacks (a database made by m001 at a later schema
    version already has them)."""
    inspector = inspect(conn)
    for table, column in columns:
        if column not in {c["name"] for c in inspector.get_columns(table.name)}:
            kind = table.c[column].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column} {kind}"))


def reseal(conn: Connection, table: Table, key: bytes | None, *where: ColumnElement[bool],
           migrating: bool = False) -> None:
    """Recompute the seal of ``table``'s rows matching ``where`` (all rows without), as they are now in ``conn``.

    ``migrating``: the table may still lack a column a later migration adds; it is sealed as empty (None), which
    is what that migration's reseal then finds in it."""
    present = {c["name"] for c in inspect(conn).get_columns(table.name)} if migrating else None
    cols = [c for c in table.c if present is None or c.name in present]
    for row in conn.execute(select(*cols).where(*where)).mappings():
        full = {c.name: row.get(c.name) for c in table.c}
        conn.execute(update(table).where(table.c.id == row["id"]).values(seal=row_seal(key, table.name, full)))


MIGRATIONS: list[tuple[str, Callable[[Connection, bytes | None], None]]] = [
    ("m001_initial", m001_initial),
    ("m002_counts_pins_threads", m002_counts_pins_threads),
    ("m003_seals", m003_seals),
    ("m004_owner", m004_owner),
]


def migrate(conn: Connection, seal_key: bytes | None = None) -> list[str]:
    """Apply the migrations not yet recorded; returns the names applied now. ``seal_key``: the store's seal key
    (m003 seals the rows already stored with it).

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
            fn(conn, seal_key)
            conn.execute(insert(applied).values(name=name, applied_at=datetime.now(timezone.utc)))
            now.append(name)
    return now
