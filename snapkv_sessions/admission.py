"""Admission: the policy's limits, checked before anything is stored, on token counts taken once per message.

Two kinds of count: *content* tokens (what ``limits`` bound, stored with every message) and *rendered* tokens (what
a turn prefills: content plus the chat template's markup, about five tokens a message on these models), which
must fit the model's context together with the reply's cap. Rendered counts are bounded from above per message
(:class:`TemplateCost`), so a request is admitted or refused whole in one pass over its messages, never by
rendering and tokenizing the conversation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from .chat import TEMPLATE_ROLE, ChatFormatter, Message
from .errors import ConfigError
from .policy import LimitsPolicy
from .store import SessionStore
from .store.tokens import TokenCounter


class AdmissionError(ConfigError):
    """A message would exceed a policy limit; nothing was stored and no model work was done."""


def _counter_for(tokenizer) -> TokenCounter | None:
    """The torch-free counter built from the model's tokenizer.json, when the tokenizer came from a folder. Built
    once per file and process (:func:`_counter_at`): every new session admits its first messages with one."""
    path = Path(str(getattr(tokenizer, "name_or_path", ""))) / "tokenizer.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    return _counter_at(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _counter_at(path: str, mtime_ns: int, size: int) -> TokenCounter | None:
    """The counter of the tokenizer.json at ``path`` as it was at ``mtime_ns``/``size`` (a file rewritten since
    is read again). Parsing the file and building its ranks took about 0.8 s for Qwen2.5's 7 MB tokenizer.json,
    which every new session paid before its first turn (a server's first-turn TTFT, docs/against-vllm.md)."""
    try:
        return TokenCounter.from_tokenizer_json(Path(path))
    except (FileNotFoundError, OSError, ValueError):
        return None


class TemplateCost:
    """Upper bounds on the tokens the chat template adds around a message (the role markers, separators, a
    role's fixed prefix such as ``Document NAME:``) and once per prompt (a default system prompt, the
    generation prompt).

    Each bound is the markup rendered around an empty message, tokenized alone, plus :attr:`SLACK` for the tokens
    at the seams (where markup and content could tokenize into one token more than apart): so a message's
    rendered tokens never exceed its content tokens plus :meth:`message` (``tests/test_server_limits.py``).
    """

    SLACK = 2

    def __init__(self, formatter: ChatFormatter) -> None:
        self.formatter = formatter
        self.tokenizer = formatter.tokenizer
        self._roles: dict[str, int] = {}  # template role -> markup bound
        self._prefixes: dict[tuple[str, str | None], int] = {}  # (role, document name) -> prefix bound

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def _role(self, template_role: str) -> int:
        if template_role not in self._roles:
            probe = Message(role=_ROLE_OF[template_role], content="")
            self._roles[template_role] = self._tokens(self.formatter._alone(probe)) + self.SLACK
        return self._roles[template_role]

    def _prefix(self, role: str, name: str | None) -> int:
        """The fixed text a role puts before its content (``Message.for_template``)."""
        if (role, name) not in self._prefixes:
            shown = Message(role=role, content="", name=name).for_template()["content"]
            self._prefixes[role, name] = self._tokens(shown) + (self.SLACK if shown else 0)
        return self._prefixes[role, name]

    @functools.cached_property
    def prompt(self) -> int:
        """What a prompt adds once: the generation prompt, and a default system prompt some templates insert."""
        alone = self.formatter.render([Message(role="user", content="")], generation_prompt=True)[0]
        return max(0, self._tokens(alone) - self._role("user")) + self.SLACK

    @functools.cached_property
    def largest(self) -> int:
        """The bound for a stored message (its role not read): the largest role's, a document's without a name."""
        return max(self.message(Message(role=role, content="")) for role in TEMPLATE_ROLE)

    def message(self, message: Message) -> int:
        """Tokens the template adds to ``message``'s content, at most."""
        name = message.name if message.role == "document" else None
        return self._role(TEMPLATE_ROLE[message.role]) + self._prefix(message.role, name)


# a session role that renders as each template role (for the empty probe messages)
_ROLE_OF = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Admission:
    """Counts each message once, when it is committed, and checks the limits against the stored counts.

    The session total is one SUM over the counts stored with the messages, so admitting a message costs one
    tokenizer call whatever the session's length. Messages stored before counts were (migration m002) are
    counted once, when a check finds them, and their counts stored.
    """

    def __init__(self, limits: LimitsPolicy, store: SessionStore, session_id: str | None, tokenizer,
                 max_positions: int | None = None, formatter: ChatFormatter | None = None) -> None:
        self.limits, self.store, self.session_id, self.tokenizer = limits, store, session_id, tokenizer
        self.max_positions = max_positions  # the model's context: no session may outgrow it
        self.counter = _counter_for(tokenizer)
        self.cost = TemplateCost(formatter) if formatter is not None else None

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
        return self.admit_all([message])[0]

    def admit_all(self, messages: Sequence[Message], reply_tokens: int = 0, *, new_session: bool = False) -> list[int]:
        """Admit ``messages`` together (a request's new messages, the turn's last), with a reply of up to
        ``reply_tokens``: :class:`AdmissionError` if any limit would break, else each one's content tokens (to
        store). ``new_session``: nothing is stored yet (no store read)."""
        counts = [self.count(m.content) for m in messages]
        doc_limit, session_limit = self.limits.max_document_tokens, self.limits.max_session_tokens
        for message, n in zip(messages, counts, strict=True):
            if message.role == "document" and doc_limit is not None and n > doc_limit:
                raise AdmissionError("limits.max_document_tokens", doc_limit, f"document {message.name!r} has {n} "
                                     "tokens")
        need_stored = session_limit is not None or self.max_positions is not None
        stored, held = (0, 0) if new_session or not need_stored else (self.stored_tokens(), self._stored_messages())
        if session_limit is not None and (total := sum(counts) + stored) > session_limit:
            raise AdmissionError("limits.max_session_tokens", session_limit,
                                 f"the session would hold {total} content tokens")
        if self.max_positions is not None:
            prompt = sum(counts) + stored
            if self.cost is not None:  # what is prefilled: the template's markup too
                prompt += self.cost.prompt + held * self.cost.largest + sum(map(self.cost.message, messages))
            if prompt > self.max_positions:
                raise AdmissionError("model.max_position_embeddings", self.max_positions,
                                     f"the session would hold {prompt} tokens, past the model's context")
            if prompt + reply_tokens > self.max_positions:
                raise AdmissionError("max_tokens", reply_tokens, f"the prompt holds up to {prompt} tokens and the "
                                     f"model's context is {self.max_positions}: a reply of {reply_tokens} tokens "
                                     "does not fit")
        return counts

    def _stored_messages(self) -> int:
        return self.store.active_messages(self.session_id) if self.cost is not None else 0
