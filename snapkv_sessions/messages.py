"""The message side of a session: committing messages (admitted against the limits, pins found once, one
transaction for several), reading them back, and the stored replies. :class:`~snapkv_sessions.session.Session`
adds the turns on top; every message committed here is fed to the cache with the next turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .admission import Admission
from .chat import Message, MessagePins
from .errors import ConfigError
from .press import history_room
from .store import NewMessage, SessionStore
from .transcript import Transcript
from .turn import Reply, stored_reply

if TYPE_CHECKING:
    from .policy import Policy
    from .runner import ModelRunner


class SessionMessages:
    """A session's messages in the store. The session supplies its id, store, policy, runner, transcript and
    admission, and ``_sync`` (:class:`~snapkv_sessions.sync.SessionSync`'s: a turn another worker left pending
    is resolved before anything is appended)."""

    id: str
    store: SessionStore
    policy: Policy
    runner: ModelRunner
    transcript: Transcript
    admission: Admission

    def _sync(self) -> None:
        raise NotImplementedError

    def add_message(self, msg: str | dict | Message) -> int:
        """Commit a non-turn message (system, developer, tool_schema, document); it is fed with the next turn."""
        message = Message.coerce(msg, default_role="system")
        if message.role in ("user", "assistant"):
            raise ConfigError("msg.role", message.role, "user messages go through chat(); assistant ones are replies")
        return self.add_messages([message])[0]

    def add_history(self, msg: str | dict | Message) -> int:
        """Commit a message of an exchange that happened outside this session (any role, user and assistant
        included), as ``Session.create(history=...)`` does; it is fed to the cache with the next turn."""
        return self.add_messages([msg])[0]

    def add_messages(self, messages: Sequence[str | dict | Message]) -> list[int]:
        """Commit several messages of any role (as :meth:`add_history`) all together or not at all: admitted
        together against the limits, then appended in one transaction; returns their seqs. They are fed to the
        cache with the next turn."""
        msgs = [Message.coerce(m) for m in messages]
        if not msgs:
            return []
        counts = self.admission.admit_all(msgs)
        with self.store.lock(self.id):
            self._sync()  # a turn another worker left pending is resolved first: its reply follows its question
            rows = self._new_rows(msgs, self.messages(), counts)
            return [row["seq"] for row in self.store.add_messages(self.id, rows)]  # the rows just written

    def admit(self, messages: Sequence[Message], reply_tokens: int = 0) -> None:
        """Check, storing nothing, that ``messages`` (the last one a turn's) and a reply of up to ``reply_tokens``
        would pass admission: :class:`AdmissionError` naming the limit if not. A server checks a request whole
        this way before it commits any of it."""
        self.admission.admit_all(messages, reply_tokens)

    def _new_rows(self, msgs: list[Message], stored: list[Message], counts: list[int]) -> list[NewMessage]:
        """``msgs`` as rows to append after ``stored``, each with its token count and pins."""
        rows, prefix = [], list(stored)
        for message, n in zip(msgs, counts, strict=True):
            pins = self._pins_at_commit(message, prefix)
            rows.append(NewMessage(message.role, message.content, message.name, message.pinned, token_count=n,
                                   pins=pins.to_json()))
            prefix.append(message)
        return rows

    def add_document(self, text: str, name: str | None = None, pinned: bool = False) -> int:
        """Commit a document; it enters the cache with the next turn (pinned documents are never evicted)."""
        return self.add_message(Message(role="document", content=text, name=name, pinned=pinned))

    def messages(self, include_abandoned: bool = False, up_to_seq: int | None = None) -> list[Message]:
        return [Message(role=r.role, content=r.content, name=r.name, pinned=r.pinned, seq=r.seq,
                        pins=MessagePins.from_json(r.pins))
                for r in self.store.messages(self.id, include_abandoned=include_abandoned)
                if up_to_seq is None or r.seq <= up_to_seq]

    def stored_reply(self, turn: int | None = None) -> Reply:
        """The reply of done turn ``turn`` (default the last one), as the store holds it."""
        return stored_reply(self.store, self.id, turn)

    def verify(self) -> list[str]:
        """Problems in the stored hash chain (empty when intact)."""
        return self.store.verify(self.id)

    def _pins_at_commit(self, message: Message, before: list[Message] | None = None) -> MessagePins:
        """``message``'s pins, checked against the tightest layer's room (:meth:`Transcript.commit_pins`).
        ``before``: the messages before it (default: the stored ones, read at most once)."""
        read: list[list[Message]] = [] if before is None else [before]

        def prefix() -> list[Message]:
            if not read:
                read.append(self.messages())
            return read[0]

        comp = self.policy.compression
        fixed = comp.pin_overflow == "error" and comp.budget is not None
        room = history_room(comp, self.runner.num_layers, comp.budget) if fixed else None
        return self.transcript.commit_pins(prefix, message, room, comp.budget)

    def count_tokens(self, text: str) -> int:
        """Content tokens of ``text``, as admission counts them."""
        return self.admission.count(text)
