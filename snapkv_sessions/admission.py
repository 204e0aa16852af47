"""Admission: the policy's limits, checked before anything is stored, on token counts taken once per message."""

from __future__ import annotations

from pathlib import Path

from .chat import Message
from .errors import ConfigError
from .policy import LimitsPolicy
from .store import SessionStore
from .store.tokens import TokenCounter


class AdmissionError(ConfigError):
    """A message would exceed a policy limit; nothing was stored and no model work was done."""


def _counter_for(tokenizer) -> TokenCounter | None:
    """The torch-free counter built from the model's tokenizer.json, when the tokenizer came from a folder."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "")))
    try:
        return TokenCounter.from_model_dir(folder)
    except (FileNotFoundError, OSError, ValueError):
        return None


class Admission:
    """Counts each message once, when it is committed, and checks the limits against the stored counts.

    The session total is one SUM over the counts stored with the messages, so admitting a message costs one
    tokenizer call whatever the session's length. Messages stored before counts were (migration m002) are
    counted once, when a check finds them, and their counts stored.
    """

    def __init__(self, limits: LimitsPolicy, store: SessionStore, session_id: str, tokenizer,
                 max_positions: int | None = None) -> None:
        self.limits, self.store, self.session_id, self.tokenizer = limits, store, session_id, tokenizer
        self.max_positions = max_positions  # the model's context: no session may outgrow it
        self.counter = _counter_for(tokenizer)

    def count(self, text: str) -> int:
        """Content tokens of ``text`` (tiktoken over the model's own vocabulary; ``tokenizers`` otherwise)."""
        if self.counter is not None:
            return self.counter.count(text)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def stored_tokens(self) -> int:
        """Content tokens of the session's active messages, from the stored counts."""
        # checked every time: another worker (an older version, mid-upgrade) may store a message uncounted
        missing = self.store.messages_without_count(self.session_id)
        if missing:
            self.store.set_token_counts(self.session_id, {seq: self.count(t) for seq, t in missing.items()})
        return self.store.content_tokens(self.session_id)

    def admit(self, message: Message) -> int:
        """Raise :class:`AdmissionError` if ``message`` would break a limit; else its token count (to store)."""
        n = self.count(message.content)
        doc_limit, session_limit = self.limits.max_document_tokens, self.limits.max_session_tokens
        if message.role == "document" and doc_limit is not None and n > doc_limit:
            raise AdmissionError("limits.max_document_tokens", doc_limit, f"document {message.name!r} has {n} tokens")
        if session_limit is not None and (total := n + self.stored_tokens()) > session_limit:
            raise AdmissionError("limits.max_session_tokens", session_limit,
                                 f"the session would hold {total} content tokens")
        if self.max_positions is not None and (total := n + self.stored_tokens()) > self.max_positions:
            raise AdmissionError("model.max_position_embeddings", self.max_positions,
                                 f"the session would hold {total} content tokens, past the model's context")
        return n
