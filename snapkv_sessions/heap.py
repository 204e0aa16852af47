"""Giving the memory a turn freed back to the operating system.

A turn's prefill and compression allocate large transient tensors (the window's scores, the tier's union, a
recall's selector summaries) and free them when it ends. On Linux, glibc's allocator serves a freed block's pages
to the next allocation rather than returning them, and it raises its mmap threshold as large blocks are freed, so
later blocks of the same size come from the heap too: a server's RSS stays at its highest transient mark. Measured
(Qwen2.5-Coder-0.5B fp32, two tiered sessions with decode-time recall, 8K-token first turns, one process): RSS
after each turn 3.16-3.48 GiB, and 2.83-3.04 GiB right after :func:`release` (docs/against-vllm.md). The call
walks the allocator's free lists once (well under a millisecond when there is little to give back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    """glibc's ``malloc_trim``, or None on a C library without it (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    fn = getattr(lib, "malloc_trim", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def available() -> bool:
    return _trim() is not None


def release() -> bool:
    """Return the allocator's free memory to the operating system now; True when some was returned (False too
    where the C library has no ``malloc_trim``)."""
    fn = _trim()
    return bool(fn(0)) if fn is not None else False
