"""The raw store without a model: token counts stored at commit and summed for admission, the legacy backfill,
thread ids through an index, migrations m002 and m003 on a database m001 created, a request's messages in one
transaction (all or none), and ids that cannot be session ids answered as missing sessions without a query."""

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
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError

from snapkv_sessions.errors import ConfigError
from snapkv_sessions.store import NewMessage, SessionStore, StoreError, schema
from snapkv_sessions.store.hashing import GENESIS, message_hash
from snapkv_sessions.store.migrations import applied, reseal

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


# ---------------------------------------------------------------------- a request's messages: one transaction


class Statements:
    """The statements the store sends (one per ``execute``/``executemany``), on each of its engines."""

    def __init__(self, store: SessionStore) -> None:
        self.sql: list[str] = []
        self.engines = {store.engine, store._lock_engine}
        for engine in self.engines:
            event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, parameters, context, executemany) -> None:
        self.sql.append(statement)

    def inserts(self, table: str) -> int:
        return sum(s.lstrip().upper().startswith(f"INSERT INTO {table.upper()} ") for s in self.sql)

    def close(self) -> None:
        for engine in self.engines:
            event.remove(engine, "before_cursor_execute", self._seen)


def docs(n: int, first: int = 0) -> list[NewMessage]:
    return [NewMessage("document", f"doc {first + i}", name=f"d{first + i}", token_count=i + 1) for i in range(n)]


def rows_of(store: SessionStore, sid: str) -> dict[str, int]:
    """How many rows of each table the session has, counted directly."""
    with store.engine.connect() as conn:
        return {t.name: conn.execute(select(func.count()).select_from(t).where(
            (t.c.id if t is schema.sessions else t.c.session_id) == sid)).scalar()
            for t in (schema.sessions, schema.messages, schema.turns, schema.events)}


def test_add_messages_appends_the_chain_in_one_call(store):
    sid = new_session(store)
    store.add_message(sid, "system", "Be brief.", token_count=3)
    rows = store.add_messages(sid, docs(4) + [NewMessage("developer", "Use tools.", pinned=True, pins={"span": "x",
                                                                                                   "ranges": [(0, 1)]})])
    assert [r["seq"] for r in rows] == [2, 3, 4, 5, 6]
    stored = store.messages(sid)
    assert [(m["role"], m["content"], m["token_count"], m["pinned"]) for m in stored[1:]] == [
        ("document", "doc 0", 1, False), ("document", "doc 1", 2, False), ("document", "doc 2", 3, False),
        ("document", "doc 3", 4, False), ("developer", "Use tools.", None, True)]
    assert stored[-1]["pins"] == {"span": "x", "ranges": [[0, 1]]}
    assert [r["hash"] for r in rows] == [m["hash"] for m in stored[1:]]
    row = store.get_session(sid)
    assert row["head_hash"] == rows[-1]["hash"] and row["message_count"] == 6
    assert store.content_tokens(sid) == 3 + 1 + 2 + 3 + 4
    assert store.verify(sid) == []
    assert store.add_messages(sid, []) == [] and store.get_session(sid)["message_count"] == 6
    one_turn(store, sid, "q", "a", (1, 1))  # the turns go on after them
    assert store.verify(sid) == [] and [m["seq"] for m in store.messages(sid)] == list(range(1, 9))


@pytest.mark.parametrize("key", [None, "k" * 32])
def test_appended_rows_are_sealed_as_reseal_seals_them(tmp_path, key):
    """The seals written with the rows (no read back) are the ones migrations.reseal computes from the stored rows."""
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}", seal_key=key)
    sid = new_session(store)
    odd_pins = {"span": "tool", "ranges": [(0, 4), (6, 9)], 7: "int key"}  # tuples and an int key, as JSON keeps them
    store.add_messages(sid, [*docs(3), NewMessage("tool_schema", "{}", pinned=True, pins=odd_pins)])
    one_turn(store, sid, "q", "a", (1, None))
    m = schema.messages.c
    before = {r["seq"]: r["seal"] for r in store.messages(sid)}, store.get_session(sid)["seal"]
    with store.engine.begin() as conn:
        reseal(conn, schema.messages, store._key, m.session_id == sid)
        reseal(conn, schema.sessions, store._key, schema.sessions.c.id == sid)
    assert ({r["seq"]: r["seal"] for r in store.messages(sid)}, store.get_session(sid)["seal"]) == before
    assert store.verify(sid) == []


def test_appending_n_messages_takes_as_many_statements_as_one(store):
    """No read per message: one insert of every row, whatever their number."""
    sid = new_session(store)
    counts = []
    for n in (1, 50):
        seen = Statements(store)
        try:
            store.add_messages(sid, docs(n))
        finally:
            seen.close()
        counts.append((len(seen.sql), seen.inserts("messages")))
    assert counts[0] == counts[1] and counts[0][1] == 1, counts
    assert store.get_session(sid)["message_count"] == 51 and store.verify(sid) == []


FAILURES = ["third row refused by the database", "failure after every row was written"]
RAISED = {FAILURES[0]: DBAPIError, FAILURES[1]: RuntimeError}  # an IntegrityError (NOT NULL); "disk on fire"


def fail_inside(store: SessionStore, monkeypatch, how: str, messages: list[NewMessage]) -> list[NewMessage]:
    """Make the transaction of ``messages`` fail inside: the 3rd row breaks a NOT NULL constraint (rows 1 and 2 are
    written first), or the session row's seal, the last statement, raises."""
    if how == FAILURES[0]:
        return [*messages[:2], NewMessage(None, "no role"), *messages[3:]]  # type: ignore[arg-type]
    real = SessionStore._reseal

    def broken(self, conn, table, *where):
        if table is schema.sessions:  # where: sessions.id == sid
            m = schema.messages.c
            written = conn.execute(select(func.count()).select_from(schema.messages).where(
                m.session_id == where[0].right.value, m.content == messages[-1].content)).scalar()
            if written:  # every row of the batch is in, uncommitted
                raise RuntimeError("disk on fire")
        return real(self, conn, table, *where)

    monkeypatch.setattr(SessionStore, "_reseal", broken)
    return messages


@pytest.mark.parametrize("how", FAILURES)
def test_add_messages_is_all_or_nothing(store, monkeypatch, how):
    sid = new_session(store)
    store.add_messages(sid, docs(2, first=100))
    before, session = store.messages(sid), store.get_session(sid)
    seen = Statements(store)
    batch = fail_inside(store, monkeypatch, how, docs(5))
    try:
        with pytest.raises(RAISED[how]):
            store.add_messages(sid, batch)
    finally:
        seen.close()
    assert seen.inserts("messages") == 1  # the rows were sent: they were rolled back, not never written
    assert store.messages(sid) == before and len(before) == 2
    after = store.get_session(sid)
    assert (after["head_hash"], after["message_count"], after["seal"]) == (session["head_hash"], 2, session["seal"])
    assert rows_of(store, sid)["messages"] == 2
    assert store.verify(sid) == []
    monkeypatch.undo()
    assert [r["seq"] for r in store.add_messages(sid, docs(5))] == [3, 4, 5, 6, 7]  # the chain goes on at seq 3
    assert store.verify(sid) == []


@pytest.mark.parametrize("how", FAILURES)
def test_create_session_with_messages_is_all_or_nothing(store, monkeypatch, how):
    sid = str(uuid.uuid4())
    batch = fail_inside(store, monkeypatch, how, docs(5))
    with pytest.raises(RAISED[how]):
        new_session(store, session_id=sid, messages=batch, thread_id=f"thread-{sid}")
    assert not store.session_exists(sid)
    assert rows_of(store, sid) == {"sessions": 0, "messages": 0, "turns": 0, "events": 0}
    assert store.session_for_thread(f"thread-{sid}") is None
    monkeypatch.undo()
    assert new_session(store, session_id=sid, messages=docs(5)) == sid
    assert [m["content"] for m in store.messages(sid)] == [f"doc {i}" for i in range(5)]
    assert store.get_session(sid)["message_count"] == 5 and store.verify(sid) == []


def test_add_messages_is_refused_while_a_turn_is_pending(store):
    sid = new_session(store, messages=docs(1))
    turn, _ = store.begin_turn(sid, "q", None, "p" * 64, "m", {}, None)
    with pytest.raises(StoreError, match=f"turn {turn} is pending"):
        store.add_messages(sid, docs(3))
    assert len(store.messages(sid)) == 2 and store.get_session(sid)["message_count"] == 2
    store.finish_turn(sid, turn, "a", {}, [], {})
    assert [r["seq"] for r in store.add_messages(sid, docs(3))] == [4, 5, 6] and store.verify(sid) == []


@pytest.mark.parametrize(("bad", "param"), [
    ([*docs(1), NewMessage("document", "x", token_count=-1)], "messages[1].token_count"),
    ([*docs(2), NewMessage("document", "x", token_count=True)], "messages[2].token_count"),
    ([NewMessage("document", "x", turn=1)], "messages[0].turn"),
    ([NewMessage("document", "x", pinned="yes")], "messages[0].pinned"),  # type: ignore[arg-type]
    ([NewMessage("document", "x", pins={"a": object()})], "messages[0].pins"),
    ([*docs(1), {"role": "document", "content": "x"}], "messages[1]"),
    (NewMessage("document", "x"), "messages"),
])
def test_bad_messages_are_refused_before_the_transaction(tmp_path, bad, param):
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    sid = new_session(store)
    seen = Statements(store)
    try:
        with pytest.raises(ConfigError) as err:
            store.add_messages(sid, bad)
        assert err.value.param == param
        with pytest.raises(ConfigError) as err:
            new_session(store, messages=bad)
        assert err.value.param == param
    finally:
        seen.close()
    assert seen.sql == [] and store.messages(sid) == [] and len(store.list_sessions()) == 1


# ---------------------------------------------------------------------- ids that cannot be session ids


NOT_IDS = ["a\x00b", str(uuid.uuid4())[:35] + "\x00", "x" * 10_000, "'; DROP TABLE sessions; --",
           str(uuid.uuid4()).upper(), "", "../../etc/passwd"]


@pytest.mark.parametrize("bad", NOT_IDS, ids=["nul", "nul-uuid", "10k", "quote", "upper", "empty", "path"])
def test_ids_that_cannot_be_session_ids_are_missing_sessions_without_a_query(store, bad):
    seen = Statements(store)
    try:
        with pytest.raises(StoreError, match="no such session") as err:
            store.get_session(bad)
        assert not isinstance(err.value, DBAPIError) and len(str(err.value)) < 300  # the id shown bounded
        assert store.session_exists(bad) is False
        assert store.messages(bad) == [] and store.turns(bad) == [] and store.events(bad) == []
        assert store.pending_turn(bad) is None and store.content_tokens(bad) == 0
        assert store.messages_without_count(bad) == {} and store.set_token_counts(bad, {1: 3}) == 0
        assert store.abandon_turn(bad, 1, reason="x") is False and store.hot_state(bad) == {}
        for call in (lambda: store.delete_session(bad), lambda: store.verify(bad), lambda: store.export(bad),
                     lambda: store.add_messages(bad, docs(2)), lambda: store.add_message(bad, "system", "x"),
                     lambda: store.begin_turn(bad, "q", None, "p" * 64, "m", {}, None),
                     lambda: store.finish_turn(bad, 1, "a", {}, [], {}), lambda: store.add_event(bad, "x", {})):
            with pytest.raises(StoreError, match="no such session"):
                call()
        with pytest.raises(StoreError, match="no such session"), store.lock(bad):
            pass
    finally:
        seen.close()
    assert seen.sql == []  # answered without asking the database
    if "\x00" not in bad:  # nothing was stored under it (a NUL cannot even be asked for on PostgreSQL)
        assert rows_of(store, bad) == {"sessions": 0, "messages": 0, "turns": 0, "events": 0}
    missing = str(uuid.uuid4())  # a well-formed id of no session is asked for, and answered the same
    with pytest.raises(StoreError, match="no such session"):
        store.get_session(missing)
    assert store.session_exists(missing) is False and store.messages(missing) == []


def test_thread_ids_no_store_keeps_are_refused_or_missing(store):
    with pytest.raises(ConfigError, match=r"^thread_id="):
        new_session(store, thread_id="a\x00b")
    assert store.session_for_thread("a\x00b") is None
    assert store.session_for_thread("t" * 10_000) is None
    assert store.session_for_thread(f"t-{uuid.uuid4()}", legacy_title="x\x00") is None
