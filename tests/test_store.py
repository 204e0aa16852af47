"""The raw store without a model: token counts stored at commit and summed for admission, the legacy backfill,
thread ids through an index, and migrations m002 and m003 on a database m001 created."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest
from conftest import PG_URL, pg_store
from sqlalchemy import (
    Column,
    Index,
    MetaData,
    Table,
    UniqueConstraint,
    create_engine,
    insert,
    inspect,
    select,
    text,
    update,
)

from snapkv_sessions.errors import ConfigError
from snapkv_sessions.store import SessionStore, schema
from snapkv_sessions.store.hashing import GENESIS, message_hash
from snapkv_sessions.store.migrations import applied

M002_COLUMNS = {"messages": {"token_count", "pins"}, "sessions": {"thread_id"}}
M003_COLUMNS = {"messages": {"seal"}, "sessions": {"message_count", "seal"}, "turns": {"seal"}}
M004_COLUMNS = {"sessions": {"owner"}}
LATER_COLUMNS = {t: M002_COLUMNS.get(t, set()) | M003_COLUMNS.get(t, set()) | M004_COLUMNS.get(t, set())
                 for t in ("messages", "sessions", "turns")}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service)])
def store(request, tmp_path) -> SessionStore:
    if request.param == "sqlite":
        return SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    return pg_store()


def new_session(store: SessionStore, **kw) -> str:
    return store.create_session(kw.pop("model_id", "m"), "{}", kw.pop("policy_sha256", "p" * 64), **kw)


def one_turn(store: SessionStore, sid: str, question: str, reply: str, counts: tuple[int | None, int | None]) -> int:
    turn, _ = store.begin_turn(sid, question, None, "p" * 64, "m", {"max_new_tokens": 4}, None, token_count=counts[0])
    store.finish_turn(sid, turn, reply, {"tokens_in": 1, "tokens_out": 1}, [], {}, token_count=counts[1])
    return turn


# ---------------------------------------------------------------------- token counts


def test_counts_stored_at_commit_and_summed_over_active_messages(store):
    sid = new_session(store)
    assert store.content_tokens(sid) == 0
    store.add_message(sid, "system", "Be brief.", token_count=3)
    store.add_message(sid, "document", "Parcel 1 goes to Ada.", name="doc", pinned=True, token_count=7)
    one_turn(store, sid, "Who gets parcel 1?", "Ada.", (6, 2))
    assert [m["token_count"] for m in store.messages(sid)] == [3, 7, 6, 2]
    assert store.content_tokens(sid) == 18
    # an abandoned turn's question stays in the store (for the audit) but no longer counts
    turn, _ = store.begin_turn(sid, "And parcel 2?", None, "p" * 64, "m", {}, None, token_count=4)
    assert store.content_tokens(sid) == 22
    store.abandon_turn(sid, turn, reason="test")
    assert store.content_tokens(sid) == 18
    assert store.messages_without_count(sid) == {}
    assert store.verify(sid) == []  # the count is not part of the hashed identity
    other = new_session(store)
    store.add_message(other, "system", "x", token_count=100)
    assert store.content_tokens(sid) == 18  # per session


def test_legacy_rows_are_counted_once(store):
    """Rows without a count (written before m002) are found, counted by the caller and stored, once."""
    sid = new_session(store)
    store.add_message(sid, "system", "Be brief.")  # no counter: NULL, as on an old database
    store.add_message(sid, "document", "Parcel 1 goes to Ada.", token_count=7)
    one_turn(store, sid, "Who gets parcel 1?", "Ada.", (None, None))
    turn, _ = store.begin_turn(sid, "Abandoned?", None, "p" * 64, "m", {}, None)
    store.abandon_turn(sid, turn, reason="test")
    missing = store.messages_without_count(sid)
    assert missing == {1: "Be brief.", 3: "Who gets parcel 1?", 4: "Ada."}  # active ones only
    assert store.content_tokens(sid) == 7
    assert store.set_token_counts(sid, {seq: len(content.split()) for seq, content in missing.items()}) == 3
    assert store.messages_without_count(sid) == {}
    assert store.content_tokens(sid) == 7 + 2 + 4 + 1
    # counts are written once: a second backfill (another worker) neither overwrites nor counts again
    assert store.set_token_counts(sid, {1: 99, 2: 99}) == 0
    assert store.content_tokens(sid) == 14


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_bad_counts_are_refused_before_writing(tmp_path, bad):
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    sid = new_session(store)
    with pytest.raises(ConfigError, match=r"^token_count="):
        store.add_message(sid, "system", "x", token_count=bad)
    with pytest.raises(ConfigError, match=r"^token_count="):
        store.begin_turn(sid, "q", None, "p" * 64, "m", {}, None, token_count=bad)
    store.add_message(sid, "system", "y")
    with pytest.raises(ConfigError, match=r"^counts\[1\]="):
        store.set_token_counts(sid, {1: bad})
    assert [m["content"] for m in store.messages(sid)] == ["y"] and store.turns(sid) == []
    assert store.messages_without_count(sid) == {1: "y"}


# ---------------------------------------------------------------------- threads


def test_session_for_thread_takes_the_newest(store):
    thread = f"thread-{uuid.uuid4()}"  # PostgreSQL's test database is shared: ids unique to this run
    assert store.session_for_thread(thread) is None
    first = new_session(store, thread_id=thread, title="display title")
    assert store.session_for_thread(thread) == first
    second = new_session(store, thread_id=thread)
    assert store.session_for_thread(thread) == second
    new_session(store, thread_id=f"{thread}-other")
    assert store.session_for_thread(thread) == second
    assert store.get_session(first)["thread_id"] == thread
    # filtered by model and policy (a thread's session is bound to both)
    other_model = new_session(store, thread_id=thread, model_id="other")
    assert store.session_for_thread(thread) == other_model
    assert store.session_for_thread(thread, model_id="m", policy_sha256="p" * 64) == second
    assert store.session_for_thread(thread, policy_sha256="q" * 64) is None
    # equal creation times (a coarse clock): the larger id wins, the same on every worker
    same = datetime(2030, 1, 1, tzinfo=timezone.utc)
    with store.engine.begin() as conn:
        conn.execute(update(schema.sessions).where(schema.sessions.c.id.in_([first, second]))
                     .values(created_at=same))
    assert store.session_for_thread(thread, model_id="m") == max(first, second)


def test_legacy_title_fallback_only_on_a_miss(store):
    thread = f"thread-{uuid.uuid4()}"
    title = f"langchain thread {thread}"
    legacy = new_session(store, title=title)  # before m002: the thread lived in the title only
    assert store.session_for_thread(thread) is None
    assert store.session_for_thread(thread, legacy_title=title) == legacy
    assert store.session_for_thread(thread, legacy_title=title, model_id="other") is None
    tagged = new_session(store, title=title, thread_id=thread)  # newer sessions carry the thread id
    assert store.session_for_thread(thread, legacy_title=title) == tagged
    # a session of another thread never matches by title
    assert store.session_for_thread(f"{thread}-x", legacy_title=f"langchain thread {thread}-x") is None


def test_thread_lookup_uses_the_index(tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    q = (select(schema.sessions.c.id).where(schema.sessions.c.thread_id == "t")
         .order_by(schema.sessions.c.created_at.desc()).limit(1))
    sql = str(q.compile(store.engine, compile_kwargs={"literal_binds": True}))
    with store.engine.connect() as conn:
        plan = " ".join(str(r[-1]) for r in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
    assert "ix_sessions_thread" in plan, plan


@pytest.mark.parametrize("bad", ["", "x" * 257, 5])
def test_bad_thread_id_is_refused(tmp_path, bad):
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(ConfigError, match=r"^thread_id="):
        new_session(store, thread_id=bad)
    assert store.list_sessions() == []


# ---------------------------------------------------------------------- migration m002 on an m001 database


def m001_metadata() -> MetaData:
    """The tables as m001 created them before m002 existed: today's schema without the columns m002 and m003 add."""
    meta = MetaData()
    for table in schema.metadata.sorted_tables:
        drop = LATER_COLUMNS.get(table.name, set())
        cols: list[Column] = [c._copy() for c in table.columns if c.name not in drop]
        uniques = [UniqueConstraint(*(c.name for c in u.columns), name=u.name)
                   for u in table.constraints if isinstance(u, UniqueConstraint)]
        Table(table.name, meta, *cols, *uniques)
    Index("ix_messages_session", meta.tables["messages"].c.session_id, meta.tables["messages"].c.seq)
    Index("ix_events_session", meta.tables["events"].c.session_id, meta.tables["events"].c.id)
    return meta


def write_m001_database(url: str) -> str:
    """An m001 database holding one session with two chained messages; returns the session id."""
    engine = create_engine(url)
    meta = m001_metadata()
    now = datetime.now(timezone.utc)
    sid = str(uuid.uuid4())
    with engine.begin() as conn:
        meta.create_all(conn)
        applied.create(conn)
        conn.execute(insert(applied).values(name="m001_initial", applied_at=now))
        prev = GENESIS
        rows = []
        for seq, (role, content) in enumerate([("system", "Be brief."), ("document", "Parcel 1 goes to Ada.")], 1):
            digest = message_hash(prev, seq, role, None, content)
            rows.append(dict(session_id=sid, seq=seq, role=role, content=content, pinned=False, status="active",
                             prev_hash=prev, hash=digest, created_at=now))
            prev = digest
        conn.execute(insert(meta.tables["sessions"]).values(
            id=sid, created_at=now, updated_at=now, model_id="m", policy_json="{}", policy_sha256="p" * 64,
            title="langchain thread old", turns_done=0, head_hash=prev, meta={}))
        conn.execute(insert(meta.tables["messages"]), rows)
    engine.dispose()
    return sid


def check_migrated(url: str, sid: str) -> None:
    store = SessionStore(url)  # opening applies m002, m003 and m004
    insp = inspect(store.engine)
    for table, cols in LATER_COLUMNS.items():
        assert cols <= {c["name"] for c in insp.get_columns(table)}
    assert {"ix_sessions_thread", "ix_sessions_owner"} <= {i["name"] for i in insp.get_indexes("sessions")}
    with store.engine.connect() as conn:
        assert set(conn.execute(select(applied.c.name)).scalars()) == {"m001_initial", "m002_counts_pins_threads",
                                                                        "m003_seals", "m004_owner"}
    # the rows are kept, the chain intact, the rows counted and sealed, the other new columns empty
    assert [(m["role"], m["content"], m["token_count"], m["pins"]) for m in store.messages(sid)] == [
        ("system", "Be brief.", None, None), ("document", "Parcel 1 goes to Ada.", None, None)]
    assert store.verify(sid) == [] and store.get_session(sid)["thread_id"] is None
    assert store.get_session(sid)["owner"] is None and store.sessions_at_head(None, [store.get_session(sid)["head_hash"]])
    assert store.get_session(sid)["message_count"] == 2
    # the old session is usable: found by its title, counted once, and the chain goes on
    assert store.session_for_thread("old", legacy_title="langchain thread old") == sid
    assert store.set_token_counts(sid, {1: 3, 2: 7}) == 2
    store.add_message(sid, "user", "Hi.", token_count=2)
    assert store.content_tokens(sid) == 12 and store.verify(sid) == []
    store.engine.dispose()
    SessionStore(url).engine.dispose()  # reopening applies nothing twice


def test_m001_sqlite_database_gets_m002_m003_and_keeps_its_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    check_migrated(url, write_m001_database(url))


@pytest.mark.service
def test_m001_postgresql_database_gets_m002_m003_and_keeps_its_rows():
    pg_store().engine.dispose()  # skips when no server
    name = f"m001_{uuid.uuid4().hex[:12]}"  # a schema of its own: the shared test database keeps today's tables
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {name}"))
    try:
        url = f"{PG_URL}?options=-csearch_path%3D{name}"
        check_migrated(url, write_m001_database(url))
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {name} CASCADE"))
        admin.dispose()
