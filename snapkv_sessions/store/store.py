"""SessionStore: the raw conversation, turn records and events; the source of truth every evicted KV is
rebuilt from. SQLAlchemy 2 (SQLite by default, any URL; PostgreSQL for several workers) plus optional Redis for
hot state and per-session locks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import create_engine, delete, event, func, insert, make_url, select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from .. import stats
from ..errors import ConfigError, SnapKVError, bounded_repr
from . import schema
from .hashing import GENESIS, message_hash, row_seal
from .integrity import Integrity, chain_problems, turn_problems
from .locks import redis_lock, remove_lock_file, sql_lock
from .migrations import migrate, reseal
from .records import EventRecord, MessageRecord, SessionRecord, TurnRecord


def is_session_id(value: object) -> bool:
    """Whether ``value`` is a session id as the store makes them: a UUID in canonical (lower-case, hyphenated) form."""
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


class StoreError(SnapKVError, LookupError):
    """A session, turn or message is missing or inconsistent."""


class StoreUnavailable(StoreError):
    """The database cannot serve a connection now: every connection of the pool stayed in use for
    ``pool_timeout_s``, or the server cannot be reached (or dropped the connection before a commit). Nothing was
    written by the call that raised it; try again after ``retry_after`` seconds (a server answers 503 with
    ``Retry-After``)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = int(retry_after)

    def __reduce__(self):  # pickled whole (Ray sends errors between processes)
        return type(self), (str(self), self.retry_after)


def default_url() -> str:
    """The embedded default: a SQLite file in the user data directory."""
    base = os.environ.get("SNAPKV_SESSIONS_HOME")
    if base:
        root = Path(base)
    else:
        root = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "snapkv-sessions"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'sessions.db'}"


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class NewMessage:
    """One message to append to a session's hash chain (:meth:`SessionStore.add_messages`,
    ``create_session(messages=...)``). ``turn`` is set by the store's turn methods only."""

    role: str
    content: str
    name: str | None = None
    pinned: bool = False
    turn: int | None = None
    token_count: int | None = None  # content tokens, counted once by the caller at commit
    pins: dict | None = None  # pinned character ranges of its rendered span (MessagePins.to_json()), at commit


def _check_count(param: str, value: int | None) -> None:
    """A stored token count is a non-negative int (None: not counted, e.g. a caller without a tokenizer)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(param, value, "must be a non-negative int or None")


def _checked(messages: Sequence[NewMessage], param: str = "messages") -> list[NewMessage]:
    """``messages`` checked before any transaction opens."""
    if isinstance(messages, (str, bytes, NewMessage)) or not isinstance(messages, Sequence):
        raise ConfigError(param, messages, "must be a sequence of NewMessage")
    out = []
    for i, new in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(new, NewMessage):
            raise ConfigError(where, new, "must be a NewMessage")
        if new.turn is not None:
            raise ConfigError(f"{where}.turn", new.turn, "is set by begin_turn/finish_turn only; leave it None")
        if new.pinned not in (True, False):
            raise ConfigError(f"{where}.pinned", new.pinned, "must be a bool")
        _check_count(f"{where}.token_count", new.token_count)
        try:
            _stored_json(new.pins)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.pins", new.pins, f"must be JSON data ({exc})") from None
        out.append(new)
    return out


def _stored_json(value: object) -> object:
    """A JSON column's value as the database gives it back (tuples as lists, keys as strings)."""
    return None if value is None else json.loads(json.dumps(value))


_THREAD_CHARS = schema.sessions.c.thread_id.type.length


def _storable_thread(value: object) -> bool:
    """Whether a thread id (or title) can be stored and looked up as it is: every database keeps it."""
    return isinstance(value, str) and 0 < len(value) <= _THREAD_CHARS and "\x00" not in value


def _seal_key(key: str | bytes | None) -> bytes | None:
    """The seal key given, else ``SNAPKV_SESSIONS_SEAL_KEY``, else None (keyless SHA-256 seals)."""
    if key is None:
        key = os.environ.get("SNAPKV_SESSIONS_SEAL_KEY") or None
    if key is None:
        return None
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(raw) < 16:
        raise ConfigError("seal_key", "<hidden>", "must hold at least 16 bytes (it is a secret; "
                          "set SNAPKV_SESSIONS_SEAL_KEY or pass seal_key)")
    return raw


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cur.execute("PRAGMA busy_timeout=30000")  # several processes write one file
    cur.close()


def _as_url(url: str) -> str:
    """A URL as given, or a plain path made an SQLite URL (``--db sessions.db``)."""
    if "://" in url:
        return url
    return f"sqlite:///{Path(url).expanduser().resolve()}"


def _shown(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url[:200]


def _check_exists(url: str) -> None:
    try:
        parsed = make_url(url)
    except ArgumentError:
        return  # reported by the open itself
    db = parsed.database
    if parsed.get_backend_name() == "sqlite" and db and db != ":memory:" and not Path(db).is_file():
        raise StoreError(f"store={_shown(url)!r}: no such database file (nothing was created)")


DEFAULT_POOL_SIZE = 5  # SQLAlchemy's own default


def _check_pool(pool_size: int | None, pool_timeout_s: float) -> None:
    if pool_size is not None and (isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1):
        raise ConfigError("pool_size", pool_size, "must be an int >= 1 or None")
    if (isinstance(pool_timeout_s, bool) or not isinstance(pool_timeout_s, (int, float))
            or not 0 < pool_timeout_s < math.inf):
        raise ConfigError("pool_timeout_s", pool_timeout_s, "must be a finite number of seconds > 0")


def _make_engine(url: str, pool_size: int, pool_timeout_s: float) -> Engine:
    """The engine of the transactions. On a server (PostgreSQL) it holds at most ``pool_size`` connections and
    waits at most ``pool_timeout_s`` for one (connecting included); SQLite keeps SQLAlchemy's pool."""
    if url.startswith("sqlite"):
        if url in ("sqlite://", "sqlite:///:memory:"):
            # one in-memory database shared by every thread (each new connection would be a new, empty one)
            from sqlalchemy.pool import StaticPool

            engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
        else:
            engine = create_engine(url)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {}
    parsed = make_url(url)
    if parsed.get_driver_name() in ("psycopg", "psycopg2") and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = max(2, math.ceil(pool_timeout_s))  # libpq's minimum is 2 s
    # no overflow: the pool's size is the bound, so that the connections a process holds are known (see
    # SessionStore) and a full pool is answered within pool_timeout_s instead of opening one more connection
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=0, pool_timeout=pool_timeout_s,
                         connect_args=connect_args)


class SessionStore:
    """The raw store.

    Parameters
    ----------
    url: SQLAlchemy URL; None for the embedded SQLite file (:func:`default_url`)
    redis_url: optional Redis for hot state and per-session locks; unreachable Redis only warns
    must_exist: refuse to create a new SQLite file (read-only commands: a mistyped path is an error, not an
        empty store)
    seal_key: the secret that seals rows (HMAC-SHA256; see :mod:`.hashing`); default ``SNAPKV_SESSIONS_SEAL_KEY``,
        else keyless SHA-256 seals. Every process writing or verifying one store uses the same key.
    pool_size: on a database server (PostgreSQL), the connections of the transactions' pool, and as many again
        for the session locks (:meth:`lock` holds one connection, an advisory lock, for the whole turn, from a
        pool of its own so that held locks never take the transactions' connections): a process holds at most
        ``2 * pool_size`` connections to the server. Size it for the turns run at once (a server: its decode
        batch and live sessions). None: SQLAlchemy's default of 5. An SQLite file locks sessions with lock files
        and holds no connection for them.
    pool_timeout_s: how long a call waits for a connection (from the pool, or connecting to the server) before
        it raises :class:`StoreUnavailable`.

    Every call draws a connection only for its own transaction or read. A call that cannot have one in time, or
    cannot reach the server, raises :class:`StoreUnavailable` (with ``retry_after``) and has written nothing; any
    other failure inside a transaction rolls the whole transaction back.
    """

    def __init__(self, url: str | None = None, redis_url: str | None = None, *, must_exist: bool = False,
                 seal_key: str | bytes | None = None, pool_size: int | None = None,
                 pool_timeout_s: float = 5.0) -> None:
        """``url``: an SQLAlchemy URL, or a plain file path (an SQLite database)."""
        _check_pool(pool_size, pool_timeout_s)
        self._key = _seal_key(seal_key)
        self.url = _as_url(url) if url else default_url()
        self.pool_size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
        self.pool_timeout_s = float(pool_timeout_s)
        self.retry_after = max(1, math.ceil(self.pool_timeout_s))
        if must_exist:
            _check_exists(self.url)
        try:
            self.engine = _make_engine(self.url, self.pool_size, self.pool_timeout_s)
        except (ArgumentError, NoSuchModuleError) as exc:
            raise self._unopened(exc) from None
        self._server = self.engine.dialect.name != "sqlite"
        # the session locks' engine: PostgreSQL's advisory locks hold a connection each, from their own pool;
        # elsewhere no lock holds a connection (lock files, or in-process locks), and the engine only names the store
        self._lock_engine = self.engine
        if self.engine.dialect.name == "postgresql":
            self._lock_engine = _make_engine(self.url, self.pool_size, self.pool_timeout_s)
        try:
            with self._begin() as conn:
                migrate(conn, self._key)
        except StoreUnavailable:  # the server cannot be reached now (it may come back: a 503, not a bad URL)
            self.close()
            raise
        except (OperationalError, InterfaceError) as exc:
            self.close()
            raise self._unopened(exc) from None
        self.redis = self._connect_redis(redis_url) if redis_url else None

    def _unopened(self, exc: Exception) -> StoreError:
        return StoreError(f"store={_shown(self.url)!r}: cannot open it ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300]})")

    def close(self) -> None:
        """Close every pooled connection (both pools); the store opens new ones if it is used again."""
        self.engine.dispose()
        if self._lock_engine is not self.engine:
            self._lock_engine.dispose()

    # ------------------------------------------------------------------ connections

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        if isinstance(exc, PoolTimeout):
            why = f"no connection free within {self.pool_timeout_s:g} s (a pool of {self.pool_size} is in use)"
        else:
            why = f"the database cannot be reached ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]})"
        stats.fault("store_unavailable", None, why)
        return StoreUnavailable(f"store={_shown(self.url)!r}: {why}; retry in {self.retry_after} s",
                                self.retry_after)

    def _checkout(self, engine: Engine) -> Connection:
        """A connection of ``engine``, or :class:`StoreUnavailable` when none can be had in time."""
        try:
            return engine.connect()
        except PoolTimeout as exc:
            raise self._unavailable(exc) from None
        except (OperationalError, InterfaceError) as exc:
            if not self._server:  # an SQLite file that cannot be opened is not a passing outage
                raise
            raise self._unavailable(exc) from None

    def ping(self) -> None:
        """One round trip to the database (``SELECT 1``), as a readiness probe asks. Raises :class:`StoreUnavailable`
        when no connection can be had within ``pool_timeout_s`` or the server cannot be reached, the database's own
        error when it answers with one (an SQLite file gone unreadable)."""
        with self._connect() as conn:
            conn.execute(text("SELECT 1"))

    def _lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the server dropping the connection (the server then rolls back what was open)."""
        return self._server and isinstance(exc, DBAPIError) and exc.connection_invalidated

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A connection for reads, given back at the end."""
        with self._checkout(self.engine) as conn:
            try:
                yield conn
            except DBAPIError as exc:
                if self._lost(exc):
                    raise self._unavailable(exc) from None
                raise

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Connection]:
        """One transaction: committed when the block ends, rolled back (nothing written) when it raises."""
        with self._checkout(self.engine) as conn:
            trans = conn.begin()
            try:
                yield conn
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    trans.rollback()
                if self._lost(exc):  # dropped before the commit: the server rolled the transaction back
                    raise self._unavailable(exc) from None
                raise
            trans.commit()  # a connection lost here leaves the outcome unknown: raised as it is

    @staticmethod
    def _connect_redis(url: str):
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            warnings.warn(f"Redis at {url} unreachable ({exc}); going on with SQL alone", RuntimeWarning,
                          stacklevel=3)
        return client

    def __repr__(self) -> str:
        return f"SessionStore({self.engine.url.render_as_string(hide_password=True)!r})"

    # ------------------------------------------------------------------ locks and hot state

    @contextlib.contextmanager
    def lock(self, session_id: str, timeout: float = 600.0) -> Iterator[None]:
        """Exclusive right to run a turn of ``session_id`` (SQL lock, plus Redis when reachable).

        On PostgreSQL the lock holds one connection of the locks' own pool while it is held (see ``pool_size``);
        :class:`StoreUnavailable` when none is free within ``pool_timeout_s``, :class:`~.locks.LockTimeout` when
        another worker keeps the session past ``timeout``.
        """
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(sql_lock(self._lock_engine, session_id, timeout))
            except (PoolTimeout, OperationalError, InterfaceError) as exc:
                if not self._server:
                    raise
                raise self._unavailable(exc) from None
            held.enter_context(redis_lock(self.redis, session_id, timeout))
            yield

    def _hot_set(self, session_id: str, **fields: object) -> None:
        if self.redis is None:
            return
        import redis

        try:
            self.redis.hset(f"snapkv:session:{session_id}", mapping={k: str(v) for k, v in fields.items()})
        except redis.RedisError as exc:
            warnings.warn(f"Redis unreachable ({exc}); hot state not updated, SQL has it", RuntimeWarning,
                          stacklevel=3)

    def hot_state(self, session_id: str) -> dict[str, str]:
        """What Redis holds for the session (empty without Redis)."""
        if self.redis is None or not is_session_id(session_id):
            return {}
        import redis

        try:
            raw = self.redis.hgetall(f"snapkv:session:{session_id}")
        except redis.RedisError:
            return {}
        return {k.decode(): v.decode() for k, v in raw.items()}

    # ------------------------------------------------------------------ sessions

    def create_session(self, model_id: str, policy_json: str, policy_sha256: str, title: str | None = None,
                       meta: dict | None = None, *, thread_id: str | None = None, owner: str | None = None,
                       session_id: str | None = None, messages: Sequence[NewMessage] = ()) -> str:
        """A new session, holding ``messages`` (its first messages: system, history); returns its id.

        The session and its messages are one transaction: when any part fails nothing at all is stored.

        ``thread_id`` ties it to an agent framework's conversation (LangChain's ``thread_id``), found again with
        :meth:`session_for_thread` through an index. ``owner``: who may use it (the server stores a digest of the
        API key that created it), found again with :meth:`sessions_at_head`. ``session_id``: the id to give it (a
        UUID, in its canonical form), for a router that must name a session before it exists; default a new one.
        """
        if session_id is not None and not is_session_id(session_id):
            raise ConfigError("session_id", str(session_id)[:80], "must be a UUID in canonical form")
        if owner is not None and (not isinstance(owner, str) or not 0 < len(owner) <= 64):
            raise ConfigError("owner", owner, "must be a non-empty string of at most 64 characters")
        if thread_id is not None and not _storable_thread(thread_id):
            raise ConfigError("thread_id", thread_id, f"must be a non-empty string of at most {_THREAD_CHARS} "
                              "characters, without NUL")
        first = _checked(messages)
        sid = session_id or str(uuid.uuid4())
        now = _now()
        with self._begin() as conn:
            conn.execute(insert(schema.sessions).values(
                id=sid, created_at=now, updated_at=now, model_id=model_id, policy_json=policy_json,
                policy_sha256=policy_sha256, title=title, turns_done=0, head_hash=GENESIS, meta=meta or {},
                thread_id=thread_id, message_count=0, owner=owner))
            if first:
                self._append(conn, sid, first, (GENESIS, 0))  # reseals the session row
            else:
                self._reseal(conn, schema.sessions, schema.sessions.c.id == sid)
        return sid

    def _reseal(self, conn: Connection, table, *where) -> None:
        """Seal the rows just written, inside the transaction that wrote them."""
        reseal(conn, table, self._key, *where)

    def session_for_thread(self, thread_id: str, *, model_id: str | None = None, policy_sha256: str | None = None,
                           legacy_title: str | None = None) -> str | None:
        """The newest session of ``thread_id`` (optionally of one model and policy), or None.

        An indexed lookup on ``sessions.thread_id``. Several sessions of one thread (a conversation restarted
        with an edited history) resolve to the newest: latest ``created_at``, ties broken by id so that every
        worker picks the same one. ``legacy_title``: when no session carries the thread id, the newest session
        with this title and no thread id at all (created before the column existed) is taken instead; that
        fallback reads only when the indexed lookup misses.
        """
        cols = schema.sessions.c
        if not _storable_thread(thread_id):  # no session can hold it (create_session refuses it)
            return None
        found = self._newest_session(cols.thread_id == thread_id, model_id, policy_sha256)
        if found is None and legacy_title is not None and _storable_thread(legacy_title):
            found = self._newest_session((cols.title == legacy_title) & cols.thread_id.is_(None), model_id,
                                         policy_sha256)
        return found

    def _newest_session(self, where, model_id: str | None, policy_sha256: str | None) -> str | None:
        cols = schema.sessions.c
        q = select(cols.id).where(where)
        if model_id is not None:
            q = q.where(cols.model_id == model_id)
        if policy_sha256 is not None:
            q = q.where(cols.policy_sha256 == policy_sha256)
        q = q.order_by(cols.created_at.desc(), cols.id.desc()).limit(1)
        with self._connect() as conn:
            return conn.execute(q).scalar()

    def sessions_at_head(self, owner: str | None, heads: Sequence[str], *, model_id: str | None = None,
                         policy_sha256: str | None = None) -> list[dict]:
        """``owner``'s sessions whose message chain ends at one of ``heads`` (content hashes, see
        :func:`~.hashing.message_hash`), newest first: an indexed lookup of a conversation by its content."""
        cols = schema.sessions.c
        if not heads:
            return []
        q = select(cols.id, cols.head_hash, cols.message_count).where(
            cols.owner.is_(None) if owner is None else cols.owner == owner, cols.head_hash.in_(list(heads)))
        if model_id is not None:
            q = q.where(cols.model_id == model_id)
        if policy_sha256 is not None:
            q = q.where(cols.policy_sha256 == policy_sha256)
        q = q.order_by(cols.updated_at.desc(), cols.id.desc())
        with self._connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def _no_such(self, session_id: object) -> StoreError:
        return StoreError(f"session_id={bounded_repr(session_id, 80)}: no such session in {self!r}")

    # Every method taking a session id answers a value that is not one (is_session_id) as it answers a missing
    # session, without asking the database: such an id (a NUL, 10,000 characters) is no driver error.

    def resolve_id(self, text: str) -> str:
        """A full session id from ``text``: the id itself, or a unique prefix of at least 8 characters (as a person
        copies it from ``sessions list``); :class:`StoreError` when no session or several match."""
        if is_session_id(text):
            return text
        if not isinstance(text, str) or not re.fullmatch(r"[0-9a-f-]{8,35}", text):
            raise StoreError(f"session_id={str(text)[:80]!r}: no such session (an id is a UUID, or a prefix of at "
                             "least 8 of its characters)")
        cols = schema.sessions.c
        with self._connect() as conn:
            found = [r[0] for r in conn.execute(select(cols.id).where(cols.id.startswith(text, autoescape=True))
                                                .limit(2))]
        if not found:
            raise StoreError(f"session_id={text!r}: no such session (no id starts with it) in {self!r}")
        if len(found) > 1:
            raise StoreError(f"session_id={text!r}: more than one session starts with it; give more characters")
        return found[0]

    def session_exists(self, session_id: str) -> bool:
        if not is_session_id(session_id):
            return False
        with self._connect() as conn:
            found = conn.execute(select(schema.sessions.c.id).where(schema.sessions.c.id == session_id)).first()
        return found is not None

    def get_session(self, session_id: str) -> SessionRecord:
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with self._connect() as conn:
            row = conn.execute(select(schema.sessions).where(schema.sessions.c.id == session_id)).mappings().first()
        if row is None:
            raise self._no_such(session_id)
        return SessionRecord.from_row(row)

    def list_sessions(self, *, owner: str | None = None, any_owner: bool = True) -> list[SessionRecord]:
        """Every session, oldest first; with ``any_owner=False`` only ``owner``'s (None: sessions without one)."""
        n_msgs = (select(func.count()).select_from(schema.messages)
                  .where(schema.messages.c.session_id == schema.sessions.c.id).scalar_subquery())
        q = select(schema.sessions, n_msgs.label("messages")).order_by(schema.sessions.c.created_at)
        if not any_owner:
            cols = schema.sessions.c
            q = q.where(cols.owner.is_(None) if owner is None else cols.owner == owner)
        with self._connect() as conn:
            return [SessionRecord.from_row(r) for r in conn.execute(q).mappings()]

    def fork_session(self, source_id: str, up_to_seq: int, up_to_turn: int, *, owner: str | None = None,
                     title: str | None = None, session_id: str | None = None) -> str:
        """A new session holding ``source_id``'s rows as they were: its messages up to ``up_to_seq`` and its turn
        records (and their events) up to turn ``up_to_turn``, in one transaction; returns the new id.

        The messages keep their seqs and content, so their hash chain is the same; the turn records are the same
        plans, so replaying the fork rebuilds exactly the source's cache at that boundary (a live fork may start
        from a copy of that cache instead: ``Session.snapshot``). Every row is sealed anew under the new id.
        """
        s, m, t, e = schema.sessions, schema.messages, schema.turns, schema.events
        if session_id is not None and not is_session_id(session_id):
            raise ConfigError("session_id", str(session_id)[:80], "must be a UUID in canonical form")
        source = self.get_session(source_id)
        new_id, now = session_id or str(uuid.uuid4()), _now()
        with self._begin() as conn:
            msgs = [dict(r) for r in conn.execute(select(m).where(m.c.session_id == source_id, m.c.seq <= up_to_seq)
                                                  .order_by(m.c.seq)).mappings()]
            turns = [dict(r) for r in conn.execute(select(t).where(t.c.session_id == source_id,
                                                                   t.c.turn <= up_to_turn)).mappings()]
            if len(msgs) != up_to_seq or any(row["status"] == "pending" for row in turns) or any(
                    (row["assistant_seq"] or 0) > up_to_seq or row["user_seq"] > up_to_seq for row in turns):
                raise StoreError(f"session_id={source_id!r}: messages 1..{up_to_seq} and turns 1..{up_to_turn} are "
                                 "not a turn boundary of it")
            events = [dict(r) for r in conn.execute(select(e).where(e.c.session_id == source_id,
                                                                    e.c.turn <= up_to_turn)).mappings()]
            done = max((row["turn"] for row in turns if row["status"] == "done"), default=0)
            meta = {**(source["meta"] or {}), "forked_from": {"id": source_id, "turn": up_to_turn}}
            conn.execute(insert(s).values(
                id=new_id, created_at=now, updated_at=now, model_id=source["model_id"],
                policy_json=source["policy_json"], policy_sha256=source["policy_sha256"], title=title,
                turns_done=done, head_hash=msgs[-1]["hash"] if msgs else GENESIS, meta=meta, thread_id=None,
                message_count=up_to_seq, owner=owner))
            for table, rows in ((m, msgs), (t, turns), (e, events)):
                if rows:
                    conn.execute(insert(table), [{**{k: v for k, v in row.items() if k not in ("id", "seal")},
                                                  "session_id": new_id} for row in rows])
            for table in (m, t):
                self._reseal(conn, table, table.c.session_id == new_id)
            self._reseal(conn, s, s.c.id == new_id)
        return new_id

    def delete_session(self, session_id: str) -> None:
        self.get_session(session_id)
        with self._begin() as conn:
            for table in (schema.events, schema.turns, schema.messages):
                conn.execute(delete(table).where(table.c.session_id == session_id))
            conn.execute(delete(schema.sessions).where(schema.sessions.c.id == session_id))
        remove_lock_file(self.engine, session_id)  # once the session is gone (see remove_lock_file)

    # ------------------------------------------------------------------ messages

    def _head(self, conn: Connection, session_id: str) -> tuple[str, int]:
        """The session's head hash and last seq, its row locked until the transaction ends (appends serialised)."""
        sess = conn.execute(select(schema.sessions.c.head_hash).where(schema.sessions.c.id == session_id)
                            .with_for_update()).first()
        if sess is None:
            raise StoreError(f"session_id={session_id!r}: no such session")
        seq = conn.execute(select(func.coalesce(func.max(schema.messages.c.seq), 0))
                           .where(schema.messages.c.session_id == session_id)).scalar()
        return sess.head_hash, seq

    def _append(self, conn: Connection, session_id: str, news: Sequence[NewMessage], head: tuple[str, int]) -> list[dict]:
        """Append ``news`` (checked by :func:`_checked`, or built by the store) to the hash chain after ``head``
        (:meth:`_head`), inside the caller's transaction: one insert of every row, sealed here as
        :func:`~.migrations.reseal` seals the stored row, and one update of the session row."""
        prev, seq = head
        now = _now()
        rows = []
        for new in news:
            seq += 1
            digest = message_hash(prev, seq, new.role, new.name, new.content)
            # each column as the database gives it back, so that the seal computed here is the one reseal computes
            row = dict(session_id=session_id, seq=seq, role=new.role, name=new.name, content=new.content,
                       pinned=bool(new.pinned), status="active", turn=new.turn, token_count=new.token_count,
                       pins=_stored_json(new.pins), prev_hash=prev, hash=digest, created_at=now)
            rows.append(row)
            prev = digest
        if not rows:
            return []
        conn.execute(insert(schema.messages), [{**row, "seal": row_seal(self._key, "messages", row)} for row in rows])
        conn.execute(update(schema.sessions).where(schema.sessions.c.id == session_id)
                     .values(head_hash=prev, message_count=seq, updated_at=now))
        self._reseal(conn, schema.sessions, schema.sessions.c.id == session_id)
        return rows

    def add_messages(self, session_id: str, messages: Sequence[NewMessage]) -> list[dict]:
        """Commit ``messages`` (system, document, history, ...) outside a turn, in one transaction: all of them
        or, when anything fails, none. Returns the rows written, in order.

        Refused (nothing written) while a turn is pending: its reply must follow its question. Each message is
        checked (its ``token_count``: content tokens counted once by the caller, see :meth:`content_tokens`;
        ``pins``: its pinned character ranges) before the transaction opens.
        """
        news = _checked(messages)
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with self._begin() as conn:
            head = self._head(conn, session_id)  # first: a turn begun meanwhile is seen below
            t = schema.turns.c
            pending = conn.execute(select(t.turn).where(t.session_id == session_id, t.status == "pending")).first()
            if pending is not None:  # its reply must follow its question: nothing may come in between
                raise StoreError(f"session_id={session_id!r}: turn {pending.turn} is pending; resolve it first "
                                 "(Session.open answers or abandons it)")
            return self._append(conn, session_id, news, head)

    def add_message(self, session_id: str, role: str, content: str, name: str | None = None,
                    pinned: bool = False, *, token_count: int | None = None, pins: dict | None = None) -> dict:
        """Commit one message (system, document, ...) outside a turn: :meth:`add_messages` of one."""
        _check_count("token_count", token_count)
        return self.add_messages(session_id, [NewMessage(role, content, name, pinned, token_count=token_count,
                                                         pins=pins)])[0]

    def messages(self, session_id: str, include_abandoned: bool = True) -> list[MessageRecord]:
        if not is_session_id(session_id):
            return []
        q = select(schema.messages).where(schema.messages.c.session_id == session_id).order_by(schema.messages.c.seq)
        if not include_abandoned:
            q = q.where(schema.messages.c.status == "active")
        with self._connect() as conn:
            return [MessageRecord.from_row(r) for r in conn.execute(q).mappings()]

    # ------------------------------------------------------------------ token counts (admission)

    def content_tokens(self, session_id: str) -> int:
        """Sum of the stored ``token_count`` of the session's active messages (one query; 0 when empty).

        Messages stored without a count (rows written before migration m002, or by a caller without a counter)
        add nothing: find them with :meth:`messages_without_count` and store their counts with
        :meth:`set_token_counts` first.
        """
        if not is_session_id(session_id):
            return 0
        m = schema.messages.c
        q = (select(func.coalesce(func.sum(m.token_count), 0))
             .where(m.session_id == session_id, m.status == "active"))
        with self._connect() as conn:
            return int(conn.execute(q).scalar())

    def active_messages(self, session_id: str) -> int:
        """How many active messages the session holds (admission bounds their template markup by it)."""
        if not is_session_id(session_id):
            return 0
        m = schema.messages.c
        q = select(func.count()).select_from(schema.messages).where(m.session_id == session_id, m.status == "active")
        with self._connect() as conn:
            return int(conn.execute(q).scalar())

    def messages_without_count(self, session_id: str) -> dict[int, str]:
        """``{seq: content}`` of the session's active messages that have no ``token_count`` yet."""
        if not is_session_id(session_id):
            return {}
        m = schema.messages.c
        q = (select(m.seq, m.content)
             .where(m.session_id == session_id, m.status == "active", m.token_count.is_(None))
             .order_by(m.seq))
        with self._connect() as conn:
            return {row.seq: row.content for row in conn.execute(q)}

    def set_token_counts(self, session_id: str, counts: Mapping[int, int]) -> int:
        """Store ``{seq: token count}`` on messages that have none yet; returns how many rows were set.

        A message that already has a count keeps it: counts are written once, so two workers backfilling the
        same legacy session at once write the same values and neither overwrites a count taken at commit.
        """
        m = schema.messages.c
        for seq, n in counts.items():
            _check_count(f"counts[{seq}]", n)
        if not is_session_id(session_id):
            return 0
        done = 0
        with self._begin() as conn:
            for seq, n in counts.items():
                changed = conn.execute(update(schema.messages)
                                       .where(m.session_id == session_id, m.seq == seq, m.token_count.is_(None))
                                       .values(token_count=n)).rowcount
                if changed:
                    self._reseal(conn, schema.messages, m.session_id == session_id, m.seq == seq)
                done += changed
        return done

    # ------------------------------------------------------------------ turns (write-ahead)

    def begin_turn(self, session_id: str, content: str, name: str | None, policy_sha256: str, model_id: str,
                   generation: dict, seed: int | None, role: str = "user", *,
                   token_count: int | None = None, pins: dict | None = None) -> tuple[int, dict]:
        """Write-ahead: commit the user (or tool) message and a pending turn record, before any compute.

        ``token_count``: the message content's tokens, counted once by the caller.
        """
        _check_count("token_count", token_count)
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with self._begin() as conn:
            head = self._head(conn, session_id)  # first: two workers never number the same turn
            turn = conn.execute(select(func.coalesce(func.max(schema.turns.c.turn), 0))
                                .where(schema.turns.c.session_id == session_id)).scalar() + 1
            msg, = self._append(conn, session_id, [NewMessage(role, content, name, turn=turn, token_count=token_count,
                                                              pins=pins)], head)
            conn.execute(insert(schema.turns).values(
                session_id=session_id, turn=turn, status="pending", user_seq=msg["seq"], policy_sha256=policy_sha256,
                model_id=model_id, generation=generation, seed=seed, created_at=_now()))
            self._reseal(conn, schema.turns, schema.turns.c.session_id == session_id, schema.turns.c.turn == turn)
        return turn, msg

    def finish_turn(self, session_id: str, turn: int, reply: str, record: dict, events: list[tuple[str, dict]],
                    spans: dict[int, tuple[int, int]], *, token_count: int | None = None,
                    pins: dict | None = None) -> dict:
        """Atomically: the assistant message, the turn record, its events and the messages' token spans.

        ``token_count``: the reply content's tokens (as stored, before any stop-string cut), counted once.
        """
        _check_count("token_count", token_count)
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with self._begin() as conn:
            msg, = self._append(conn, session_id, [NewMessage("assistant", reply, turn=turn, token_count=token_count,
                                                              pins=pins)], self._head(conn, session_id))
            conn.execute(update(schema.turns).where(schema.turns.c.session_id == session_id,
                                                    schema.turns.c.turn == turn)
                         .values(status="done", assistant_seq=msg["seq"], finished_at=_now(), **record))
            for seq, (start, end) in spans.items():
                conn.execute(update(schema.messages).where(schema.messages.c.session_id == session_id,
                                                           schema.messages.c.seq == seq)
                             .values(token_start=start, token_end=end))
            for kind, payload in events:
                conn.execute(insert(schema.events).values(session_id=session_id, turn=turn, kind=kind,
                                                          payload=payload, created_at=_now()))
            conn.execute(update(schema.sessions).where(schema.sessions.c.id == session_id)
                         .values(turns_done=turn, updated_at=_now()))
            self._reseal(conn, schema.turns, schema.turns.c.session_id == session_id, schema.turns.c.turn == turn)
            self._reseal(conn, schema.sessions, schema.sessions.c.id == session_id)
        self._hot_set(session_id, turns_done=turn, head_hash=msg["hash"])
        return msg

    def abandon_turn(self, session_id: str, turn: int, reason: str, error: dict | None = None) -> bool:
        """Close a pending turn without a reply: its user message is kept (for the audit) but marked abandoned.

        ``error`` (its type and message) is recorded as an ``error`` event in the same transaction. Only a
        pending turn is closed: a turn that was committed (done) before the failure stays as it is; returns
        whether the turn was closed here.
        """
        if not is_session_id(session_id):
            return False
        t = schema.turns.c
        with self._begin() as conn:
            row = conn.execute(select(schema.turns).where(t.session_id == session_id, t.turn == turn,
                                                          t.status == "pending")).mappings().first()
            if row is None:
                return False
            if error is not None:
                conn.execute(insert(schema.events).values(session_id=session_id, turn=turn, kind="error",
                                                          payload=error, created_at=_now()))
            conn.execute(update(schema.turns).where(schema.turns.c.id == row["id"])
                         .values(status="abandoned", finished_at=_now()))
            conn.execute(update(schema.messages).where(schema.messages.c.session_id == session_id,
                                                       schema.messages.c.seq == row["user_seq"])
                         .values(status="abandoned"))
            conn.execute(insert(schema.events).values(session_id=session_id, turn=turn, kind="abandoned",
                                                      payload={"reason": reason}, created_at=_now()))
            self._reseal(conn, schema.turns, schema.turns.c.id == row["id"])
            self._reseal(conn, schema.messages, schema.messages.c.session_id == session_id,
                         schema.messages.c.seq == row["user_seq"])
        return True

    def add_event(self, session_id: str, kind: str, payload: dict, turn: int | None = None) -> None:
        if not is_session_id(session_id):
            raise self._no_such(session_id)
        with self._begin() as conn:
            conn.execute(insert(schema.events).values(session_id=session_id, turn=turn, kind=kind, payload=payload,
                                                      created_at=_now()))

    def turns(self, session_id: str, status: str | None = None) -> list[TurnRecord]:
        if not is_session_id(session_id):
            return []
        q = select(schema.turns).where(schema.turns.c.session_id == session_id).order_by(schema.turns.c.turn)
        if status is not None:
            q = q.where(schema.turns.c.status == status)
        with self._connect() as conn:
            return [TurnRecord.from_row(r) for r in conn.execute(q).mappings()]

    def pending_turn(self, session_id: str) -> TurnRecord | None:
        pending = self.turns(session_id, status="pending")
        return pending[-1] if pending else None

    def events(self, session_id: str) -> list[EventRecord]:
        if not is_session_id(session_id):
            return []
        q = select(schema.events).where(schema.events.c.session_id == session_id).order_by(schema.events.c.id)
        with self._connect() as conn:
            return [EventRecord.from_row(r) for r in conn.execute(q).mappings()]

    # ------------------------------------------------------------------ integrity

    def verify(self, session_id: str) -> list[str]:
        """Every check of the stored rows; returns the problems found, each naming its row (empty when intact)."""
        return self.integrity(session_id).problems

    def integrity(self, session_id: str) -> Integrity:
        """The hash chain over the messages' content, each row's seal (any other column edited), the session's
        head and message count against the messages (a deleted last message), and the turns against the messages
        they reference."""
        session, messages, turns = self.get_session(session_id), self.messages(session_id), self.turns(session_id)
        rows = [("sessions", session, "the session row"),
                *(("messages", m, f"message seq {m['seq']} ({m['role']})") for m in messages)]
        turn_rows = [("turns", t, f"turn {t['turn']}") for t in turns]
        unsealed = self._unsealed(rows), self._unsealed(turn_rows)
        if len(rows) + len(turn_rows) > 1 and sum(map(len, unsealed)) == len(rows) + len(turn_rows):
            return Integrity(["no row's seal matches: the store was sealed with another key "
                              "(SNAPKV_SESSIONS_SEAL_KEY) or every row was altered"], [])
        return Integrity(chain_problems(session, messages) + unsealed[0],
                         unsealed[1] + turn_problems(session, messages, turns))

    def _unsealed(self, rows: list[tuple[str, dict, str]]) -> list[str]:
        return [f"{what}: altered outside the store (its seal does not match)" for table, row, what in rows
                if row["seal"] != row_seal(self._key, table, row)]

    def export(self, session_id: str) -> dict:
        """The whole session as plain data (kept-position blobs left out)."""
        turns = [{k: v for k, v in t.items() if k != "kept_positions"} for t in self.turns(session_id)]
        return {"session": self.get_session(session_id).to_dict(),
                "messages": [m.to_dict() for m in self.messages(session_id)], "turns": turns,
                "events": [e.to_dict() for e in self.events(session_id)]}
