"""CUDA fast paths, each behind a guarded import and each with a device-agnostic fallback in the core.

* :mod:`snapkv_sessions.gpu.triton_scores`: SnapKV scoring (pooling along positions and the GQA head
  reduction) fused into one Triton kernel; fallback :meth:`snapkv_sessions.press.SnapKV.score`.
* :mod:`snapkv_sessions.gpu.check`: the prepared GPU check, ``python -m snapkv_sessions.gpu.check``
  (``--device cpu`` runs the same code on a tiny model, and the Triton kernel in Triton's interpreter).

Nothing in the core imports this package at module level; :func:`fused_scorer` is the one entry point the
engine calls, and it returns None (use the fallback) wherever the fast path does not apply.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Whether Triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def fused_scorer(device: torch.device, window: int, kernel: int, pooling: str, head_reduce: str):
    """The Triton scorer for ``device``, or None where the core's torch fallback should run.

    The fused kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the tests). ``SNAPKV_SESSIONS_FUSED=0`` turns it off.
    """
    if os.environ.get("SNAPKV_SESSIONS_FUSED", "1") == "0" or not triton_available():
        return None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return None
    from .triton_scores import FusedSnapKV

    return FusedSnapKV(window=window, kernel=kernel, pooling=pooling, head_reduce=head_reduce)
