"""Content hashes chained message to message, so any altered, removed or reordered message shows."""

from __future__ import annotations

import hashlib
import json

GENESIS = "0" * 64


def message_hash(prev_hash: str, seq: int, role: str, name: str | None, content: str) -> str:
    """sha256 over the previous hash and this message's identity and content (canonical JSON)."""
    blob = json.dumps([prev_hash, seq, role, name, content], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
