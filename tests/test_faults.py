"""Store faults at each write of a turn: the session is never corrupted, and the original error is reported.

Each case makes one or more store writes fail as a lost database does (``OperationalError``), then brings the
store back and checks that the same ``Session`` object and a reopened one both continue, that the hash chain
verifies, and that ``replay --verify`` (``audit.verify``) re-executes every done turn identically.
"""

from __future__ import annotations

import pytest
from conftest import pg_store
from sqlalchemy.exc import OperationalError

from snapkv_sessions import Session, SessionStore, audit
from snapkv_sessions.store import locks

POLICY = {"compression": {"budget": 64, "window": 8}, "pins": {"roles": ["system"]}, "drift": {"embedder": "none"}}
DOC = " ".join(f"Parcel {1000 + i} goes to {name}." for i, name in enumerate(["Ada", "Ben", "Cleo", "Dev", "Eli",
                                                                              "Fay", "Gus", "Hana"]))


def lost(*_args, **_kwargs):
    raise OperationalError("UPDATE turns ...", {}, ConnectionError("server closed the connection unexpectedly"))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service)])
def store(request, tmp_path) -> SessionStore:
    if request.param == "sqlite":
        return SessionStore(f"sqlite:///{tmp_path / 'faults.db'}")
    return pg_store()


def start(smollm2, store: SessionStore) -> Session:
    session = Session.create(smollm2, policy=POLICY, store=store, system="Answer briefly.")
    session.add_document(DOC, name="parcels")
    session.chat("Who gets parcel 1002?", max_new_tokens=4)
    return session


def check_continues(smollm2, session: Session) -> None:
    """The same object and a reopened one both run turns; the chain verifies; every done turn re-executes."""
    store = session.store
    session.chat("And parcel 1005?", max_new_tokens=4)
    reopened = Session.open(session.id, model=smollm2, store=store)
    reopened.chat("And parcel 1006?", max_new_tokens=4)
    assert store.pending_turn(session.id) is None
    assert store.verify(session.id) == []
    done = store.turns(session.id, status="done")
    assert all(t["prefill_tokens"] for t in done)  # nothing recorded as done that was not computed in full
    result = audit.verify(store, session.id, model=smollm2)
    assert result.ok, result.mismatch
    assert result.turns_checked == len(done)


def test_begin_fails_nothing_is_stored(smollm2, store, monkeypatch):
    session = start(smollm2, store)
    before = len(store.messages(session.id))
    monkeypatch.setattr(store, "begin_turn", lost)
    with pytest.raises(OperationalError):
        session.chat("Who gets parcel 1003?", max_new_tokens=4)
    monkeypatch.undo()
    assert len(store.messages(session.id)) == before and store.pending_turn(session.id) is None
    check_continues(smollm2, session)


def test_finish_fails_the_turn_is_abandoned(smollm2, store, monkeypatch):
    session = start(smollm2, store)
    monkeypatch.setattr(store, "finish_turn", lost)
    with pytest.raises(OperationalError):
        session.chat("Who gets parcel 1003?", max_new_tokens=4)
    monkeypatch.undo()
    assert [t["status"] for t in store.turns(session.id)] == ["done", "abandoned"]
    error = next(e for e in store.events(session.id) if e["kind"] == "error")
    assert error["turn"] == 2 and error["payload"]["type"] == "OperationalError"
    check_continues(smollm2, session)


def test_store_down_during_the_turn_leaves_it_pending_then_answered(smollm2, store, monkeypatch):
    """finish and abandon (which carries the error event) both fail: the original error reaches the caller,
    the turn stays pending, and the same Session answers it in full on its next use."""
    session = start(smollm2, store)
    monkeypatch.setattr(store, "finish_turn", lost)
    monkeypatch.setattr(store, "abandon_turn", lost)
    with pytest.warns(RuntimeWarning, match="stays pending"), pytest.raises(OperationalError, match="UPDATE turns"):
        session.chat("Who gets parcel 1003?", max_new_tokens=4)
    monkeypatch.undo()
    assert session.state.next_position == 0  # the half-built cache was dropped first
    assert store.pending_turn(session.id)["turn"] == 2
    # the recovered event cannot be written either: the next use fails cleanly and changes nothing
    monkeypatch.setattr(store, "add_event", lost)
    with pytest.raises(OperationalError):
        session.chat("And parcel 1004?", max_new_tokens=4)
    monkeypatch.undo()
    assert store.pending_turn(session.id)["turn"] == 2
    reply = session.chat("And parcel 1004?", max_new_tokens=4)
    assert session.recovered is not None and session.recovered.turn == 2 and reply.turn == 3
    assert [t["status"] for t in store.turns(session.id)] == ["done", "done", "done"]
    check_continues(smollm2, session)


def test_unlock_fails_the_committed_turn_stands(smollm2, store, monkeypatch):
    session = start(smollm2, store)
    monkeypatch.setattr(locks, "_pg_unlock", lost)
    monkeypatch.setattr(locks, "_file_unlock", lost)
    with pytest.warns(RuntimeWarning, match="lock release failed"):
        reply = session.chat("Who gets parcel 1003?", max_new_tokens=4)
    monkeypatch.undo()
    assert reply.turn == 2 and store.turns(session.id)[-1]["status"] == "done"
    check_continues(smollm2, session)  # the lock was given up with its connection: the next turns get it


def test_unlock_failure_does_not_hide_the_turns_error(smollm2, store, monkeypatch):
    session = start(smollm2, store)
    monkeypatch.setattr(store, "finish_turn", lost)
    monkeypatch.setattr(locks, "_pg_unlock", lambda *a: (_ for _ in ()).throw(RuntimeError("unlock")))
    monkeypatch.setattr(locks, "_file_unlock", lambda *a: (_ for _ in ()).throw(RuntimeError("unlock")))
    with pytest.warns(RuntimeWarning, match="lock release failed"), pytest.raises(OperationalError):
        session.chat("Who gets parcel 1003?", max_new_tokens=4)
    monkeypatch.undo()
    check_continues(smollm2, session)
