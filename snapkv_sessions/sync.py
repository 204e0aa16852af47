"""The model side of a session, kept in step with the store: the cache, transcript and drift monitor a session
holds, running one turn plan on them (the one path of live turns, replays and re-prefills), and catching up with
the store (``_sync``: done turns not applied here are replayed, their reply tokens forced; a pending one is
answered or reported). :class:`~snapkv_sessions.session.Session` builds its live turns on top."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from . import stats
from .chat import Message
from .drift import DriftMonitor
from .generation import GenerationConfig
from .messages import SessionMessages
from .runner import TurnRun
from .state import KVState
from .store import StoreError
from .store.records import TurnRecord
from .tierpool import POOL
from .transcript import TurnContext, TurnPlan
from .turn import Reply, emit_turn


class SessionSync(SessionMessages):
    """A session's cache and its replay from the store. The session supplies (beside what
    :class:`SessionMessages` needs) its tokenizer, model id, drift monitor, ``on_pending`` and ``_run`` (a live
    turn: a pending one is answered through it)."""

    tokenizer: object
    model_id: str
    on_pending: str
    drift: DriftMonitor
    state: KVState | None
    turns_applied: int
    recovered: Reply | None
    last_reply: Reply

    def _run(self, turn: int, user_seq: int, gen: GenerationConfig) -> Iterator[str]:
        raise NotImplementedError

    def _start_cache(self) -> None:
        """The memory configured and an empty cache (called once, by the session's constructor)."""
        self._lease = contextlib.ExitStack()  # the memory's hold for the turn in hand (HotOnly.lease)
        if self.policy.tiered:
            POOL.configure(self.policy.memory.max_bytes, self.policy.memory.spill_dir)
        self.state = None
        self._reset()

    def new_drift_monitor(self) -> DriftMonitor:
        drift = self.policy.drift
        return DriftMonitor(drift.embedder, self.runner.model, self.tokenizer, subjects=drift.new_subject,
                            follow_ups=bool(drift.follow_ups))

    def _reset(self) -> None:
        """Forget everything model-side; the next use replays the store from the start."""
        self._restart_cache()
        self.drift.reset()
        self.turns_applied = 0

    def _restart_cache(self) -> None:
        if self.state is not None:
            self.state.cache.release()
        memory = self.policy.memory
        self.state = self.runner.new_state(tiered=self.policy.tiered,
                                           refeed_reply=self.policy.tiered and memory.refeed_reply,
                                           recall=memory.recall if self.policy.tiered else None)
        self.transcript.reset()
        self._kept_before: tuple[list[np.ndarray], int] | None = None  # the last live compression's kept set

    # ------------------------------------------------------------------ one plan on the cache

    def _tier_done(self) -> None:
        """The turn's hold on the memory ends (a tier may be evicted again; :meth:`HotOnly.lease`)."""
        self._lease.close()

    def _context(self, user_seq: int, reprefill: bool) -> TurnContext:
        return TurnContext(user_seq=user_seq, pending=len(self.state.pending), reprefill=reprefill,
                           refed=0 if reprefill else self.state.cache.refeedable(self.state),
                           window=self.policy.compression.window, min_prompt_tokens=self.policy.min_prompt_tokens)

    def _execute(self, plan: TurnPlan, msgs: list[Message], user_seq: int, gen: GenerationConfig | None = None,
                 forced: list[int] | None = None) -> TurnRun:
        """Run one turn's plan on the cache: the one path of live turns, replays and re-prefills."""
        if plan.reprefill:  # the store is the source of truth: the whole prompt is rebuilt from it
            self._restart_cache()
            self.drift.reset()
        if self.state.cache.lost:  # only a live turn decides; a replay follows the record
            raise StoreError(f"session_id={self.id!r}: the cold tier was lost ({self.state.cache.lost}) during "
                             "a replay; open the session again")
        self._lease.enter_context(self.state.cache.lease())  # held until the turn ends (_tier_done)
        plan = self.transcript.attach(plan, msgs, self._context(user_seq, plan.reprefill))
        run = self.runner.run(self.state, plan, self.policy.compression, gen, forced)
        self.transcript.advance(plan)
        self.drift.observe(next(m.content for m in msgs if m.seq == user_seq), self.transcript.text)
        return run

    # ------------------------------------------------------------------ replay / sync

    def _sync(self) -> None:
        """Bring the cache up to the store: replay done turns not applied here; resolve a pending one."""
        rows = self.store.turns(self.id)  # one read: the done turns to replay and a pending one
        done = [r for r in rows if r.status == "done"]
        if self.state.cache.lost and any(r.turn > self.turns_applied for r in done):
            self._reset()  # turns to catch up on, and no tier to run them on: rebuild both from the start
        try:
            for rec in done:
                if rec.turn > self.turns_applied:
                    self._replay(rec)
        except BaseException:  # a half-replayed turn: rebuild from the start next time
            self._reset()
            raise
        pending = next((r for r in reversed(rows) if r.status == "pending"), None)
        if pending is None:
            return
        if self.on_pending == "report":
            self.store.abandon_turn(self.id, pending.turn, reason="worker died before the reply; reported on open")
            return
        self.store.add_event(self.id, "recovered", {"answered_pending_turn": pending.turn}, turn=pending.turn)
        for _ in self._run(pending.turn, pending.user_seq, GenerationConfig.from_record(pending.generation)):
            pass
        self.recovered = self.last_reply

    def _replay(self, rec: TurnRecord) -> None:
        """Run one recorded turn's plan again, its reply tokens forced: the cache ends as the live turn left it."""
        plan = TurnPlan.from_record(rec.segments, rec.prefill_tokens)
        reply = rec.decode_tokens + rec.pending_tokens
        try:
            result = self._execute(plan, self.messages(up_to_seq=rec.user_seq), rec.user_seq, forced=reply).finish()
        finally:
            self._tier_done()
        emit_turn(self.id, rec.turn, self.model_id, rec.drift_decision or "kept",
                  stats.REPREFILL_AS_RECORDED if plan.reprefill else None, plan, result, self.state, replay=True)
        self.transcript.extend_reply(rec.user_seq + 1, reply)
        self.turns_applied = rec.turn
