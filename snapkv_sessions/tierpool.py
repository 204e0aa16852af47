"""The per-process pool of cold tiers (:mod:`snapkv_sessions.tier`): one byte cap over every session's tier.

The least recently used idle session's tier goes first: dropped, with the reason in its ``lost`` (its session then
re-prefills from the store, which stays exact), or spilled to disk as safetensors and read back on its next turn.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

from . import stats
from .errors import ConfigError
from .tier import ColdKV, ColdLayer

# TierEvent.reason of the pool's events (bounded codes: the reason a metric labels spills and losses with)
MEMORY_LIMIT = "memory_limit"  # the byte cap made the pool spill or drop the least recently used tier
SPILL_FAILED = "spill_failed"  # the spill of such a tier failed (a full or unwritable disk): it was dropped


def default_cap() -> int:
    """A quarter of the host's physical memory (2 GiB when it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 2 << 30


class TierPool:
    """Every cold tier of a process, under one byte cap: the least recently used session's tier goes first.

    With ``spill_dir`` an evicted tier is written there as safetensors and read back on its session's next
    turn; without, it is dropped and its ``lost`` says why (the session then re-prefills from the store). A tier
    in use by a running turn (between :meth:`touch` and :meth:`done`) is never evicted.
    """

    def __init__(self, max_bytes: int | None = None, spill_dir: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        # least recently used first; weak, so a session that is dropped frees its tier with it
        self._tiers: OrderedDict[str, weakref.ref[ColdKV]] = OrderedDict()
        self._busy: dict[str, int] = {}  # tier key -> turns running on it
        self.max_bytes = default_cap()
        self.spill_dir: Path | None = None
        self.configure(max_bytes, spill_dir)

    def configure(self, max_bytes: int | None, spill_dir: str | Path | None) -> None:
        """Set what is given (None leaves a setting as it is; the default cap is a quarter of host memory)."""
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 0):
            raise ConfigError("memory.max_bytes", max_bytes, "must be a non-negative int or None")
        if max_bytes is not None:
            self.max_bytes = max_bytes
        if spill_dir is not None:
            self.spill_dir = Path(spill_dir)

    def reset(self, max_bytes: int | None = None, spill_dir: str | Path | None = None) -> None:
        """Back to the defaults (or the given settings)."""
        self.max_bytes, self.spill_dir = default_cap(), None
        self.configure(max_bytes, spill_dir)

    def _live(self) -> list[ColdKV]:
        return [cold for ref in self._tiers.values() if (cold := ref()) is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._live())

    def touch(self, cold: ColdKV) -> None:
        """A turn runs on ``cold``: most recent, in use until :meth:`done`, and back in memory if it was spilled."""
        with self._lock:
            for key in [k for k, ref in self._tiers.items() if ref() is None]:  # sessions dropped since
                del self._tiers[key]
            self._tiers[cold.key] = weakref.ref(cold)
            self._tiers.move_to_end(cold.key)
            self._busy[cold.key] = self._busy.get(cold.key, 0) + 1
        if cold.spilled is not None:
            _unspill(cold)
            _event("restored", cold, None)

    def done(self, cold: ColdKV) -> None:
        """The turn on ``cold`` ended (however it ended): it may be evicted again."""
        with self._lock:
            left = self._busy.get(cold.key, 0) - 1
            if left > 0:
                self._busy[cold.key] = left
            else:
                self._busy.pop(cold.key, None)

    def release(self, cold: ColdKV) -> None:
        """Forget ``cold`` (its session restarted its cache), and its spill file if it has one."""
        with self._lock:
            self._tiers.pop(cold.key, None)
            self._busy.pop(cold.key, None)
        if cold.spilled is not None:
            cold.spilled.unlink(missing_ok=True)
            cold.spilled = None

    def enforce(self) -> list[ColdKV]:
        """Evict least recently used tiers not in use until the pool fits its cap; returns those evicted.

        Never raises: a spill that fails drops the tier instead, and says why in its ``lost``."""
        evicted = []
        with self._lock:
            idle = [key for key in self._tiers if key not in self._busy]
            while idle and self.nbytes > self.max_bytes:
                cold = self._tiers.pop(idle.pop(0))()
                if cold is None:
                    continue
                held = (cold.nbytes, _slots(cold))
                reason = f"evicted by the cold tier's byte cap ({self.max_bytes} bytes, least recently used)"
                # the session records the whole sentence (cold.lost); the stream gets a bounded code, which a
                # metric may carry as a label
                if self.spill_dir is not None:
                    try:
                        _spill(cold, self.spill_dir)
                        _event("spilled", cold, MEMORY_LIMIT, held)
                    except (OSError, RuntimeError) as exc:  # a full or unwritable disk: drop it instead
                        cold.drop(f"{reason}; its spill failed ({type(exc).__name__}: {str(exc)[:200]})")
                        _event("lost", cold, SPILL_FAILED, held)
                else:
                    cold.drop(reason)
                    _event("lost", cold, MEMORY_LIMIT, held)
                evicted.append(cold)
            live = self._live() if stats.active() else None
        if live is not None:  # the pool as it stands after each turn (emitted outside the lock): the process's gauges
            stats.emit(stats.PoolStat(sum(t.nbytes for t in live), self.max_bytes, len(live),
                                      sum(t.spilled is not None for t in live)))
        return evicted


def _slots(cold: ColdKV) -> int:
    return sum(lay.positions.numel() for lay in cold.layers if lay is not None)


def _event(kind: str, cold: ColdKV, reason: str | None, held: tuple[int, int] | None = None) -> None:
    """A pool event on ``cold`` to the stats stream (a pool-wide event: the pool does not know the session)."""
    if stats.active():
        nbytes, slots = held if held is not None else (cold.nbytes, _slots(cold))
        stats.emit(stats.TierEvent(kind, None, nbytes, slots, reason))


def _spill(cold: ColdKV, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, lay in enumerate(cold.layers):
        if lay is not None:
            tensors |= {f"{i}.keys": lay.keys, f"{i}.values": lay.values, f"{i}.positions": lay.positions}
            if lay.real is not None:
                tensors[f"{i}.real"] = lay.real
    path = folder / f"cold-{cold.key}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    cold.layers = [None] * len(cold.layers)
    cold.spilled = path


def _unspill(cold: ColdKV) -> None:
    from safetensors.torch import load_file

    path, cold.spilled = cold.spilled, None
    tensors = load_file(str(path))
    for i in range(len(cold.layers)):
        if f"{i}.keys" in tensors:
            cold.layers[i] = ColdLayer(tensors[f"{i}.keys"], tensors[f"{i}.values"], tensors[f"{i}.positions"],
                                       tensors.get(f"{i}.real"))
    path.unlink(missing_ok=True)


POOL = TierPool()
