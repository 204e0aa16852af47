"""Messages and the chat template: roles, OpenAI-style dicts, and the exact text span of every message."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .errors import ConfigError
from .policy import ROLES

# How each role reaches the model's chat template (the store keeps the raw role and content).
TEMPLATE_ROLE = {"system": "system", "developer": "system", "tool_schema": "system", "document": "user",
                 "user": "user", "assistant": "assistant", "tool": "tool"}


def format_tool_calls(tool_calls: list[dict]) -> str:
    """Tool calls as the model writes them (Hermes / Qwen style), one ``<tool_call>`` block per call.

    Accepts OpenAI calls (``{"id", "type": "function", "function": {"name", "arguments": "<json>"}}``) and flat
    ones (``{"name", "arguments" or "args", "id"}``, as LangChain keeps them). The block is what the model is
    prompted to emit, so a stored history reads to the model like its own earlier replies; the ``id`` is kept
    so a tool result (stored with ``name`` = the call id) can be traced back to its call.
    """
    blocks = []
    for call in tool_calls:
        if not isinstance(call, dict):
            raise ConfigError("msg.tool_calls", call, "each tool call must be a dict")
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        args = fn.get("arguments", fn.get("args", {}))
        if isinstance(args, str):  # OpenAI sends the arguments as JSON text
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON: kept verbatim, as the caller sent it
        body = {"name": fn.get("name"), "arguments": args}
        if call.get("id"):
            body["id"] = call["id"]
        blocks.append("<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(blocks)


def _check_text(param: str, value: object) -> None:
    """Text the store can keep and hash exactly: a str, valid UTF-8 (no lone surrogate), no NUL character."""
    if not isinstance(value, str):
        raise ConfigError(param, value, f"must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise ConfigError(param, value, "contains a NUL character, which no store keeps")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(param, value, f"is not valid Unicode text ({exc.reason} at {exc.start})") from None


class TemplateError(ConfigError):
    """The chat template does not render a conversation as a stable prefix of its extension."""


class RenderDiverged(TemplateError):
    """The conversation, rendered now, does not start with the tokens the cache holds: a reply decoded a special
    token that its stored text leaves out, or the template renders an earlier message differently once more
    follow. The session re-prefills the turn from the store (exact); nothing is refused."""


@dataclass(frozen=True)
class MessagePins:
    """Pinned character ranges of one message's rendered span, computed once when the message is committed.

    ``span`` identifies the rendered span they were found in; a span that renders differently at plan time
    (a message before it was abandoned, or a template that numbers messages) is searched again.
    """

    span: str  # sha256 (first 16 hex digits) of the rendered span the ranges were found in
    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def digest(span_text: str) -> str:
        return hashlib.sha256(span_text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"span": self.span, "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, data: dict | None) -> MessagePins | None:
        """Stored pins, or None (not stored, or not in this form: the plan then searches the span again)."""
        try:
            return cls(str(data["span"]), tuple((int(a), int(b)) for a, b in data["ranges"]))
        except (TypeError, KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Message:
    """One message of a session. ``seq`` is its place in the store's hash chain (None before it is stored)."""

    role: str
    content: str
    name: str | None = None
    pinned: bool = False
    seq: int | None = None
    pins: MessagePins | None = field(default=None, compare=False, repr=False)  # set by the store, never by input

    def __post_init__(self) -> None:
        # every message is checked here, whatever path it came by: a bad one is refused before it is stored
        if self.role not in ROLES:
            raise ConfigError("msg.role", self.role, f"must be one of {list(ROLES)}")
        _check_text("msg.content", self.content)
        if self.name is not None:
            _check_text("msg.name", self.name)
        if not isinstance(self.pinned, bool):
            raise ConfigError("msg.pinned", self.pinned, "must be true or false")

    @classmethod
    def coerce(cls, msg: str | dict | Message, default_role: str = "user") -> Message:
        """A Message from a string (``default_role``), an OpenAI-style dict or a Message."""
        if isinstance(msg, Message):
            return msg
        if isinstance(msg, str):
            return cls(role=default_role, content=msg)
        if not isinstance(msg, dict):
            raise ConfigError("msg", type(msg).__name__, "must be a str, an OpenAI-style dict or a Message")
        role = msg.get("role", default_role)
        if role not in ROLES:
            raise ConfigError("msg.role", role, f"must be one of {list(ROLES)}")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if msg.get("tool_calls") and (content is None or isinstance(content, str)):
            calls = format_tool_calls(msg["tool_calls"])  # an assistant's tool calls are part of what it said
            content = f"{content}\n{calls}" if content else calls
        if not isinstance(content, str):
            raise ConfigError("msg.content", content, "must be a string")
        name = msg.get("name") or msg.get("tool_call_id")
        return cls(role=role, content=content, name=name, pinned=msg.get("pinned", False))

    def for_template(self) -> dict:
        content = self.content
        if self.role == "document":
            content = f"Document{' ' + self.name if self.name else ''}:\n{content}"
        elif self.role == "tool_schema":
            content = f"Tools available (JSON schema):\n{content}"
        elif self.role == "developer":
            content = f"Developer instructions:\n{content}"
        return {"role": TEMPLATE_ROLE[self.role], "content": content}


class ChatFormatter:
    """Renders messages with the tokenizer's chat template and knows each message's character span."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenizer", type(tokenizer).__name__, "has no chat template")
        self.tokenizer = tokenizer
        self._memo: dict[tuple, str] = {}

    def _render(self, msgs: list[Message], generation_prompt: bool) -> str:
        key = (tuple((m.role, m.name, m.content) for m in msgs), generation_prompt)
        if key not in self._memo:
            self._memo[key] = self.tokenizer.apply_chat_template(
                [m.for_template() for m in msgs], add_generation_prompt=generation_prompt, tokenize=False)
        return self._memo[key]

    def render(self, msgs: list[Message], generation_prompt: bool = True) -> tuple[str, list[tuple[int | None, int, int]]]:
        """The conversation text and ``(seq, start, end)`` character spans; the generation prompt's span has
        seq None.

        The cache holds a conversation's rendering, so it must only ever grow at its end. Some templates render
        a message differently once another follows it (Qwen's groups consecutive tool results in one user block
        and closes it after the last). From the first message where the template's rendering would rewrite what
        came before, each message is rendered on its own (:meth:`_alone`) and appended: the same blocks, one per
        message, and a rendering that never changes behind the cache. Deterministic, so replays render the same.
        """
        spans: list[tuple[int | None, int, int]] = []
        prev, alone = "", False
        for i, msg in enumerate(msgs):
            text = None if alone else self._render(msgs[: i + 1], False)
            if text is None or not text.startswith(prev):
                alone = True
                text = prev + self._alone(msg)
            spans.append((msg.seq, len(prev), len(text)))
            prev = text
        if generation_prompt:
            text = prev + self._alone(None) if alone else self._render(msgs, True)
            if not text.startswith(prev):
                raise TemplateError("tokenizer.chat_template", "generation prompt", "rendering is not prefix-stable")
            spans.append((None, len(prev), len(text)))
            prev = text
        return prev, spans

    def _alone(self, msg: Message | None) -> str:
        """One message's block as the template writes it after a system message (None: the generation prompt)."""
        anchor = [Message(role="system", content="")]
        before = self._render(anchor, False)
        after = self._render(anchor + [msg], False) if msg is not None else self._render(anchor, True)
        if not after.startswith(before):
            raise TemplateError("tokenizer.chat_template", msg.role if msg else "generation prompt",
                                "rendering is not prefix-stable")
        return after[len(before):]
