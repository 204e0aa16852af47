"""Per-session locks, so that two workers never run one session at once.

A session's lock is always taken at the SQL level (a PostgreSQL advisory lock, or an ``flock`` on a file beside
the SQLite database), and also in Redis when Redis is configured and reachable. If Redis is unreachable the SQL
lock still serialises the workers; a warning says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Engine

from ..errors import SnapKVError


class LockTimeout(SnapKVError, TimeoutError):
    """The session's lock was not acquired in time."""


REDIS_TTL_S = 15.0
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
                    raise LockTimeout(f"session_id={session_id!r}: lock not acquired within {timeout:.0f} s")
                time.sleep(0.05)
            try:
                yield
            finally:
                _release(_pg_unlock, conn, _key64(session_id))
        return
    db = engine.url.database
    if engine.dialect.name == "sqlite" and db and db != ":memory:":
        lock_dir = Path(db + ".locks")
        lock_dir.mkdir(exist_ok=True)
        with open(lock_dir / f"{session_id}.lock", "a+") as fh:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LockTimeout(f"session_id={session_id!r}: lock not acquired within {timeout:.0f} s") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                _release(_file_unlock, fh)
        return
    with _thread_guard:
        lock = _thread_locks.setdefault(f"{engine.url}:{session_id}", threading.Lock())
    if not lock.acquire(timeout=timeout):
        raise LockTimeout(f"session_id={session_id!r}: lock not acquired within {timeout:.0f} s")
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
        raise LockTimeout(f"session_id={session_id!r}: Redis lock not acquired within {timeout:.0f} s")
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
