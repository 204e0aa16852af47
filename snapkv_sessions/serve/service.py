"""What the server does with a request, independent of HTTP: which session continues it, the turn, the replies.

A request carries the whole conversation. The session it continues is

* the one named by ``X-Session-Id`` (or ``metadata.session_id``): its stored messages must be a proper prefix of
  the request's, or the request is refused (409), since silently starting over would lose the cache;
* else, among the caller's own sessions, the one whose message chain hashes to the longest proper prefix of the
  request's messages (the chain is content-addressed: :func:`~snapkv_sessions.store.hashing.message_hash`), found
  through an index; replies containing tool calls are compared as they were returned, over the caller's most
  recent sessions, when no chain matches;
* else a new session, with the request's earlier messages as its history.

Only the messages past the stored prefix are committed and prefilled. Sessions belong to the API key that created
them (a digest of it is stored); another key's sessions do not exist for a caller (404, never 403).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import heap, interrupts
from ..admission import Admission
from ..chat import ChatFormatter, Message
from ..conversations import (
    FINISH,
    Resolution,
    StreamFilter,
    find_continued,
    prefix_heads,
    reply_view,
    resolve,
    utc,
    with_tools,
)
from ..errors import ConfigError, bounded_repr
from ..generation import GenerationConfig
from ..integrations.openai import tool_names
from ..models import ModelSpec, runner_for
from ..policy import Policy
from ..session import Reply, Session, Snapshot
from ..store import SessionStore, StoreError, StoreUnavailable
from ..store.hashing import GENESIS
from . import protocol
from .warm import WarmReport, warm_up
from .worker import Job, in_fresh_thread

BATCH_PREFILL_CHUNK = 256  # tokens a prefill feeds between two batched decode steps (while any reply decodes)
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
BOUNDARY_TTL_S = 30.0  # a kept turn boundary serves forks of the same conversation until unused this long
BOUNDARIES_KEPT = 8  # boundaries kept at once (each holds a copy of a hot cache; cold layers are shared)


def _release(session: Session) -> None:
    """Give a session's cold tier back to the pool (and remove its spill file) when the server lets it go."""
    if session.state is not None:
        session.state.cache.release()


@dataclass(frozen=True)
class Capacity:
    """What one server process holds and runs.

    max_live: sessions kept in memory (others are rebuilt from the store when used); max_tokens: the reply cap of a
    request that names none; batch: decode slots, the turns decoded together (0: one turn at a time);
    packed_weights: run the model's linear layers on weights packed once (:mod:`snapkv_sessions.packed`); None:
    when that gives the same bits (a bf16 model on a CPU with native bf16: :func:`~snapkv_sessions.packed.exact`);
    keep_boundaries: see :meth:`Service._keep_boundary`; trim_memory: after every turn, give the memory its
    transient tensors freed back to the system (:mod:`snapkv_sessions.heap`).
    """

    max_live: int = 16
    max_tokens: int = 256
    batch: int = 0
    packed_weights: bool | None = None
    keep_boundaries: bool = True  # forks of a conversation sent again at once start from its kept turn boundary
    trim_memory: bool = True

    def __post_init__(self) -> None:
        at_least(self, {"max_live": 1, "max_tokens": 1, "batch": 0})

    @property
    def store_connections(self) -> int:
        """The store's pool: one connection for each worker thread's transaction (one per decode slot, or the
        one worker), and two to spare. A turn's session lock holds a connection of its own, beside the pool."""
        return max(self.batch, 1) + 2


def at_least(obj: object, bounds: dict[str, int]) -> None:
    """Each named attribute of ``obj`` is an int (not a bool) of at least its bound; else a ConfigError naming it."""
    for name, least in bounds.items():
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(name, value, f"must be an int >= {least}")


@dataclass
class _Claim:
    """Who runs a session's turns now: its lock, and the requests holding or waiting for it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


class NotFound(LookupError):
    """No such session for this caller."""


class Conflict(ValueError):
    """The named session's history is not a prefix of the request's messages."""


def owner_of(api_key: str | None) -> str | None:
    """What a session stores of its creator's API key: a digest, never the key (None: local use without keys)."""
    return None if api_key is None else hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:32]


@dataclass
class TurnRequest:
    """A checked request, ready to run."""

    wanted: list[Message]
    tools: list[str] | None
    generation: dict
    session_id: str | None
    owner: str | None
    model: str
    create: bool = False  # the named session may not exist yet: then create it under that id (a router chose it)
    retried: bool = False  # a retry of a request that may have run: answered from the store if it did

    @functools.cached_property
    def heads(self) -> dict[str, int]:
        """The content hash of each prefix of the earlier messages -> its length (:func:`prefix_heads`)."""
        return prefix_heads(self.wanted)

    @property
    def prefix_head(self) -> str:
        """The content hash of all the earlier messages (GENESIS when there are none)."""
        return next(reversed(self.heads), GENESIS)


@dataclass
class TurnOutput:
    """What a finished turn returns to the client."""

    reply: Reply
    content: str
    calls: list[dict]
    finish: str
    session_id: str
    new_session: bool
    shown: str = ""  # the text already streamed (a prefix of ``content``)


class Router:
    """What needs no model: checking a request, finding the session it continues (the store's indexes), the
    caller's sessions. A Ray ingress routes with one of these; :class:`Service` is one, with the model."""

    def __init__(self, model_id: str, policy: str | dict | Policy | None, store: SessionStore,
                 max_tokens: int = 256) -> None:
        self.model_id, self.store, self.max_tokens = model_id, store, max_tokens
        # what clients call the model (its name); sessions are stored under model_id, which adds a dtype other
        # than float32, so a server in another dtype never continues them
        self.model_name = ModelSpec.split(model_id)[0]
        self.policy = Policy.load(policy).stated()

    def prepare(self, req: protocol.ChatCompletionRequest, owner: str | None, session_header: str | None) -> TurnRequest:
        """Check a request (no model work): its messages as session messages, tools, generation settings."""
        if req.model not in (self.model_name, self.model_id):
            raise ConfigError("model", req.model, f"this server serves {self.model_name!r} only")
        wanted = with_tools(protocol.to_messages(req), req.tools, req.tool_choice)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        gen = {"max_new_tokens": req.max_completion_tokens or req.max_tokens or self.max_tokens, "stop": stops}
        if req.temperature is not None:
            gen["temperature"] = req.temperature
        if req.top_p is not None:
            gen["top_p"] = req.top_p
        if req.seed is not None:
            gen["seed"] = req.seed
        GenerationConfig.from_call(gen)  # a bad combination is refused before anything is stored
        # an empty header names no session: refused, never taken as "start a new one"
        session_id = session_header if session_header is not None else (req.metadata or {}).get("session_id")
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise ConfigError("session_id", session_id[:80], "is not a session id")
        return TurnRequest(wanted, tool_names(req.tools) if req.tools else None, gen, session_id, owner, req.model)

    def continued(self, turn: TurnRequest) -> Resolution:
        """The caller's session holding the longest proper prefix of the request (:func:`find_continued`)."""
        return find_continued(self.store, turn.wanted, turn.tools, owner=turn.owner, model_id=self.model_id,
                              policy_sha256=self.policy.sha256, heads=turn.heads)

    def _owned(self, session_id: str, owner: str | None) -> dict:
        """The session row, if it exists and belongs to ``owner``; else :class:`NotFound` (ids leak nothing)."""
        missing = NotFound(f"no session {bounded_repr(session_id, 80)}")
        if not SESSION_ID.fullmatch(session_id):  # a NUL, a path, 10,000 characters: never sent to the database
            raise missing
        try:
            row = self.store.get_session(session_id)
        except StoreUnavailable:
            raise
        except StoreError:
            raise missing from None
        if row.get("owner") != owner:
            raise missing
        return row

    def sessions(self, owner: str | None) -> list[dict]:
        return [{"id": r["id"], "object": "session", "created_at": int(utc(r["created_at"]).timestamp()),
                 "model": r["model_id"], "title": r["title"], "turns": r["turns_done"], "messages": r["messages"]}
                for r in self.store.list_sessions(owner=owner, any_owner=False)]


class Service(Router):
    """The model, the policy, the store and the live sessions of one server process.

    The live sessions are kept in a small LRU (``max_live``); a session that left it is rebuilt exactly from the
    store when next used. With ``batch`` (decode slots) a :class:`~snapkv_sessions.scheduler.Scheduler` runs every
    forward and batches the decode steps of the turns running at once, one turn per worker thread
    (:attr:`threads`); a session runs one turn at a time (:meth:`_claim`), and a busy session is never evicted.
    Without it, one worker thread runs every turn in order.
    """

    def __init__(self, model, policy: str | dict | Policy | None, store: SessionStore,
                 capacity: Capacity | None = None) -> None:
        capacity = capacity or Capacity()
        self.heap_kept = heap.keep_freed()  # transient blocks reused, not faulted in again per layer (heap)
        self.runner, model_id = runner_for(model)
        super().__init__(model_id, policy, store, capacity.max_tokens)
        self.max_live, self.keep_boundaries = capacity.max_live, capacity.keep_boundaries
        self.trim_memory = capacity.trim_memory
        self.live: OrderedDict[str, Session] = OrderedDict()
        self._guard = threading.Lock()  # the live LRU and the claims
        self._claims: dict[str, _Claim] = {}
        self._boundaries: OrderedDict[str, tuple[float, Snapshot]] = OrderedDict()  # prefix head -> (kept at, it)
        from .. import packed

        if capacity.packed_weights or (capacity.packed_weights is None
                                       and packed.exact(next(self.runner.model.parameters()).dtype)):
            packed.pack_linears(self.runner.model, rows=8)
        # admits a request that starts a session before the session exists (a live session admits its own)
        self.admission = Admission(self.policy.limits, store, None, self.runner.tokenizer,
                                   getattr(self.runner.model.config, "max_position_embeddings", None),
                                   ChatFormatter(self.runner.tokenizer))
        self.scheduler = None
        if capacity.batch:
            from ..scheduler import Scheduler

            # while others decode or wait, a long prefill runs in chunks between their steps: this bounds how
            # long it holds them; alone, it runs in the runner's larger chunks
            self.scheduler = Scheduler(self.runner, slots=capacity.batch, busy_chunk=BATCH_PREFILL_CHUNK)
            self.runner = self.scheduler.runner  # sessions run on the scheduler's view of the model

    def warm(self, tokens: int = 1024) -> WarmReport:
        """Serve a throwaway session now so the first request does not pay for first use (:mod:`.warm`).

        It runs on a thread that ends with it (:func:`.worker.in_fresh_thread`): run on the caller's, the server's
        main thread, which lives on in the event loop, it left every later decode step about 1.6x slower."""
        return in_fresh_thread(lambda: warm_up(self.runner, self.model_id, self.policy, _release, tokens), "snapkv-warm")

    @property
    def threads(self) -> int:
        """Worker threads the server should run: one per decode slot when batching, else one."""
        return self.scheduler.pool.size if self.scheduler is not None else 1

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    # ------------------------------------------------------------------ requests

    def chat(self, turn: TurnRequest, job: Job, resolved=None) -> TurnOutput:
        """A whole turn; stopped early (deadline, shutdown) it abandons the turn and raises why. ``resolved``: as
        :meth:`stream`'s (the HTTP layer times the first piece with it)."""
        out = self.stream(turn, job, lambda _text: None, resolved)
        if out is None:
            raise job.stopped()
        return out

    def stream(self, turn: TurnRequest, job: Job, emit, resolved=None) -> TurnOutput | None:
        """Stream a turn: ``emit(text)`` for each piece that may be shown; ``resolved(session_id)`` once the turn
        runs (its session found, the request admitted whole and committed, its first piece decoded), so every
        refusal before that keeps its status. Stops, abandoning the turn cleanly, when the job is told to (the
        client left, the deadline passed, the server is stopping), also mid-prefill; then returns None."""
        if job.should_stop():  # the client left while the request waited: nothing is done for it
            return None
        try:
            with interrupts.stop_when(job.should_stop), self._claim(turn) as (session, new, fresh):
                try:
                    return self._turn(turn, job, (session, new, fresh), emit, resolved)
                except StoreError as exc:
                    if isinstance(exc, StoreUnavailable) or self.store.session_exists(session.id):
                        raise
                    self._forget(session.id)
                    raise NotFound(f"session {session.id} was deleted while this request ran; nothing of its turn "
                                   "was kept") from None
        except interrupts.Interrupted:
            return None
        finally:
            if self.trim_memory:  # the turn's transient tensors are freed: their pages go back to the system
                heap.release()

    def _turn(self, turn: TurnRequest, job: Job, found: tuple[Session, list[Message], bool], emit,
              resolved) -> TurnOutput | None:
        session, new, fresh = found
        if not new:  # a retry of a request already answered: the same reply, no second turn
            out = self._output(turn, session, session.stored_reply(), fresh)
            if resolved is not None:
                resolved(session.id)
            emit(out.content)
            out.shown = out.content
            return out
        if not fresh:  # a new session or a fork admitted the request whole as it was made (_create, _fork_at_boundary)
            session.admit(new, turn.generation["max_new_tokens"])
        if job.should_stop():
            return None
        session.add_messages(new[:-1])  # one transaction: all of them or none
        shown = StreamFilter(bool(turn.tools))
        pieces: Iterator[str] = session.stream(new[-1], **turn.generation)
        try:
            for i, piece in enumerate(pieces):
                if i == 0 and resolved is not None:
                    resolved(session.id)  # the turn runs: from here a failure is told in the stream
                if job.should_stop():
                    return None
                text = shown.feed(piece)
                if text:
                    emit(text)
        finally:
            pieces.close()  # a stream left early abandons its turn: no half turn is stored
        if resolved is not None:
            resolved(session.id)  # a reply with no text at all
        out = self._output(turn, session, session.last_reply, fresh)
        out.shown = shown.shown
        return out

    def _output(self, turn: TurnRequest, session: Session, reply: Reply, fresh: bool) -> TurnOutput:
        content, calls = reply_view(session.id, reply.turn, reply.text, turn.tools)
        finish = "tool_calls" if calls else FINISH[reply.stop_reason]
        return TurnOutput(reply, content, calls, finish, session.id, fresh)

    # ------------------------------------------------------------------ which session

    @contextlib.contextmanager
    def _claim(self, turn: TurnRequest) -> Iterator[tuple[Session, list[Message], bool]]:
        """The session that continues ``turn``, the messages it has not seen, and whether it is new; held for this
        request alone until the block ends. What it has not seen is read once the session is held: a turn of the
        same session that ran meanwhile is part of its history then."""
        if turn.session_id is not None:
            with self._hold(turn.session_id):
                yield self._named(turn)
            return
        found = self.continued(turn)
        if found.session_id is not None:
            with self._hold(found.session_id):
                # a concurrent turn may have moved the session past this request: then it continues nothing
                held = resolve((self.store, found.session_id), turn.wanted, turn.tools)
                if held.outcome == "continued":
                    session = self._live(found.session_id)
                    if len(held.new) == 1:
                        self._keep_boundary(session, turn)
                    yield session, list(held.new), False
                    return
        fork_id = str(uuid.uuid4())
        with self._hold(fork_id):  # held before anyone could find it by its content
            fork = self._fork_at_boundary(turn, fork_id)
            if fork is not None:
                self._remember(fork)
                yield fork, turn.wanted[-1:], True
                return
        session = self._create(turn)
        with self._hold(session.id):
            self._remember(session)
            yield session, turn.wanted[-1:], True

    def _keep_boundary(self, session: Session, turn: TurnRequest) -> None:
        """Keep ``session``'s state at this turn boundary, before this turn moves it: a request with the same
        conversation that comes while this turn runs, or shortly after (sent twice at once, an agent's parallel
        calls, a retry), forks from a copy of it instead of a prefill of the whole history
        (:meth:`_fork_at_boundary`). The requests behind cannot be counted in time (they are still being read
        when this turn starts), so every turn continued by its content keeps one: a copy of its hot cache (its
        cold layers are shared), until unused for :data:`BOUNDARY_TTL_S`, at most :data:`BOUNDARIES_KEPT` at once."""
        snap = in_fresh_thread(session.snapshot, "snapkv-boundary") if self.keep_boundaries else None
        if snap is None:
            return
        with self._guard:
            self._boundaries[turn.prefix_head] = (time.monotonic(), snap)
            self._boundaries.move_to_end(turn.prefix_head)
            while len(self._boundaries) > BOUNDARIES_KEPT:
                self._boundaries.popitem(last=False)

    def _fork_at_boundary(self, turn: TurnRequest, fork_id: str) -> Session | None:
        """A fork, under ``fork_id``, from a boundary kept for this conversation (:meth:`_keep_boundary`) when the
        request continues it there with its last message; None otherwise (a session is then created from the
        request's history, as before)."""
        now = time.monotonic()
        with self._guard:
            for head in [h for h, (at, _) in self._boundaries.items() if now - at > BOUNDARY_TTL_S]:
                del self._boundaries[head]
            kept = self._boundaries.get(turn.prefix_head)
            if kept is None or kept[1].owner != turn.owner or kept[1].up_to_seq != len(turn.wanted) - 1:
                return None
            self._boundaries[turn.prefix_head] = (now, kept[1])  # in use: kept longer
        fork = Session.from_snapshot(kept[1], self.runner, self.model_id, self.policy, self.store,
                                     session_id=fork_id, title="served (fork)")
        try:
            fork.admit(turn.wanted[-1:], turn.generation["max_new_tokens"])
        except BaseException:
            self.store.delete_session(fork.id)  # refused as a new session would be: nothing of it stays
            raise
        return fork

    def _create(self, turn: TurnRequest, session_id: str | None = None) -> Session:
        """A new session for ``turn`` (under ``session_id`` when a router chose it): the request's earlier
        messages are its history, and its last message is the turn. The whole request is admitted first, so a
        request that cannot run creates nothing."""
        self.admission.admit_all(turn.wanted, turn.generation["max_new_tokens"], new_session=True)
        options = {"history": turn.wanted[:-1], "owner": turn.owner, "title": "served", "session_id": session_id}
        return Session.create_on(self.runner, self.model_id, self.policy, self.store, options)

    def _named(self, turn: TurnRequest) -> tuple[Session, list[Message], bool]:
        """The session ``turn`` names (held by the caller), created under that id when the router chose it for a
        new conversation. A retried request that was answered already (its turn done, or left pending and answered
        as the session opened here) comes back with nothing new: :meth:`_turn` returns the stored reply."""
        sid = turn.session_id
        if turn.create and not self.store.session_exists(sid):
            session = self._create(turn, sid)
            self._remember(session)
            return session, turn.wanted[-1:], True
        self._owned(sid, turn.owner)
        session = None
        if turn.retried:
            session = self._live(sid)
            session.catch_up()  # a turn another replica left pending is answered first
        found = resolve((self.store, sid), turn.wanted, turn.tools, retried=turn.retried)
        if found.outcome == "new":
            raise Conflict(f"session {sid}: its stored messages are not a proper prefix of the request's messages")
        return session or self._live(sid), list(found.new), False

    @contextlib.contextmanager
    def _hold(self, session_id: str) -> Iterator[None]:
        """This thread alone runs turns of ``session_id`` until the block ends (others wait)."""
        with self._guard:
            claim = self._claims.setdefault(session_id, _Claim())
            claim.users += 1
        try:
            with claim.lock:
                yield
        finally:
            with self._guard:
                claim.users -= 1
                if not claim.users:
                    del self._claims[session_id]

    def _live(self, session_id: str) -> Session:
        """The live session (the caller holds it, :meth:`_hold`), opened from the store when it is not live."""
        with self._guard:
            session = self.live.get(session_id)
        if session is None:
            session = Session.open(session_id, model=self.runner, store=self.store)
        self._remember(session)
        return session

    def _remember(self, session: Session) -> None:
        with self._guard:
            self.live[session.id] = session
            self.live.move_to_end(session.id)
            idle = [sid for sid in self.live if sid not in self._claims]  # least recent first; busy ones stay
            for sid in idle[: max(0, len(self.live) - self.max_live)]:
                _release(self.live.pop(sid))  # rebuilt exactly from the store when next used

    # ------------------------------------------------------------------ session endpoints

    def show(self, session_id: str, owner: str | None) -> dict:
        from .. import audit

        row = self._owned(session_id, owner)
        return {"id": session_id, "object": "session", "model": row["model_id"], "policy_sha256": row["policy_sha256"],
                "turns": audit.turn_rows(self.store, session_id)}

    def verify(self, session_id: str, owner: str | None) -> dict:
        """The store's integrity checks, then every done turn re-executed against its record."""
        from .. import audit

        self._owned(session_id, owner)
        result = audit.verify(self.store, session_id, self.runner)
        mismatch = None if result.mismatch is None else {
            "turn": result.mismatch.turn, "field": result.mismatch.field}
        return {"id": session_id, "ok": result.ok, "turns_checked": result.turns_checked, "mismatch": mismatch}

    def fork(self, session_id: str, owner: str | None, turn: int | None) -> dict:
        self._owned(session_id, owner)
        with self._hold(session_id):
            fork = self._live(session_id).fork(turn)
        return {"id": fork.id, "object": "session", "forked_from": session_id,
                "messages": len(self.store.messages(fork.id))}

    def delete(self, session_id: str, owner: str | None) -> dict:
        self._owned(session_id, owner)
        with self._hold(session_id):
            self._forget(session_id)
            self.store.delete_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    def _forget(self, session_id: str) -> None:
        """Drop a live session (deleted): its cold tier, and a spill file if it has one, go back to the pool."""
        with self._guard:
            gone = self.live.pop(session_id, None)
        if gone is not None:
            _release(gone)
