"""Which threads run torch's parallel kernels.

On a CPU, torch runs a large op (a matrix product, a copy of a cache) on an OpenMP team started by the calling
thread, and that team lives as long as the thread does. A server's model runs on one thread (the scheduler's);
its other threads (request workers, the event loop) also touch tensors: a session's bookkeeping, a fork
boundary's copy of its cache, the drift embedder, the tier's copies. Measured on the 2-core machine
(docs/against-vllm.md), once such a thread had run one parallel op and lived on, every later decode step of the
model's thread was 1.3x to 1.6x slower; with that thread's OpenMP threads set to 1, the steps stayed as fast as
before. :func:`serial_kernels` does that for the calling thread only: torch has no per-thread setting
(``torch.set_num_threads`` changes the whole process), so it calls OpenMP's own ``omp_set_num_threads``, whose
value is per thread, in the OpenMP runtime torch loaded.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU libgomp or LLVM libomp), or None where none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp", "libomp")):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    return None


def serial_kernels() -> bool:
    """Run the calling thread's torch ops on this thread alone (its OpenMP threads set to 1); other threads keep
    theirs. Returns False, changing nothing, where torch's OpenMP runtime is not found (then the calling thread
    keeps torch's default). For threads that are not the model's: never call it on the thread that runs the
    model."""
    import torch

    torch.get_num_threads()  # torch sets a thread's OpenMP count on its first parallel op: do that first
    lib = _openmp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    ok = torch.get_num_threads() == 1
    if not ok:
        log.warning("serial_kernels: the OpenMP runtime found is not the one torch uses; nothing changed")
    return ok
