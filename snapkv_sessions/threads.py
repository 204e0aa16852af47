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

Setting the count is not enough for a thread that already ran parallel ops (the server's main thread loads the
model and packs its weights, then becomes the event loop's): its team's threads stay parked, and GNU OpenMP, when
it manages more threads than there are CPUs, stops spinning at its barriers and puts every thread to sleep between
parallel regions instead, so each of the hundreds of parallel ops in the model thread's decode step paid a wake-up.
Measured on the 2-core AMD EPYC with AVX-512 BF16, Qwen2.5-Coder-0.5B packed bf16 at 2.9K tokens: a step on
another thread took 93-108 ms while the main thread's team lived, 71-79 ms once it was released, as on the main
thread itself (docs/against-vllm.md). :func:`serial_kernels` therefore also releases the calling thread's team
(OpenMP 5's ``omp_pause_resource_all``: GNU OpenMP, torch's on Linux, ends the calling thread's pool threads).
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


_OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the calling thread's pool; the runtime starts again on its next use


def serial_kernels() -> bool:
    """Run the calling thread's torch ops on this thread alone (its OpenMP threads set to 1, and the team it
    started for earlier parallel ops released); other threads keep theirs. Returns False, changing nothing, where
    torch's OpenMP runtime is not found (then the calling thread keeps torch's default). For threads that are not
    the model's: never call it on the thread that runs the model."""
    import torch

    torch.get_num_threads()  # torch sets a thread's OpenMP count on its first parallel op: do that first
    lib = _openmp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    if torch.get_num_threads() != 1:
        log.warning("serial_kernels: the OpenMP runtime found is not the one torch uses; nothing changed")
        return False
    pause = getattr(lib, "omp_pause_resource_all", None)  # OpenMP 5 (GNU OpenMP 9 on): older runtimes lack it
    if pause is None or pause(ctypes.c_int(_OMP_PAUSE_SOFT)) != 0:  # nonzero: inside a parallel region
        log.warning("serial_kernels: the thread's OpenMP team could not be released")
    return True
