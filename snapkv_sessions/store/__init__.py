"""The raw store: the source of truth every evicted KV can be rebuilt from (SQLAlchemy, Redis).

This subpackage never imports torch, so workers that only read or audit sessions stay light.
"""

from .hashing import message_hash
from .locks import LockTimeout
from .store import NewMessage, SessionStore, StoreError, StoreUnavailable, default_url, is_session_id

__all__ = ["LockTimeout", "NewMessage", "SessionStore", "StoreError", "StoreUnavailable", "default_url",
           "is_session_id", "message_hash"]
