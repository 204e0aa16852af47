"""Content hashes chained message to message, and row seals, so that any altered, removed or reordered row shows.

The chain (:func:`message_hash`) covers what a message says: its place, role, name and content. It is keyless on
purpose: it identifies a conversation's content wherever it is stored. A seal (:func:`row_seal`) covers every other
column a row's meaning depends on (a message's ``pinned`` flag and status, a turn's whole record, a session's head
and message count), so :meth:`SessionStore.verify` names any single-row edit or deletion. Without a key a seal is
SHA-256, which catches any edit made by a tool that does not recompute it; with a key (``SNAPKV_SESSIONS_SEAL_KEY``)
it is HMAC-SHA256, and a row changed by anyone without the key cannot be resealed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping

GENESIS = "0" * 64

# The columns each table's seal covers. Left out: the row id, the seal itself, timestamps (their representation
# differs between databases) and messages' token_start/token_end (positions of the last prefill, rebuilt by the
# audit from the transcript). A migration that adds a column adds it here and reseals the existing rows.
SEALED: dict[str, tuple[str, ...]] = {
    "sessions": ("id", "model_id", "policy_json", "policy_sha256", "title", "turns_done", "head_hash",
                 "message_count", "meta", "thread_id", "owner"),
    "messages": ("session_id", "seq", "role", "name", "content", "pinned", "status", "turn", "token_count", "pins",
                 "prev_hash", "hash"),
    "turns": ("session_id", "turn", "status", "user_seq", "assistant_seq", "prefill_tokens", "decode_tokens",
              "pending_tokens", "segments", "tokens_in", "tokens_out", "kept_per_role", "retention",
              "kept_positions", "compression", "drift_score", "drift_decision", "timings", "policy_sha256",
              "model_id", "generation", "seed", "stop_reason"),
}


def message_hash(prev_hash: str, seq: int, role: str, name: str | None, content: str) -> str:
    """sha256 over the previous hash and this message's identity and content (canonical JSON)."""
    blob = json.dumps([prev_hash, seq, role, name, content], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _plain(value: object) -> object:
    """A column value as canonical JSON can hold it: bytes (safetensors blobs) by their digest."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(value)).hexdigest()
    return value


def row_seal(key: bytes | None, table: str, row: Mapping[str, object]) -> str:
    """The seal of one row of ``table`` over its :data:`SEALED` columns: HMAC-SHA256 with ``key``, else SHA-256."""
    fields = [table, *(_plain(row[c]) for c in SEALED[table])]
    blob = json.dumps(fields, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if key is None:
        return hashlib.sha256(blob).hexdigest()
    return hmac.new(key, blob, hashlib.sha256).hexdigest()
