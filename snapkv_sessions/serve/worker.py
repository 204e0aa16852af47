"""The jobs of every request, behind a bounded queue: one at a time, or one per decode slot with a scheduler.

A process serves one model; its forward passes run one at a time (on the worker thread, or on the scheduler's
thread when batching). Requests wait in a queue of bounded length: when it is full a request is refused
at once (HTTP 429 with ``Retry-After``) instead of piling up. A job whose deadline passes while it waits is not
started; one that is running when its deadline passes is told to stop (:attr:`Job.cancelled`), which a streamed
turn honours between tokens by closing its stream (the turn is then abandoned cleanly, as any abandoned
``Session.stream`` is).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from .. import stats
from ..threads import serial_kernels as keep_kernels_serial

T = TypeVar("T")


class Busy(RuntimeError):
    """The queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy: {retry_after} s until a slot is likely free")
        self.retry_after = retry_after


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before or while its job ran."""


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no new work (or stopped this request's turn); retry after
    ``retry_after`` seconds, on this server once it is back or on another."""

    retry_after = 5


@dataclass(eq=False)  # a job is itself (hashable by identity): the worker keeps the running ones in a set
class Job:
    fn: Callable[[Job], object]
    deadline: float  # time.monotonic() after which the job must not start, and should stop
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    shutdown: threading.Event = field(default_factory=threading.Event)  # stopped because the server is stopping
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # time.monotonic() when a worker thread started it; None while it waits

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def should_stop(self) -> bool:
        """Checked by a running job between steps (tokens): the client left, the deadline passed, or the server
        is stopping."""
        return self.stop_cause() is not None

    def stop_cause(self) -> str | None:
        """Why the job should stop (``"shutdown"``, ``"client_left"``, ``"deadline"``), None while it may go on."""
        if self.shutdown.is_set():
            return "shutdown"
        if self.cancelled.is_set():
            return "client_left"
        return "deadline" if self.expired() else None

    def stopped(self) -> Exception:
        """Why a job that stopped early did: what its client is told."""
        if self.shutdown.is_set():
            return ShuttingDown("the server is shutting down; this request's turn was abandoned (send it again)")
        return DeadlineExceeded("the request ran past its deadline; its turn was abandoned")


class Worker:
    """Runs jobs on ``threads`` threads (one by default: one at a time), from a queue of at most ``max_queue``
    waiting jobs. With a scheduler (:mod:`snapkv_sessions.scheduler`) the server runs one thread per decode slot:
    their turns' forwards all go to the scheduler's thread, which batches their decode steps."""

    def __init__(self, max_queue: int, typical_job_s: float = 5.0, threads: int = 1,
                 serial_kernels: bool = False) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r}: must be an int >= 1 (a queue of 0 would be unbounded)")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r}: must be an int >= 1")
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.typical_job_s = typical_job_s
        self.closing = False
        self.running: set[Job] = set()
        self._gate = threading.Lock()  # closing and enqueueing happen one at a time: no job lands after the end
        self.serial_kernels = serial_kernels  # the model runs on another thread: keep torch's teams off these
        self.threads = [threading.Thread(target=self._loop, name=f"snapkv-serve-worker-{i}", daemon=True)
                        for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable[[Job], object], timeout_s: float) -> Job:
        job = Job(fn, time.monotonic() + timeout_s)
        with self._gate:
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                waits = self.jobs.qsize() * self.typical_job_s / len(self.threads)
                raise Busy(max(1, round(waits))) from None
            self._report()
        return job

    def _report(self) -> None:
        """The running and waiting requests to the stats stream; called under ``_gate`` after each change, so the
        last stat emitted is the state now (two changes never report in the opposite order)."""
        if stats.active():
            stats.emit(stats.QueueStat(len(self.running), self.jobs.qsize()))

    def _loop(self) -> None:
        if self.serial_kernels:
            keep_kernels_serial()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.future.set_running_or_notify_cancel():
                refused = self._refusal(job)
                if refused is None:
                    self._run(job)
                    continue
                job.future.set_exception(refused)
            with self._gate:  # it left the queue without running
                self._report()

    def _refusal(self, job: Job) -> Exception | None:
        """Why a job taken from the queue must not start (None: it may)."""
        if self.closing:
            return ShuttingDown("the server shut down before this request ran")
        if job.expired():
            return DeadlineExceeded("the request waited past its deadline")
        if job.cancelled.is_set():  # its client left while it waited
            return DeadlineExceeded("the client left before the request ran")
        return None

    def _run(self, job: Job) -> None:
        with self._gate:
            job.started = time.monotonic()
            self.running.add(job)
            self._report()
        result, error = None, None
        try:
            result = job.fn(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the request that submitted it
            error = exc
        finally:
            # no longer running before its client hears: a scrape after the response never counts it
            with self._gate:
                self.running.discard(job)
                self._report()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def drain(self, grace_s: float) -> None:
        """Stop taking work at once (SIGTERM): waiting jobs are refused (:class:`ShuttingDown`), running ones may
        finish within ``grace_s`` seconds and are then told to stop (their turns abandoned cleanly). Returns at
        once: it runs in the signal handler."""
        with self._gate:
            self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(ShuttingDown("the server is shutting down; this request was not started"))
        with self._gate:
            self._report()
        timer = threading.Timer(grace_s, self._stop_running)
        timer.daemon = True
        timer.start()

    def _stop_running(self) -> None:
        with self._gate:
            running = list(self.running)
        for job in running:
            job.shutdown.set()

    def close(self, wait_s: float = 30.0) -> None:
        """Finish the running job, refuse the waiting ones, stop the thread."""
        with self._gate:
            self.closing = True  # from here no job is enqueued, so the end markers below are the last items
        for _ in self.threads:  # one end marker per thread
            try:
                self.jobs.put(None, timeout=wait_s)
            except queue.Full:
                break
        for thread in self.threads:
            thread.join(timeout=wait_s)


def in_fresh_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` run on a new thread that ends with it: its result, or its error raised here.

    For tensor work a long-lived thread would otherwise run (the warm start on the server's main thread, a fork
    boundary's copy of a session's cache on a worker): after a long-lived thread other than the model's had run
    such work, every later decode step of the model's thread stayed slower, 1.3x to 1.6x on the 2-core machine
    (docs/against-vllm.md); run on a thread that ends, it leaves the steps as they were. The mechanism is not
    isolated (the threads' OpenMP teams are the suspect: one lives as long as the thread that started it).
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]

