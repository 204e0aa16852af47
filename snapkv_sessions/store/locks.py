"""Per-session locks, so that two workers never run one session at once.

A session's lock is always taken at the SQL level (a PostgreSQL advisory lock, or an ``flock`` on a file beside
the SQLite database), and also in Redis when Redis is configured and reachable. If Redis is unreachable the SQL
lock still serialises the workers; a warning says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Engine

from .. import stats
from ..errors import SnapKVError


class LockTimeout(SnapKVError, TimeoutError):
    """The session's lock was not acquired in time."""


def _timeout(session_id: str, timeout: float, where: str) -> LockTimeout:
    """The error for a lock not acquired in time, counted as a ``lock_timeout`` fault (:mod:`snapkv_sessions.stats`)."""
    stats.fault("lock_timeout", session_id, f"{where} lock not acquired within {timeout:.0f} s")
    what = "Redis lock" if where == "Redis" else "lock"
    return LockTimeout(f"session_id={session_id!r}: {what} not acquired within {timeout:.0f} s")


REDIS_TTL_S = 15.0
REMOVE_WAIT_S = 0.5  # how long remove_lock_file waits for a lock another holds
_thread_locks: dict[str, threading.Lock] = {}
_thread_guard = threading.Lock()


def _pg_unlock(conn, key: int) -> None:
    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    conn.commit()


def _file_unlock(fh) -> None:
    fcntl.flock(fh, fcntl.LOCK_UN)


def _release(unlock, handle, *args: object) -> None:
    """Unlock, never raising: an unlock that fails must not hide the error (or the committed turn) it follows.

    A PostgreSQL connection that cannot unlock is invalidated: the server ends its session, and with it the
    advisory lock; a lock file's ``flock`` goes with the file when it is closed.
    """
    try:
        unlock(handle, *args)
    except Exception as exc:  # noqa: BLE001 - whatever the store raised, the lock is given up the hard way
        if hasattr(handle, "invalidate"):
            with contextlib.suppress(Exception):
                handle.invalidate()
        warnings.warn(f"session lock release failed ({type(exc).__name__}: {str(exc)[:200]}); the lock was dropped "
                      "with its connection", RuntimeWarning, stacklevel=4)


# The lock files this process holds, per thread: (path, thread id) -> how many times (a thread that deletes a
# session inside its own lock has the file unlinked as it releases it; see remove_lock_file)
_held: dict[tuple[str, int], int] = {}
_doomed: set[str] = set()  # lock files to unlink when the thread holding them releases them
_held_guard = threading.Lock()


def _lock_path(engine: Engine, session_id: str) -> Path | None:
    """The lock file of ``session_id`` beside a file-backed SQLite database; None for other stores."""
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:":
        return None
    return Path(db + ".locks") / f"{session_id}.lock"


def _same_file(fh, path: Path) -> bool:
    """``fh`` is still the file at ``path`` (not one unlinked, or unlinked and created anew, since it was opened)."""
    try:
        held, now = os.fstat(fh.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _flock_current(path: Path, deadline: float, session_id: str, timeout: float):
    """The open lock file at ``path``, ``flock``'ed exclusively; waits until ``deadline``.

    A lock file may be unlinked (:func:`remove_lock_file`) while others wait on it: a waiter that then gets the
    ``flock`` of the unlinked file holds nothing, so after each ``flock`` the file must still be the one at ``path``;
    if it is not, it is closed and the file now at ``path`` (created anew if need be) is locked instead.
    """
    while True:
        fh = open(path, "a+")  # closed here on every path but the one returning it
        try:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise _timeout(session_id, timeout, "file") from None
                    time.sleep(0.05)
            if _same_file(fh, path):
                return fh
        except BaseException:
            fh.close()
            raise
        fh.close()  # the lock of an unlinked file: try the current one


def remove_lock_file(engine: Engine, session_id: str) -> None:
    """Remove the lock file of a deleted session (SQLite stores; other stores have none). Never raises.

    Call it only once the session is gone from the store. Why this is safe: unlinking a file that another holds
    would break mutual exclusion (a newcomer would create and lock a fresh file while the holder still runs), so the
    file is only ever unlinked by one holding its ``flock``: here, after taking it briefly, or, when this thread
    deletes the session inside its own ``lock()``, by that lock itself as it is released. Those who were waiting on
    the unlinked file then find it is no longer the file at its path and lock the current one instead
    (:func:`_flock_current`), so exclusion holds even if a session of this id is created again; and a later lock of
    the deleted id finds no session anyway. If another holds the lock past :data:`REMOVE_WAIT_S`, the file is left
    (a few bytes; a later delete of that id removes it). A missing file is no error.
    """
    path = _lock_path(engine, session_id)
    if path is None or path.name != f"{session_id}.lock":  # an id with a "/" never names a file elsewhere
        return
    try:
        with _held_guard:
            if _held.get((str(path), threading.get_ident()), 0):
                _doomed.add(str(path))  # this thread holds it: unlinked as its lock is released, still held
                return
        if not path.exists():
            return
        try:  # (should the file vanish meanwhile, this creates it anew, and unlinks it just the same)
            fh = _flock_current(path, time.monotonic() + REMOVE_WAIT_S, session_id, REMOVE_WAIT_S)
        except LockTimeout:
            return
        with fh:
            try:
                path.unlink(missing_ok=True)
            finally:
                _release(_file_unlock, fh)
    except OSError as exc:  # the session is deleted; a lock file left behind is no reason to say otherwise
        warnings.warn(f"session {session_id}: lock file {path} not removed ({exc.strerror})", RuntimeWarning,
                      stacklevel=2)


def _key64(session_id: str) -> int:
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def sql_lock(engine: Engine, session_id: str, timeout: float) -> Iterator[None]:
    """The SQL-level lock of one session (advisory lock, file lock, or an in-process lock for ``:memory:``)."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            deadline = time.monotonic() + timeout
            while not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _key64(session_id)}).scalar():
                if time.monotonic() > deadline:
                    raise _timeout(session_id, timeout, "database")
                time.sleep(0.05)
            # the advisory lock belongs to the connection, not the transaction: end the transaction, so the held
            # connection is not "idle in transaction" for a whole turn (idle_in_transaction_session_timeout)
            conn.commit()
            try:
                yield
            finally:
                _release(_pg_unlock, conn, _key64(session_id))
        return
    path = _lock_path(engine, session_id)
    if path is not None:
        path.parent.mkdir(exist_ok=True)
        deadline = time.monotonic() + timeout
        fh = _flock_current(path, deadline, session_id, timeout)
        key = (str(path), threading.get_ident())
        with _held_guard:
            _held[key] = _held.get(key, 0) + 1
        try:
            yield
        finally:
            with _held_guard:
                _held[key] -= 1
                doomed = not _held[key] and str(path) in _doomed
                if not _held[key]:
                    del _held[key]
                    _doomed.discard(str(path))
            with fh:
                if doomed:  # its session was deleted under this lock (remove_lock_file): unlinked while still held
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
                _release(_file_unlock, fh)
        return
    with _thread_guard:
        lock = _thread_locks.setdefault(f"{engine.url}:{session_id}", threading.Lock())
    if not lock.acquire(timeout=timeout):
        raise _timeout(session_id, timeout, "file")
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def redis_lock(client, session_id: str, timeout: float) -> Iterator[bool]:
    """Redis lock of one session; yields False (and warns) when Redis is absent or unreachable."""
    if client is None:
        yield False
        return
    import redis

    # A short TTL, renewed while held, so that a killed worker's lock frees itself within seconds.
    # thread_local=False: the renewal thread extends the lock, and a thread-local token is invisible to it
    lock = client.lock(f"snapkv:lock:{session_id}", timeout=REDIS_TTL_S, blocking_timeout=timeout,
                       thread_local=False)
    try:
        acquired = lock.acquire()
    except redis.RedisError as exc:
        warnings.warn(f"Redis unreachable ({exc}); session {session_id} goes on with the SQL lock alone",
                      RuntimeWarning, stacklevel=3)
        yield False
        return
    if not acquired:
        raise _timeout(session_id, timeout, "Redis")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(REDIS_TTL_S / 3):
            with contextlib.suppress(redis.RedisError):
                lock.reacquire()

    keeper = threading.Thread(target=renew, name=f"snapkv-lock-{session_id[:8]}", daemon=True)
    keeper.start()
    try:
        yield True
    finally:
        stop.set()
        keeper.join()
        with contextlib.suppress(redis.RedisError, redis.exceptions.LockError):
            lock.release()
