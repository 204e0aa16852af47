"""Giving the memory a turn freed back to the operating system.

A turn's prefill and compression allocate large transient tensors (the window's scores, the tier's union, a
recall's selector summaries) and free them when it ends. On Linux, glibc's allocator serves a freed block's pages
to the next allocation rather than returning them, and it raises its mmap threshold as large blocks are freed, so
later blocks of the same size come from the heap too: a server's RSS stays at its highest transient mark. Measured
(Qwen2.5-Coder-0.5B fp32, two tiered sessions with decode-time recall, 8K-token first turns, one process): RSS
after each turn 3.16-3.48 GiB, and 2.83-3.04 GiB right after :func:`release` (docs/against-vllm.md). The call
walks the allocator's free lists once (well under a millisecond when there is little to give back).

The opposite problem costs time: by default glibc serves a block above its mmap threshold (128 KB at first, raised
as such blocks are freed, at most 32 MB) with a fresh ``mmap`` and unmaps it when freed, and it returns the heap's
free top to the system as soon as it passes the trim threshold. A prefill allocates and frees the same large
activations in every layer (the MLP's ``(T, 4864)`` bf16 intermediates are 28 MB at 2.9K tokens, 40 MB per
4K-token chunk), so each layer faults its pages in again. :func:`keep_freed` has glibc keep freed blocks for
reuse (``mallopt``: no mmap below 1 GiB, no automatic trim); the server's :func:`release` after each turn still
gives the memory back, once per turn instead of once per layer. Measured on a 2-core AMX Xeon (Qwen2.5-Coder-0.5B
bf16, packed, eight prefills of 1K-4K tokens in one process, ``release`` after each): a 2.9K-token prefill in one
chunk 2.5-2.9 s with the defaults and 2.2-2.4 s with both (4K tokens: 4.3 against 3.4 s); in the server's 256-token
chunks 3.2-3.5 against 3.0-3.1 s; RSS after each release 2.74-2.76 GiB (2.80-2.95 GiB with the defaults, which
never release). The command line and the server call it at start; ``SNAPKV_SESSIONS_MALLOC=system`` leaves the C
library's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BELOW = 1 << 30  # blocks under this size come from the heap and are kept for reuse when freed
NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int: the largest trim threshold it can be given
ENV = "SNAPKV_SESSIONS_MALLOC"  # "system": leave the C library's allocator settings as they are


@functools.cache
def _libc():
    """The C library, when it is glibc (it has ``malloc_trim``); None on another (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


@functools.cache
def _trim():
    """glibc's ``malloc_trim``, or None on a C library without it."""
    lib = _libc()
    if lib is None:
        return None
    fn = lib.malloc_trim
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_kept = False


def keep_freed() -> bool:
    """Have glibc keep freed blocks below :data:`KEEP_BELOW` for reuse instead of unmapping or trimming them
    (the module docstring says why and what it measured). Process-wide and idempotent; returns whether the
    settings are in force (False where the C library is not glibc, where ``SNAPKV_SESSIONS_MALLOC=system``, or
    where glibc refused them)."""
    global _kept
    if _kept:
        return True
    lib = _libc()
    if lib is None or os.environ.get(ENV, "").strip().lower() == "system":
        return False
    lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(lib.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(lib.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _kept


def available() -> bool:
    return _trim() is not None


def release() -> bool:
    """Return the allocator's free memory to the operating system now; True when some was returned (False too
    where the C library has no ``malloc_trim``)."""
    fn = _trim()
    return bool(fn(0)) if fn is not None else False
