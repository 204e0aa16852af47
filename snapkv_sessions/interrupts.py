"""Stopping a long turn from outside: a server's deadline or a client that left, checked between prefill chunks.

A turn's decode already stops between tokens (its caller closes the stream). A prefill of thousands of tokens, or
the replay that rebuilds a session, runs inside one call; this thread-local check lets the runner stop it between
chunks: :func:`check` raises :class:`Interrupted`, the session abandons the turn as it does any failed one, and
the store keeps nothing of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from .errors import SnapKVError


class Interrupted(SnapKVError):
    """The caller asked this thread's work to stop (:func:`stop_when`)."""


_local = threading.local()


@contextlib.contextmanager
def stop_when(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, :func:`check` on this thread raises :class:`Interrupted` once ``should_stop()`` is true."""
    previous = getattr(_local, "should_stop", None)
    _local.should_stop = should_stop
    try:
        yield
    finally:
        _local.should_stop = previous


def check() -> None:
    """Raise :class:`Interrupted` if this thread was asked to stop; free when nobody asks."""
    should_stop = getattr(_local, "should_stop", None)
    if should_stop is not None and should_stop():
        raise Interrupted("stopped on request (deadline, client gone or shutdown)")
