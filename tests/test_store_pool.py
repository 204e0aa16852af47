"""The store's connections on a database server: transactions hold a connection only while they run, a held session
lock holds one of its own pool (never a transaction's), a store that cannot serve a connection in time raises
StoreUnavailable fast (a server's 503 with Retry-After), having written nothing."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from conftest import PG_URL, pg_store, run_in_threads
from sqlalchemy import create_engine, text

from snapkv_sessions.errors import ConfigError
from snapkv_sessions.store import NewMessage, SessionStore, StoreError, StoreUnavailable


def docs(n: int) -> list[NewMessage]:
    return [NewMessage("document", f"doc {i}", token_count=1) for i in range(n)]


def new_session(store: SessionStore) -> str:
    return store.create_session("m", "{}", "p" * 64)


def pg(**kw) -> SessionStore:
    pg_store().close()  # skips when no server
    return SessionStore(PG_URL, **kw)


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("kw", "param"), [
    ({"pool_size": 0}, "pool_size"), ({"pool_size": -1}, "pool_size"), ({"pool_size": 2.0}, "pool_size"),
    ({"pool_size": True}, "pool_size"), ({"pool_size": "4"}, "pool_size"),
    ({"pool_timeout_s": 0}, "pool_timeout_s"), ({"pool_timeout_s": -1.0}, "pool_timeout_s"),
    ({"pool_timeout_s": float("nan")}, "pool_timeout_s"), ({"pool_timeout_s": float("inf")}, "pool_timeout_s"),
    ({"pool_timeout_s": True}, "pool_timeout_s"), ({"pool_timeout_s": "1"}, "pool_timeout_s"),
])
def test_bad_pool_settings_are_refused(tmp_path, kw, param):
    with pytest.raises(ConfigError) as err:
        SessionStore(f"sqlite:///{tmp_path / 's.db'}", **kw)
    assert err.value.param == param
    assert not (tmp_path / "s.db").exists()  # refused before anything was opened


def test_store_unavailable_keeps_its_retry_after_across_processes():
    exc = pickle.loads(pickle.dumps(StoreUnavailable("no connection", 3)))
    assert isinstance(exc, StoreError) and exc.retry_after == 3 and str(exc) == "no connection"


# ---------------------------------------------------------------------- held locks and transactions


@pytest.mark.service
def test_held_locks_never_take_the_transactions_connections():
    """4 turns of 4 sessions hold their locks at once and run their transactions meanwhile, on a pool of 4. With the
    locks drawn from the transactions' pool, the 4 held locks would leave none for the transactions."""
    app = f"snapkv-pool-{uuid.uuid4().hex[:8]}"
    store = SessionStore(f"{PG_URL}?application_name={app}", pool_size=4, pool_timeout_s=2.0)
    admin = create_engine(PG_URL)
    try:
        sids = [new_session(store) for _ in range(4)]
        held = threading.Barrier(4, timeout=30)
        seen: dict[str, tuple[int, int, int]] = {}

        def turn(sid: str) -> int:
            with store.lock(sid):
                held.wait()  # every lock is held from here on
                if sid == sids[0]:
                    with admin.connect() as conn:
                        backends = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE application_name "
                                                     "= :a"), {"a": app}).scalar()
                    seen["peak"] = (store._lock_engine.pool.checkedout(), store.engine.pool.checkedout(), backends)
                for _ in range(3):
                    store.add_messages(sid, docs(2))
                    store.turns(sid)
                    store.messages(sid)
                held.wait()  # still held while the others work
            return len(store.messages(sid))

        assert run_in_threads(turn, sids, timeout_s=60) == {sid: 6 for sid in sids}
        locks, transactions, backends = seen["peak"]
        assert locks == 4 and transactions <= 4  # the locks on their own pool, counted there
        assert 4 <= backends <= 2 * 4  # a process holds at most 2 * pool_size connections
        assert all(store.verify(sid) == [] for sid in sids)
        assert store.engine.pool.checkedout() == 0 and store._lock_engine.pool.checkedout() == 0
    finally:
        store.close()
        admin.dispose()


# ---------------------------------------------------------------------- a full pool is answered fast


@pytest.mark.service
def test_a_full_pool_is_store_unavailable_within_the_timeout():
    store = pg(pool_size=1, pool_timeout_s=0.5)
    try:
        sid = new_session(store)
        store.add_messages(sid, docs(2))
        with store.engine.connect():  # the pool's one connection, held elsewhere
            for call in (lambda: store.messages(sid), lambda: store.get_session(sid),
                         lambda: store.add_messages(sid, docs(3)), lambda: new_session(store)):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable) as err:
                    call()
                assert time.monotonic() - t0 < 1.5
                assert err.value.retry_after >= 1 and "no connection free within 0.5 s" in str(err.value)
        assert len(store.messages(sid)) == 2 and store.get_session(sid)["message_count"] == 2  # nothing written
        other = new_session(store)
        with store.lock(sid):  # the locks' pool of one is taken; the transactions' is not
            assert len(store.messages(sid)) == 2
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as err, store.lock(other):  # not a 600 s lock wait
                pass
            assert time.monotonic() - t0 < 1.5 and err.value.retry_after >= 1
        with store.lock(other):  # given back
            pass
    finally:
        store.close()


# ---------------------------------------------------------------------- an unreachable server


def test_an_unreachable_server_is_store_unavailable_at_open():
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        SessionStore("postgresql+psycopg://root@127.0.0.1:1/test", pool_timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert isinstance(err.value, StoreError) and err.value.retry_after >= 1
    assert "cannot be reached" in str(err.value) and "127.0.0.1:1" in str(err.value)


PROXY = """
import socket, sys, threading
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(64)
print("ready", flush=True)
while True:
    client, _ = listener.accept()
    server = socket.create_connection(("127.0.0.1", 5432))
    for a, b in ((client, server), (server, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def start_proxy(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PROXY, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.service
def test_a_server_gone_mid_use_is_store_unavailable_and_comes_back():
    pg_store().close()  # skips when no server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = start_proxy(port)
    store = SessionStore(PG_URL.replace("127.0.0.1:5432", f"127.0.0.1:{port}"), pool_size=2, pool_timeout_s=1.0)
    try:
        sid = new_session(store)
        store.add_messages(sid, docs(2))
        proxy.kill()  # the server is gone: the pooled connections are dead
        proxy.wait()
        def lock_once() -> None:
            with store.lock(sid):
                pass

        for call in (lambda: store.messages(sid), lambda: store.add_messages(sid, docs(3)), lock_once):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert time.monotonic() - t0 < 5 and err.value.retry_after >= 1
        proxy = start_proxy(port)  # back: the store reconnects by itself, and the refused append wrote nothing
        assert [m["content"] for m in store.messages(sid)] == ["doc 0", "doc 1"]
        store.add_messages(sid, docs(1))
        assert store.get_session(sid)["message_count"] == 3 and store.verify(sid) == []
    finally:
        store.close()
        proxy.kill()
        proxy.wait()
