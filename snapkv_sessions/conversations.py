"""Continuing a stored conversation from a client's whole message list.

Chat APIs (LangChain's chat models, OpenAI's chat completions) send the whole conversation on every call. A
session continues it when what it stored is a proper prefix of the list, compared message by message as the
client saw each one (role, name and content; a reply as the text and tool calls it was returned as). Only the
messages past that prefix are committed: system-like ones as messages, earlier user / assistant ones as history,
and the last one (a user or tool message) starts the turn. A list that does not extend the stored conversation
starts a new session instead of pretending to continue the old one.

Which session a list continues is decided here alone (:func:`resolve` for one candidate session,
:func:`find_continued` over a caller's sessions by content hash), as a :class:`Resolution`, for the server, the Ray
ingress and LangChain alike.

This is the framework-neutral part shared by :mod:`snapkv_sessions.integrations.langchain` and
:mod:`snapkv_sessions.serve`; it imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from .chat import Message
from .errors import ConfigError
from .generation import cut_at_stop
from .integrations.openai import TOOL_CALL_OPEN, could_be_tool_call, parse_tool_calls, stored_text, tool_schema_message
from .session import Session
from .store import SessionStore
from .store.hashing import GENESIS, message_hash

SCAN_RECENT = 32  # sessions compared message by message when no content hash matches
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # a reply's stop reason as OpenAI's finish_reason


def message_key(msg: Message) -> tuple:
    """What must be equal for a stored message and an incoming one to be the same message."""
    return (msg.role, None if msg.role == "assistant" else msg.name, msg.content)


def call_id(session_id: str, turn: int, index: int) -> str:
    """Deterministic ids, so a reply read back from the store gets the ids it was returned with."""
    return f"call_{session_id[:8]}_{turn}_{index}"


def reply_view(session_id: str, turn: int, text: str, tools: list[str] | None) -> tuple[str, list[dict]]:
    """The content and tool calls (``{"name", "arguments", "id"}``) a client is shown for a reply's text."""
    if not tools:
        return text, []
    content, calls = parse_tool_calls(text, tools)
    return content, [{**c, "id": call_id(session_id, turn, i)} for i, c in enumerate(calls)]


def stored_keys(store: SessionStore, session_id: str, tools: list[str] | None) -> list[tuple]:
    """Keys of a session's active messages; a reply is keyed as the message it was returned as."""
    done = store.turns(session_id, status="done")
    replies = {row["assistant_seq"]: (row["turn"], (row["generation"] or {}).get("stop") or []) for row in done}
    keys = []
    for row in store.messages(session_id, include_abandoned=False):
        msg = Message(role=row["role"], content=row["content"], name=row["name"])
        if row["seq"] in replies:
            turn, stops = replies[row["seq"]]
            content, calls = reply_view(session_id, turn, cut_at_stop(msg.content, stops), tools)
            msg = Message(role="assistant", content=stored_text(content, calls))
        keys.append(message_key(msg))
    return keys


@dataclass(frozen=True)
class Resolution:
    """Which stored session a client's whole message list continues.

    ``outcome``: "continued" (``session_id`` stored a proper prefix of the list; ``new`` holds the rest, the last
    one the turn), "answered" (``session_id`` stored the list and then its reply: a retry; ``new`` is empty) or
    "new" (no session continues it; ``session_id`` is None and ``new`` is the whole list)."""

    outcome: Literal["new", "continued", "answered"]
    session_id: str | None
    new: tuple[Message, ...]

    @classmethod
    def start(cls, wanted: list[Message]) -> Resolution:
        return cls("new", None, tuple(wanted))


def utc(moment: datetime) -> datetime:
    """A stored timestamp as UTC (SQLite hands back naive datetimes for timezone-aware columns)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def prefix_heads(wanted: list[Message]) -> dict[str, int]:
    """The store's content hash (:func:`message_hash` chain) of each prefix of ``wanted``'s earlier messages -> its
    length: how a session holding that prefix is found (:meth:`SessionStore.sessions_at_head`)."""
    heads, prev = {}, GENESIS
    for seq, msg in enumerate(wanted[:-1], 1):
        prev = message_hash(prev, seq, msg.role, msg.name, msg.content)
        heads[prev] = seq
    return heads


def resolve(session: Session | tuple[SessionStore, str], wanted: list[Message], tools: list[str] | None, *,
            retried: bool = False) -> Resolution:
    """Whether one session (a Session, or a store and a session id) continues ``wanted``: "continued" when what it
    stored is a proper prefix of ``wanted``; with ``retried``, "answered" when it stored exactly ``wanted`` and then
    its reply (a retry after a failure that came after the turn was run, or recovered by the store's pending
    rules); else "new". Reads the store only: no cache is rebuilt to answer."""
    store, session_id = (session.store, session.id) if isinstance(session, Session) else session
    keys = stored_keys(store, session_id, tools)  # (role, name, content) each
    if len(keys) < len(wanted) and [message_key(m) for m in wanted[: len(keys)]] == keys:
        return Resolution("continued", session_id, tuple(wanted[len(keys):]))
    if (retried and len(keys) == len(wanted) + 1 and keys[-1][0] == "assistant"
            and [message_key(m) for m in wanted] == keys[:-1]):
        return Resolution("answered", session_id, ())
    return Resolution.start(wanted)


def find_continued(store: SessionStore, wanted: list[Message], tools: list[str] | None, *, owner: str | None,
                   model_id: str, policy_sha256: str, heads: Mapping[str, int] | None = None) -> Resolution:
    """Among ``owner``'s sessions of this model and policy, the one holding the longest proper prefix of
    ``wanted``: by content hash first (``heads``, default :func:`prefix_heads`), then, when no chain matches
    (replies holding tool calls are compared as they were returned), message by message over the
    :data:`SCAN_RECENT` most recent ones. "new" when none continues it."""
    heads = prefix_heads(wanted) if heads is None else heads
    hits = store.sessions_at_head(owner, list(heads), model_id=model_id, policy_sha256=policy_sha256)
    for hit in sorted(hits, key=lambda h: -heads[h["head_hash"]]):
        found = resolve((store, hit["id"]), wanted, tools)
        if found.outcome == "continued":
            return found
    best: Resolution | None = None
    rows = store.list_sessions(owner=owner, any_owner=False)
    for row in sorted(rows, key=lambda r: (utc(r["updated_at"]), r["id"]), reverse=True)[:SCAN_RECENT]:
        if row["model_id"] != model_id or row["policy_sha256"] != policy_sha256:
            continue
        found = resolve((store, row["id"]), wanted, tools)
        # an empty stored prefix (a session whose turns were all abandoned) continues nothing
        if (found.outcome == "continued" and len(found.new) < len(wanted)
                and (best is None or len(found.new) < len(best.new))):
            best = found
    return best or Resolution.start(wanted)


def with_tools(wanted: list[Message], tools: list[dict] | None, tool_choice: object = None) -> list[Message]:
    """``wanted`` checked as a turn's message list (the last one a user or tool message), with the tool list as a
    pinned ``tool_schema`` message after the leading system / developer messages, where a tool list belongs."""
    if not wanted:
        raise ConfigError("messages", wanted, "give at least one message")
    if wanted[-1].role not in ("user", "tool"):
        raise ConfigError("messages[-1].role", wanted[-1].role, "the last message must be a user or tool message")
    if not tools:
        return list(wanted)
    at = next((i for i, m in enumerate(wanted) if m.role not in ("system", "developer")), len(wanted))
    return [*wanted[:at], tool_schema_message(tools, tool_choice), *wanted[at:]]


class StreamFilter:
    """How much of a streamed reply may be shown yet when tools are bound: no tool-call markup.

    Stop strings are not its business: ``Session.stream`` never yields text at or past one (nor a tail that could
    start one), so without tools every piece passes through unchanged.
    """

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.markers = [TOOL_CALL_OPEN] if tools else []
        self.text = ""
        self.shown = ""

    def feed(self, piece: str) -> str:
        self.text += piece
        safe = self._safe()
        if len(safe) <= len(self.shown):
            return ""
        out, self.shown = safe[len(self.shown):], safe
        return out

    def _safe(self) -> str:
        if self.tools and could_be_tool_call(self.text):
            return ""  # maybe a bare JSON call: shown (or turned into a call) once the reply is complete
        cut = min([self.text.find(m) for m in self.markers if m in self.text] + [len(self.text)])
        head = self.text[:cut]
        # hold back a tail that may be the first characters of "<tool_call>"
        held = max([k for m in self.markers for k in range(1, len(m)) if head.endswith(m[:k])] + [0])
        return head[: len(head) - held]


__all__ = ["FINISH", "SCAN_RECENT", "Resolution", "StreamFilter", "call_id", "find_continued", "message_key",
           "prefix_heads", "reply_view", "resolve", "stored_keys", "utc", "with_tools"]
