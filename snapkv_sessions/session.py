"""Session: ``chat(msg)`` turn after turn over a compressed cache, with the store as the source of truth.

Every message is committed before any compute (write-ahead); the reply and its turn record commit atomically
after it. A turn is a :class:`~snapkv_sessions.transcript.TurnPlan` made by the :class:`Transcript` and run by
:meth:`ModelRunner.run`; the plan is stored with the turn, so the cache can always be rebuilt by running the
recorded plans again (the same prefills, compressions and reply tokens): that is how a session reopens in a
new process and how a worker catches up with turns another worker ran.
Running a plan on the cache and catching up with the store are :class:`~snapkv_sessions.sync.SessionSync`'s;
this module makes and opens sessions and runs their live turns (plan, run, commit).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import TypedDict, Unpack

import numpy as np

from . import forks, stats
from .admission import Admission, AdmissionError
from .chat import Message, RenderDiverged
from .drift import Assessment, decide_reach, decide_turn
from .errors import ConfigError
from .forks import Snapshot
from .generation import GenerationConfig, TextStream
from .models import ModelSpec, bound_model, runner_for
from .policy import Policy
from .runner import ModelRunner, TurnRun
from .store import SessionStore, StoreError
from .sync import SessionSync
from .transcript import Transcript, TurnPlan
from .turn import Reply, TurnFigures, TurnOutcome, close_failed, emit_turn, kept_jaccard


class SessionOptions(TypedDict, total=False):
    """Options of :meth:`Session.create`.

    system: the system message. title: shown by ``sessions list``. redis_url: Redis for hot state and locks,
    when ``store`` is a URL. history: messages of any role (OpenAI-style dicts accepted) committed before the
    first turn, as if the conversation had happened; the first turn prefills it whole. thread_id: an agent
    framework's thread (indexed: :meth:`SessionStore.session_for_thread` finds the session again). session_id: the id
    to give the session (a canonical UUID; a router that must name a session before it exists chooses it).
    dtype: the weights' dtype when ``model`` is a name (``"auto"``: bf16 where the hardware runs it natively,
    :func:`~snapkv_sessions.models.resolve_dtype`; default float32); the session is bound to it.
    """

    system: str | None
    title: str | None
    redis_url: str | None
    history: list | None
    thread_id: str | None
    owner: str | None
    session_id: str | None
    dtype: str | None


class Session(SessionSync):
    """A multi-turn conversation whose KV cache is compressed with SnapKV after every turn.

    Build one with :meth:`create` or :meth:`open`, never directly.
    """

    def __init__(self, session_id: str, store: SessionStore, runner: ModelRunner, policy: Policy,
                 model_id: str, on_pending: str = "answer") -> None:
        if runner.tokenizer is None:
            raise ConfigError("model", model_id, "a Session needs the model's tokenizer")
        if on_pending not in ("answer", "report"):
            raise ConfigError("on_pending", on_pending, "must be 'answer' or 'report'")
        self.id, self.store, self.runner, self.policy = session_id, store, runner, policy
        self.model_id, self.on_pending = model_id, on_pending
        self.tokenizer = runner.tokenizer
        self.transcript = Transcript(self.tokenizer, policy.pins)
        self.admission = Admission(policy.limits, store, session_id, self.tokenizer,
                                   getattr(runner.model.config, "max_position_embeddings", None),
                                   self.transcript.formatter)
        self.counter = self.admission.counter
        self.drift = self.new_drift_monitor()
        self.recovered: Reply | None = None
        self._start_cache()

    @classmethod
    def create(cls, model, policy: str | dict | Policy | None = None, store: SessionStore | str | None = None,
               **options: Unpack[SessionOptions]) -> Session:
        """A new session. ``model``: bundle/hub name, folder, ``(model, tokenizer)`` or a ModelRunner; the
        options are :class:`SessionOptions`."""
        unknown = sorted(set(options) - set(SessionOptions.__annotations__))
        if unknown:
            known = list(SessionOptions.__annotations__)
            raise ConfigError(unknown[0], options[unknown[0]], f"is not a Session option (one of {known})")
        policy = Policy.load(policy).stated()
        if not isinstance(store, SessionStore):
            store = SessionStore(store, redis_url=options.get("redis_url"))
        runner, model_id = runner_for(model, options.get("dtype"))
        return cls.create_on(runner, model_id, policy, store, options)

    @classmethod
    def create_on(cls, runner: ModelRunner, model_id: str, policy: Policy, store: SessionStore,
                  options: SessionOptions) -> Session:
        """A new session on a loaded ``runner`` stored under ``model_id`` (a server names its model once for all
        its sessions); ``policy`` as loaded and stated (:meth:`Policy.stated`)."""
        system = options.get("system")
        first = [Message.coerce({"role": "system", "content": system})] if system is not None else []
        first += [Message.coerce(m) for m in options.get("history") or []]  # all checked before anything is stored
        sid = options.get("session_id") or str(uuid.uuid4())
        session = cls(sid, store, runner, policy, model_id)
        # admitted, counted and pinned in memory first; then the session and its history in one transaction
        rows = session._new_rows(first, [], session.admission.admit_all(first, new_session=True))
        store.create_session(model_id, policy.canonical_json(), policy.sha256, title=options.get("title"),
                             meta={"model_fingerprint": runner.fingerprint}, thread_id=options.get("thread_id"),
                             owner=options.get("owner"), session_id=sid, messages=rows)
        return session

    def fork(self, turn: int | None = None, *, title: str | None = None) -> Session:
        """A new session holding this one's conversation up to and including the reply of ``turn`` (default: the
        last done turn); this session is not changed (:func:`snapkv_sessions.forks.fork_at`)."""
        return forks.fork_at(self, turn, title)

    def snapshot(self) -> Snapshot | None:
        """This session's state at the turn boundary it holds, for forks to start from without a prefill
        (:func:`snapkv_sessions.forks.snapshot`); None when the cache does not hold the store's last turn exactly."""
        return forks.snapshot(self)

    def fork_from(self, snapshot: Snapshot, *, title: str | None = None) -> Session:
        """A new session holding this one's rows up to ``snapshot``'s boundary and starting from a copy of its
        cache (:meth:`from_snapshot`); this session is not changed."""
        if snapshot.source_id != self.id:
            raise ConfigError("snapshot", snapshot.source_id, f"is not a snapshot of session {self.id}")
        return forks.from_snapshot(snapshot, self.runner, self.model_id, self.policy, self.store, title=title)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, runner: ModelRunner, model_id: str, policy: Policy,
                      store: SessionStore, *, session_id: str | None = None, title: str | None = None) -> Session:
        """A fork at ``snapshot``'s boundary (:func:`snapkv_sessions.forks.from_snapshot`): its next turn prefills
        only what is new, and replaying it runs the same turn records."""
        return forks.from_snapshot(snapshot, runner, model_id, policy, store, session_id=session_id, title=title)

    @classmethod
    def open(cls, session_id: str, model=None, store: SessionStore | str | None = None,
             redis_url: str | None = None, on_pending: str = "answer") -> Session:
        """Reopen a stored session: its cache is rebuilt exactly by running the recorded turn plans again.

        A turn left pending by a crashed worker is answered (``on_pending="answer"``) or closed as abandoned
        and reported in the events (``"report"``).
        """
        session = cls._bound(session_id, model, store, redis_url, on_pending)
        with session.store.lock(session_id):
            session._sync()
        return session

    @classmethod
    def rebuild(cls, session_id: str, model=None, store: SessionStore | str | None = None) -> Session:
        """The stored session's cache rebuilt from its done turns' records, writing nothing: no lock, and a pending
        turn is left as it is (an audit reads a session this way while a worker may be serving it)."""
        session = cls._bound(session_id, model, store, None, "report")
        for rec in session.store.turns(session_id, status="done"):
            session._replay(rec)
        return session

    @classmethod
    def _bound(cls, session_id: str, model, store, redis_url: str | None, on_pending: str) -> Session:
        """The stored session on ``model`` (default: its own), which must be the model it is bound to."""
        store = store if isinstance(store, SessionStore) else SessionStore(store, redis_url=redis_url)
        row = store.get_session(session_id)
        bound_dtype = ModelSpec.parse(row.model_id).dtype
        runner, model_id = runner_for(bound_model(model, row.model_id))
        if ModelSpec.parse(model_id).dtype != bound_dtype:
            raise ConfigError("model", model_id, f"session {session_id} runs in {bound_dtype} ({row.model_id!r}); "
                              f"replies and replays are only exact in the dtype it ran in")
        bound = (row.meta or {}).get("model_fingerprint")
        if bound is not None and bound != runner.fingerprint:  # sessions from before fingerprints are not checked
            raise ConfigError("model", model_id, f"session {session_id} is bound to model {row.model_id!r} "
                              f"(fingerprint {bound[:12]}), not to this one ({runner.fingerprint[:12]})")
        return cls(session_id, store, runner, Policy.from_yaml(row.policy_json), row.model_id, on_pending)

    def catch_up(self) -> None:
        """Bring the cache up to the store now: turns other workers ran are replayed, and a turn one of them left
        pending is answered (or reported, per ``on_pending``) as on :meth:`open`."""
        with self.store.lock(self.id):
            self._sync()

    @property
    def cache_text(self) -> str:
        """The rendered conversation the cache holds, its pending token included."""
        return self.transcript.text

    # ------------------------------------------------------------------ turns

    def chat(self, msg: str | dict | Message, **generation) -> Reply:
        """One turn: commit ``msg``, prefill it onto the compressed cache, compress, decode, commit the reply."""
        for _ in self.stream(msg, **generation):
            pass
        return self.last_reply

    def stream(self, msg: str | dict | Message, **generation) -> Iterator[str]:
        """Like :meth:`chat`, yielding the reply's text pieces as they are decoded (``last_reply`` after)."""
        message = Message.coerce(msg)
        if message.role not in ("user", "tool"):
            raise ConfigError("msg.role", message.role, "a turn starts with a user or tool message")
        gen = GenerationConfig.from_call(generation)
        n = self.admission.admit_all([message], gen.max_new_tokens)[0]
        with self.store.lock(self.id):
            self._sync()
            pins = self._pins_at_commit(message)
            turn, row = self.store.begin_turn(self.id, message.content, message.name, self.policy.sha256,
                                              self.model_id, gen.record(), gen.seed, role=message.role,
                                              token_count=n, pins=pins.to_json())
            yield from self._run(turn, row["seq"], gen)

    def _run(self, turn: int, user_seq: int, gen: GenerationConfig) -> Iterator[str]:
        try:
            yield from self._live(turn, user_seq, gen)
        except BaseException as exc:  # an error or an abandoned stream: no half turn
            self._reset()  # first, whatever the store does next: the cache may hold part of the turn
            close_failed(self.store, self.id, turn, exc)
            raise
        finally:
            self._tier_done()

    def _live(self, turn: int, user_seq: int, gen: GenerationConfig) -> Iterator[str]:
        t_start = time.perf_counter()
        msgs = self.messages()
        assessment = self._assess(next(m.content for m in msgs if m.seq == user_seq))
        evicted = any(n != self.state.next_position for n in self.state.cache_lengths())
        decision, events = decide_turn(assessment, self.policy, evicted, self._prior_reprefills, turn,
                                       self.state.cache.lost)
        try:
            plan = self.transcript.plan(msgs, self._context(user_seq, decision == "reprefill"))
        except RenderDiverged:  # the cache holds tokens the conversation no longer renders to: rebuild from the store
            decision = "reprefill"
            events.append(("render_diverged", {"cached_tokens": self.state.next_position}))
            plan = self.transcript.plan(msgs, self._context(user_seq, True))
        run = self._execute(plan, msgs, user_seq, gen=gen)
        if not plan.reprefill:  # the window's reach into the cold, read after the prefill
            report = run.result.report
            decision, reached = decide_reach(decision, report.reach if report else None, self.policy)
            events += reached
        t_prefill = time.perf_counter()
        if plan.reprefill:
            events.append(("reprefill", {"drift_score": assessment.score, "missing_terms": assessment.missing_terms,
                                         "tokens_reprefilled": len(plan.tokens),
                                         "ms": round((t_prefill - t_start) * 1e3, 2)}))
        text = TextStream(self.tokenizer, gen.stop)  # never shows text at or past a stop string
        for tok in run:
            if piece := text.push(tok):
                yield piece
        if rest := text.finish():  # yielded before the commit: closing the stream here abandons the turn cleanly
            yield rest
        timings = {"prefill_ms": (t_prefill - t_start) * 1e3, "decode_ms": (time.perf_counter() - t_prefill) * 1e3}
        self._finish(TurnOutcome(turn, user_seq, assessment, decision, events, timings), plan, (run, text), msgs)

    def _finish(self, out: TurnOutcome, plan: TurnPlan, reply: tuple[TurnRun, TextStream], msgs: list[Message]) -> None:
        """Commit the reply and the turn record atomically, then account for the reply in the transcript."""
        run, text = reply
        state, result, report, turn = self.state, run.result, run.result.report, out.turn
        kept = [p[0].cpu().numpy() for p in result.kept] if result.kept is not None else None
        assistant_seq = out.user_seq + 1
        decode_tokens, pending = state.token_ids[result.prefill_end:], list(state.pending)
        content = text.content
        out.timings["compression_ms"] = report.total_ms if report else 0.0
        roles = {m.seq: m.role for m in msgs}
        kept_per_role = self.transcript.kept_per_role(kept, result.prefill_end, roles) if kept is not None else {}
        record = out.record(plan, result, (decode_tokens, pending), kept, kept_per_role)
        events = out.all_events(report)
        self.transcript.extend_reply(assistant_seq, decode_tokens + pending)
        pins = self.transcript.reply_pins(msgs, content)
        msg = self.store.finish_turn(self.id, turn, content, record, events, self.transcript.spans(),
                                     token_count=self.count_tokens(content), pins=pins and pins.to_json())
        if msg["seq"] != assistant_seq:
            raise StoreError(f"session_id={self.id!r}: assistant message got seq {msg['seq']}, expected {assistant_seq}")
        self.turns_applied = turn
        lost = next((payload["reason"] for kind, payload in out.events if kind == "tier_lost"), None)
        render = any(kind == "render_diverged" for kind, _payload in out.events)
        reason = ((f"{stats.REPREFILL_TIER_LOST}: {lost}" if lost else stats.REPREFILL_RENDER if render
                   else stats.REPREFILL_DRIFT) if out.decision == "reprefill" else None)
        emit_turn(self.id, turn, self.model_id, out.decision, reason, plan, result, state, replay=False,
                  figures=self._figures(kept, result.prefill_end, roles, kept_per_role))
        self.last_reply = Reply.of_turn(self.id, turn, text.text, plan, result.tokens, (decode_tokens, pending),
                                        kept_per_role, out.timings, result.stop_reason, report=report,
                                        cache_tokens=state.cache_lengths(), events=events)

    def _figures(self, kept: list[np.ndarray] | None, context: int, roles: dict[int, str],
                 kept_per_role: dict[str, float]) -> TurnFigures | None:
        """The turn's figures for the stats stream (None when nobody listens); remembers this turn's kept set
        for the next turn's Jaccard."""
        before, self._kept_before = self._kept_before, (kept, context) if kept is not None else None
        if not stats.active() or kept is None:
            return None
        pinned = self.state.pinned.cpu().numpy()  # (N,) bool
        return TurnFigures(kept_per_role, self.transcript.pinned_per_role(kept, context, roles, pinned),
                           kept_jaccard(before[0], kept, before[1]) if before is not None else None)

    def _prior_reprefills(self) -> list[int]:
        """Turns that re-prefilled, in order (read only when a re-prefill is being decided)."""
        return [t.turn for t in self.store.turns(self.id, status="done") if t.drift_decision == "reprefill"]

    def _assess(self, query: str) -> Assessment:
        if not self.state.positions:
            return Assessment(None, None, [])
        kept = [p[0].cpu().numpy() for p in self.state.held()]  # -1: padding, never evidence
        return self.drift.assess(query, self.transcript.text, self.transcript.char_pos, kept)


__all__ = ["AdmissionError", "Reply", "Session"]
