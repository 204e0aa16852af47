"""Scheduler: many sessions on one model, their decode steps batched, prefills in chunks between the steps.

One thread owns the model. Each iteration of its loop

1. samples the next token of every decoding session from its latest logits (each session its own
   :class:`~snapkv_sessions.generation.Decoder`: its sampler and seed, its stop strings, its length cap),
   hands the tokens to the sessions' threads, and frees the slots of the replies that ended;
2. admits waiting replies into free slots (:class:`~snapkv_sessions.batch.SlotPool`) and runs ONE forward that
   feeds every active session its token (each weight read once for all of them);
3. runs a waiting call from a session thread, and more while the calls have taken less time than the step: a
   prefill chunk (the runner's ``prefill_chunk`` bounds how long it holds the others) or a compression, which
   touch that session's own cache only. The call whose turn would end first if run alone goes first: its
   start plus its tokens left to prefill at ``PREFILL_RATE`` (a compression has none left). Among turns that
   began together that is the fewest tokens left: a short turn does not wait behind a long document, and of
   several documents arriving together each one's prefill finishes before the next starts, so the first answers
   come after one document's prefill instead of all of them interleaved (vLLM's scheduler is first come, first
   served); and a long prompt that has waited overtakes newer short turns in time, so none starves.

While nothing decodes, waiting calls run back to back. A session's reply is the one it would get alone: rows do
not interact, and every session samples with its own generator (``tests/test_scheduler.py``).

Failures stay with the reply they belong to: an error while one reply samples (its decoder) or is admitted (its
slot) takes that reply out of the batch and goes to its reader alone; the others go on, token for token as alone.
Only an error of the shared forward (:meth:`SlotPool.step`) reaches every reply in the step.

The scheduler owns its runner and the runner never refers to it (after vLLM v1's engine core, whose scheduler
and model runner do not know each other): the sessions it serves run on :attr:`Scheduler.runner`, a view of the
same model whose executor is this scheduler (:meth:`ModelRunner.on`), so their forwards and compressions come
here through :meth:`Scheduler.call` and their replies through :meth:`Scheduler.decode`; a session's code does not
change. The batched step runs the model through the runner's one forward path (:meth:`ModelRunner.forward`).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from . import stats
from .batch import Slot, SlotPool
from .generation import Decoder
from .runner import Inline
from .state import KVState

_END = object()  # a reply's last item on its queue
FOLLOW_UP_S = 0.01  # how long the loop waits for a prefill's next chunk (or compression) to be queued
# the prefill rate the order assumes (tokens/s, about this project's 0.5B model on 2 cores): a waiting call's key is
# when its turn would end if run alone from its start, so the fewest tokens left go first among turns that began
# together, and a long prompt that has waited overtakes newer short ones in time instead of starving
PREFILL_RATE = 256.0
_clock = time.monotonic  # the order's clock (a test sets its own)
_SCHEDULED: weakref.WeakSet = weakref.WeakSet()  # runners a live scheduler owns: one thread per model


@dataclass
class Decoding:
    """One reply in the scheduler: its state, decoder, latest logits and the queue its tokens go out on."""

    state: KVState
    decoder: Decoder
    logits: torch.Tensor  # (V,) the next token's
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    slot: Slot | None = None  # the pool's slot it decodes in, once admitted
    leaving: threading.Event = field(default_factory=threading.Event)  # its reader went away
    gone: threading.Event = field(default_factory=threading.Event)  # the scheduler no longer touches it
    last_at: float = field(default_factory=time.perf_counter)  # when its latest logits were ready (first: prefill)


@dataclass
class SchedulerStats:
    """What the loop did: steps, the sessions they carried, and the calls run between them."""

    steps: int = 0
    rows: int = 0  # sum over steps of the sessions each fed
    largest: int = 0
    calls: int = 0
    step_s: float = 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "mean_batch": round(self.rows / self.steps, 3) if self.steps else 0.0,
                "largest_batch": self.largest, "calls": self.calls, "step_s": round(self.step_s, 3)}


class Scheduler:
    """Serves many sessions of one model from one thread.

    Parameters
    ----------
    runner : the :class:`~snapkv_sessions.runner.ModelRunner` it owns; sessions run on :attr:`runner`, its view
        bound to this scheduler, and their forwards all come here
    slots : the most sessions decoding in one step; more wait for a free slot
    static : fixed step shapes (see :class:`~snapkv_sessions.batch.SlotPool`)
    busy_chunk : the most tokens a prefill feeds per call while replies decode or other calls wait (it holds
        them that long); with the model to itself a prefill feeds the runner's whole ``prefill_chunk`` per call,
        which is faster (each call reads every weight once): :meth:`chunk`
    """

    def __init__(self, runner, slots: int = 8, static: bool = False, busy_chunk: int = 256) -> None:
        if isinstance(busy_chunk, bool) or not isinstance(busy_chunk, int) or busy_chunk < 1:
            raise ValueError(f"busy_chunk={busy_chunk!r}: must be an int >= 1")
        self.busy_chunk = busy_chunk
        if runner in _SCHEDULED or not isinstance(runner.executor, Inline):
            raise ValueError("this runner already has a scheduler")
        self.model_runner = runner  # runs the batched steps; knows nothing of the scheduler
        self.runner = runner.on(self)  # what the scheduler's sessions run on
        self.pool = SlotPool(runner.num_layers, slots, static)
        self.stats = SchedulerStats()
        # waiting calls, a heap: (key, arrival) orders them (:meth:`_key`); tokens left, the function and its future
        # ride along
        self._calls: list[tuple[float, int, int, Callable[[], object], Future]] = []
        self._arrivals = itertools.count()
        self._turns: dict[int, tuple[float, int]] = {}  # a thread mid-prefill: (its turn's start, tokens left then)
        self._joining: deque[Decoding] = deque()
        self._active: list[Decoding] = []  # sampling order: joined first, first served
        self._wake = threading.Condition()
        self._closing = False
        self.thread = threading.Thread(target=self._loop, name="snapkv-scheduler", daemon=True)
        _SCHEDULED.add(runner)
        self.thread.start()

    # ------------------------------------------------------------------ the sessions' side

    def call(self, fn: Callable[[], object], remaining: int = 0):
        """Run ``fn()`` on the scheduler's thread between two decode steps; returns its result or raises its
        error. Called from the scheduler's own thread, it runs at once. ``remaining``: the tokens the calling
        turn has still to prefill, this call's included; waiting calls run in :meth:`_key` order."""
        if threading.current_thread() is self.thread:
            return fn()
        future: Future = Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the scheduler is closed")
            left = max(int(remaining), 0)
            heapq.heappush(self._calls, (self._key(left), next(self._arrivals), left, fn, future))
            self._wake.notify()
        return future.result()

    def chunk(self, most: int) -> int:
        """The next prefill call's tokens: ``most`` when nothing else waits on the model (no reply decoding or
        joining, no other call queued), else at most :attr:`busy_chunk`. Decided as the call is made; a reply
        that arrives during a long chunk waits for it to end."""
        with self._wake:
            busy = bool(self._active or self._joining or self._calls)
        return min(most, self.busy_chunk) if busy else most

    def _key(self, left: int) -> float:
        """When the calling thread's turn would end alone: its start plus ``left`` tokens at ``PREFILL_RATE``. A
        call with fewer tokens left than the same thread's previous one continues that turn's prefill (its next
        chunk, or the compression after it) and keeps its start; any other call starts a turn now. Called with
        the lock held."""
        now, me = _clock(), threading.get_ident()
        start, before = self._turns.pop(me, (now, 0))
        if not 0 <= left < before:
            start = now
        if left:
            self._turns[me] = (start, left)
        return start + left / PREFILL_RATE

    def decode(self, state: KVState, first_logits: torch.Tensor, decoder: Decoder) -> Iterator[int]:
        """The reply's tokens as the scheduler samples them (the end token excluded). When it ends, ``state``
        holds every fed token, its last token pending and ``last_stop_reason`` set, as
        :meth:`ModelRunner.generate` leaves it. Closing the iterator early takes the reply out of the batch."""
        item = Decoding(state, decoder, first_logits)
        with self._wake:
            if self._closing:
                raise RuntimeError("the scheduler is closed")
            self._joining.append(item)
            self._wake.notify()
        finished = False
        try:
            while (tok := item.out.get()) is not _END:
                if isinstance(tok, BaseException):
                    raise tok
                yield tok
            finished = True
        finally:
            if not finished:  # the reader left: wait until the loop has let go of the state
                item.leaving.set()
                with self._wake:
                    self._wake.notify()
                item.gone.wait()

    def close(self, wait_s: float = 30.0) -> None:
        """Stop the loop after the work in hand; the model's runner may get another scheduler."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self.thread.join(timeout=wait_s)
        _SCHEDULED.discard(self.model_runner)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._calls or self._joining or self._active or self._closing):
                        self._wake.wait()
                    if self._closing and not (self._calls or self._joining or self._active):
                        return
                    self._active.extend(self._joining)
                    self._joining.clear()
                    call = heapq.heappop(self._calls) if self._calls else None
                t0, stepped = time.perf_counter(), False
                try:
                    self._sample()
                    stepped = self._step()
                except BaseException as exc:  # noqa: BLE001 - every decoding reply is told, none hangs
                    self._fail_all(exc)
                # no forward ran (nothing decodes): 0, so one call runs per iteration (a sampling pass alone
                # could outlast a very short call, which then let the next turn's call in before a follow-up)
                stepped, ran, last = (time.perf_counter() - t0) if stepped else 0.0, 0, None
                while call is not None:
                    last = call
                    self._run_call(*call[3:])
                    ran += 1
                    call = self._next_call(time.perf_counter() - t0 - stepped, stepped)
                if last is not None and last[2]:  # a prefill chunk ran: its turn's next call comes at once
                    self._await_follow_up(last[0])
                if stats.active():
                    running = sum(item.slot is not None for item in self._active)
                    stats.emit(stats.SchedulerStepStat(running, len(self._active) - running, ran,
                                                       time.perf_counter() - t0))

    def _next_call(self, spent: float, stepped: float) -> tuple[float, int, int, Callable[[], object], Future] | None:
        """Another waiting call for this iteration while the calls have taken less time than its step: turns'
        short calls (a compression, a follow-up's few tokens) do not each wait a whole batched step, and the
        decoding replies still get at least half the time while both wait (a call started runs to its end)."""
        if spent >= stepped:
            return None
        with self._wake:
            return heapq.heappop(self._calls) if self._calls else None

    def _await_follow_up(self, key: float) -> None:
        """After a prefill chunk (whose key was ``key``), wait a moment (at most ``FOLLOW_UP_S``) for its turn's
        next call, whose key is smaller: its thread queues it only once the chunk's result reached it, and a call
        picked before then would interleave two prompts' chunks (each finishing late) instead of finishing the one
        that would end first."""
        with self._wake:
            self._wake.wait_for(lambda: self._closing or bool(self._joining)
                                or bool(self._calls and self._calls[0][0] < key),
                                timeout=FOLLOW_UP_S)

    def _run_call(self, fn: Callable[[], object], future: Future) -> None:
        self.stats.calls += 1
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised in the calling session's thread
            future.set_exception(exc)

    def _sample(self) -> None:
        """Each active reply samples its next token; an ended, abandoned or failing one leaves its slot."""
        for item in list(self._active):
            try:
                self._sample_one(item)
            except Exception as exc:  # noqa: BLE001 - this reply's own failure: its reader gets it, the rest go on
                self._fail(item, exc)

    def _sample_one(self, item: Decoding) -> None:
        """``item``'s next token out to its reader; its slot freed once the reply has ended or its reader left."""
        if item.leaving.is_set():
            self._leave(item)
            return
        if item.logits is None:  # waiting for a slot: its token was sampled already
            return
        tok = item.decoder.accept(item.logits)
        item.logits = None
        if tok is not None:
            item.out.put(tok)
        if item.decoder.done:
            self._leave(item)
            item.state.pending, item.state.last_stop_reason = [item.decoder.last], item.decoder.reason
            item.out.put(_END)

    def _step(self) -> bool:
        """Admit replies into free slots, then feed every slotted reply its token in one forward; whether one
        ran."""
        for item in list(self._active):
            if item.slot is None and self.pool.free:
                try:  # admit takes the slot last, so a failed copy leaves the pool as it was
                    item.slot = self.pool.slots[self.pool.admit(item.state, item.decoder.gen.max_new_tokens)]
                except Exception as exc:  # noqa: BLE001 - this reply's own failure, as in _sample
                    self._fail(item, exc)
        ready = sorted((item for item in self._active if item.slot is not None),
                       key=lambda item: self.pool.slots.index(item.slot))  # slot order: row i is slot i
        if not ready:
            return False
        t0 = time.perf_counter()
        logits = self.pool.step(self.model_runner, [item.decoder.last for item in ready])  # (n, V)
        now = time.perf_counter()
        seconds = now - t0
        self.stats.step_s += seconds
        gaps = tuple(now - item.last_at for item in ready)  # each row's inter-token latency
        for item in ready:
            item.last_at = now
        if stats.active():
            keys = self.pool.keys[0]  # (S, Hkv, T_cap, D): every layer's slot holds as many bytes per token
            per_token = 2 * keys.shape[1] * keys.shape[-1] * keys.element_size()
            read = sum(sum(item.slot.lengths) for item in ready) * per_token
            stats.emit(stats.DecodeStepStat(len(ready), len(ready), seconds, read, gaps))
        self.stats.steps += 1
        self.stats.rows += len(ready)
        self.stats.largest = max(self.stats.largest, len(ready))
        for item, row in zip(ready, logits, strict=True):
            item.logits = row  # (V,)
        return True

    def _leave(self, item: Decoding) -> None:
        """Take ``item`` out of the batch, its slot copied back into its state."""
        if item.slot is not None:
            self.pool.release(self.pool.slots.index(item.slot))
            item.slot = None
        self._active.remove(item)
        item.gone.set()

    def _fail(self, item: Decoding, exc: BaseException) -> None:
        """Take ``item`` out of the batch and hand ``exc`` to its reader."""
        try:
            self._leave(item)
        except Exception:  # noqa: BLE001 - the slot's copy failed too; the session resets on the error
            if item.slot is not None and item.slot in self.pool.slots:  # free the slot uncopied: the rest go on
                self.pool.drop(self.pool.slots.index(item.slot))
            item.slot = None
            if item in self._active:
                self._active.remove(item)
            item.gone.set()
        item.out.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for item in list(self._active):
            self._fail(item, exc)
