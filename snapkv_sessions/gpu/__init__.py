"""CUDA fast paths, each behind a guarded import and each with a device-agnostic fallback in the core.

* :mod:`snapkv_sessions.gpu.triton_scores`: SnapKV scoring (pooling along positions and the GQA head
  reduction) fused into one Triton kernel, a scorer of the seam in :mod:`snapkv_sessions.scorers` (its
  ``"snapkv"`` factory asks :func:`fused_scorer` first); fallback :meth:`snapkv_sessions.press.SnapKV.score`.
* :mod:`snapkv_sessions.gpu.triton_gather`: the compression gather of every layer in one launch per keys and
  values; fallback: the per-layer ``gather`` in :meth:`snapkv_sessions.runner.ModelRunner.compress`.
* :mod:`snapkv_sessions.gpu.check`: the prepared GPU check, ``python -m snapkv_sessions.gpu.check``
  (``--device cpu`` runs the same code on a tiny model, and the Triton kernel in Triton's interpreter).

The core imports only the entry points below, :func:`fused_scorer` and :func:`fused_gather`; they import no
Triton or CUDA-only module until a fast path applies, and return None (use the fallback) where none does.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Whether Triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _enabled(device: torch.device) -> bool:
    if os.environ.get("SNAPKV_SESSIONS_FUSED", "1") == "0" or not triton_available():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def fused_gather(device: torch.device):
    """``gather_layers(keys, values, idx)`` (one launch per kind for all layers) for ``device``, or None."""
    if not _enabled(device):
        return None
    from .triton_gather import gather_layers

    return gather_layers


def fused_scorer(device: torch.device, window: int, kernel: int, pooling: str, head_reduce: str):
    """The Triton scorer for ``device``, or None where the core's torch fallback should run.

    The fused kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the tests). ``SNAPKV_SESSIONS_FUSED=0`` turns it off.
    """
    if not _enabled(device):
        return None
    from .triton_scores import FusedSnapKV

    return FusedSnapKV(window=window, kernel=kernel, pooling=pooling, head_reduce=head_reduce)
