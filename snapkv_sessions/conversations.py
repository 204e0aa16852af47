"""Continuing a stored conversation from a client's whole message list.

Chat APIs (LangChain's chat models, OpenAI's chat completions) send the whole conversation on every call. A
session continues it when what it stored is a proper prefix of the list, compared message by message as the
client saw each one (role, name and content; a reply as the text and tool calls it was returned as). Only the
messages past that prefix are committed: system-like ones as messages, earlier user / assistant ones as history,
and the last one (a user or tool message) starts the turn. A list that does not extend the stored conversation
starts a new session instead of pretending to continue the old one.

This is the framework-neutral part shared by :mod:`snapkv_sessions.integrations.langchain` and
:mod:`snapkv_sessions.serve`; it imports neither.
"""

from __future__ import annotations

from .chat import Message
from .errors import ConfigError
from .generation import cut_at_stop
from .integrations.openai import TOOL_CALL_OPEN, could_be_tool_call, parse_tool_calls, stored_text, tool_schema_message
from .session import Session
from .store import SessionStore

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


def unseen(session: Session | tuple[SessionStore, str], wanted: list[Message],
           tools: list[str] | None) -> list[Message] | None:
    """The messages of ``wanted`` past what a session (a Session, or a store and a session id) stored, when that is
    a proper prefix of ``wanted``; else None. Reads the store only: no cache is rebuilt to answer."""
    store, session_id = (session.store, session.id) if isinstance(session, Session) else session
    keys = stored_keys(store, session_id, tools)
    if len(keys) < len(wanted) and [message_key(m) for m in wanted[: len(keys)]] == keys:
        return wanted[len(keys):]
    return None


def answered(session: Session | tuple[SessionStore, str], wanted: list[Message], tools: list[str] | None) -> bool:
    """Whether the session stored exactly ``wanted`` and then its reply: the request was answered already (a
    retry after a failure that came after the turn was run, or recovered by the store's pending rules)."""
    store, session_id = (session.store, session.id) if isinstance(session, Session) else session
    keys = stored_keys(store, session_id, tools)  # (role, name, content) each
    return (len(keys) == len(wanted) + 1 and keys[-1][0] == "assistant"
            and [message_key(m) for m in wanted] == keys[:-1])


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


__all__ = ["FINISH", "StreamFilter", "call_id", "message_key", "reply_view", "stored_keys", "unseen",
           "with_tools"]
