"""Kept positions as safetensors (numpy): no pickle, no torch."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load, save


def pack_positions(per_layer: list[np.ndarray]) -> bytes:
    """``per_layer[l]`` (Hkv, K_l) integer positions -> safetensors bytes (int32, keys ``layer.{l}``)."""
    return save({f"layer.{i}": np.ascontiguousarray(a, dtype=np.int32) for i, a in enumerate(per_layer)})


def unpack_positions(blob: bytes) -> list[np.ndarray]:
    tensors = load(blob)
    return [tensors[f"layer.{i}"] for i in range(len(tensors))]
