"""Forks of a session: from a stored turn (the fork's first turn prefills its history from the store) or from a
:class:`Snapshot` of a live session's cache at a turn boundary (the fork's next turn prefills only what is new).

A fork is a session of its own: its rows are copied in one transaction (:meth:`SessionStore.fork_session`), so
replaying it runs the same turn records and a reopened fork holds exactly the snapshot's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .chat import Message
from .drift import DriftMonitor
from .errors import ConfigError
from .state import KVState
from .transcript import Transcript

if TYPE_CHECKING:
    from .policy import Policy
    from .runner import ModelRunner
    from .session import Session
    from .store import SessionStore


@dataclass(frozen=True)
class Snapshot:
    """A session's model-side state at a turn boundary, held in memory (:func:`snapshot`): the cache (hot
    copied, cold shared), the transcript and the drift working set, and the store rows they stand for (messages up
    to ``up_to_seq``, turns up to ``up_to_turn``). Forks start from it (:func:`from_snapshot`)."""

    source_id: str
    owner: str | None
    up_to_seq: int
    up_to_turn: int
    turns_applied: int
    state: KVState
    transcript: Transcript
    drift: DriftMonitor


def fork_at(session: Session, turn: int | None, title: str | None) -> Session:
    """A new session holding ``session``'s conversation up to and including the reply of ``turn`` (default: the
    last done turn), with the same model, policy and owner; its first turn prefills its whole history."""
    from .session import Session

    done = {rec.turn: rec for rec in session.store.turns(session.id, status="done")}
    if turn is None and not done:
        raise ConfigError("turn", turn, f"session {session.id} has no done turn to fork at")
    turn = max(done) if turn is None else turn
    if isinstance(turn, bool) or not isinstance(turn, int) or turn not in done:
        raise ConfigError("turn", turn, f"must be a done turn of session {session.id} ({sorted(done)})")
    history = [Message(role=m.role, content=m.content, name=m.name, pinned=m.pinned)
               for m in session.messages(up_to_seq=done[turn].assistant_seq)]
    owner = session.store.get_session(session.id).owner
    return Session.create_on(session.runner, session.model_id, session.policy, session.store,
                             {"history": history, "title": title or f"fork of {session.id} at turn {turn}",
                              "owner": owner})


def snapshot(session: Session) -> Snapshot | None:
    """``session``'s state at the turn boundary it holds; None when the cache does not hold the store's last turn
    exactly (a turn pending or not yet applied here, a tier evicted or spilled, a cache kind that does not clone)."""
    row = session.store.get_session(session.id)  # one row and two filtered reads: cheap enough for every turn
    if (row.turns_done != session.turns_applied or not session.turns_applied or not session.state.cache.can_clone()
            or session.store.pending_turn(session.id) is not None):
        return None
    abandoned = [rec.turn for rec in session.store.turns(session.id, status="abandoned")]
    transcript = Transcript(session.tokenizer, session.policy.pins)
    transcript.copy_from(session.transcript)
    drift = session.new_drift_monitor()
    drift.copy_from(session.drift)
    return Snapshot(session.id, row.owner, row.message_count, max([session.turns_applied, *abandoned]),
                    session.turns_applied, session.state.clone(), transcript, drift)


def from_snapshot(snap: Snapshot, runner: ModelRunner, model_id: str, policy: Policy, store: SessionStore, *,
                  session_id: str | None = None, title: str | None = None) -> Session:
    """A fork at ``snap``'s boundary: the source's rows up to it (messages and turn records, copied in one
    transaction) and a copy of the snapshot's cache, so its next turn prefills only what is new. The source's
    owner; ``session_id``: the id to give it."""
    from .session import Session

    sid = store.fork_session(snap.source_id, snap.up_to_seq, snap.up_to_turn, owner=snap.owner,
                             session_id=session_id,
                             title=title or f"fork of {snap.source_id} at turn {snap.turns_applied}")
    fork = Session(sid, store, runner, policy, model_id)
    fork.state.cache.release()  # the empty cache of a new session, replaced by the snapshot's
    fork.state = snap.state.clone()
    fork.transcript.copy_from(snap.transcript)
    fork.drift.copy_from(snap.drift)
    fork.turns_applied = snap.turns_applied
    return fork
