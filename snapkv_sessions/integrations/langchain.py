"""LangChain chat model backed by a snapkv-sessions :class:`~snapkv_sessions.Session`.

``ChatSnapKV`` keeps one Session per conversation (thread id). LangChain hands a chat model the whole message
list on every call; the list is matched against what the thread's session already stored (role, name and
content, message by message), and only the new messages reach the session: system-like ones are committed,
earlier human / AI / tool messages are committed as history, and the last human or tool message is the turn.
So a follow-up prefills only its own tokens onto the compressed cache. A list that does not extend the stored
conversation (an edited or shortened history, another conversation sent to the same thread) starts a new
session with that history instead of pretending to continue the old one.

Tools bound with :meth:`ChatSnapKV.bind_tools` are written into the prompt as a pinned ``tool_schema`` message;
tool calls are parsed from the reply (``<tool_call>{...}</tool_call>`` or a bare JSON call, see
:mod:`snapkv_sessions.integrations.openai`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun
    from langchain_core.language_models import BaseChatModel, LanguageModelInput
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        ChatMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.messages.tool import tool_call_chunk
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable, RunnableConfig
    from langchain_core.runnables.config import var_child_runnable_config
    from langchain_core.utils.function_calling import convert_to_openai_tool
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("snapkv_sessions.integrations.langchain needs langchain-core: "
                      "pip install 'snapkv-sessions[langchain]'") from exc
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, model_validator

from ..chat import Message
from ..conversations import FINISH, StreamFilter, reply_view, resolve, with_tools
from ..errors import ConfigError
from ..models import ModelSpec, model_id_of
from ..policy import ROLES, Policy
from ..session import Reply, Session
from ..store import SessionStore
from .openai import stored_text, tool_names

# Cross-provider LangChain parameters (``init_chat_model`` and the standard tests pass them) that mean nothing for
# a local model: accepted and dropped, so that every other unknown parameter can be refused.
REMOTE_PARAMS = ("api_key", "base_url", "timeout", "max_retries")
_GENERATION_KWARGS = {"max_tokens": "max_new_tokens", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
                      "top_k": "top_k", "top_p": "top_p", "seed": "seed"}
_TEXT_BLOCKS = ("text", "text-plain")
_SKIPPED_BLOCKS = ("tool_use", "tool_call", "tool_call_chunk", "thinking", "reasoning", "function_call")


@dataclass
class _Turn:
    """One call, ready to run: the session, the message that starts the turn, decoding settings, tools."""

    session: Session
    message: Message
    generation: dict
    tools: list[str] | None
    thread_id: str


def _text(msg: BaseMessage, where: str) -> str:
    """The text of a message; content a text model cannot read (images, audio, files) is refused, not dropped."""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for block in msg.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") in _TEXT_BLOCKS:
            parts.append(block.get("text", ""))
        elif block.get("type") not in _SKIPPED_BLOCKS:  # tool-use blocks repeat msg.tool_calls; reasoning is hidden
            raise ConfigError(f"{where}.content", block.get("type"), "only text content is supported by a local text model")
    return "".join(parts)


def _tool_call_dicts(msg: AIMessage) -> list[dict]:
    return [{"name": c["name"], "arguments": c["args"], "id": c.get("id")} for c in msg.tool_calls]


def to_message(msg: BaseMessage, index: int = 0) -> Message:
    """A LangChain message as a session :class:`~snapkv_sessions.chat.Message` (what the store keeps).

    ``ChatMessage(role=...)`` reaches the session roles LangChain has no class for (``document``,
    ``developer``, ``tool_schema``); a ToolMessage is stored with ``name`` = its ``tool_call_id``.
    """
    where = f"messages[{index}]"
    if isinstance(msg, SystemMessage):
        role = "developer" if msg.additional_kwargs.get("__openai_role__") == "developer" else "system"
        return Message(role=role, content=_text(msg, where), name=msg.name)
    if isinstance(msg, HumanMessage):
        return Message(role="user", content=_text(msg, where), name=msg.name)
    if isinstance(msg, AIMessage):
        return Message(role="assistant", content=stored_text(_text(msg, where), _tool_call_dicts(msg)))
    if isinstance(msg, ToolMessage):
        return Message(role="tool", content=_text(msg, where), name=msg.tool_call_id)
    if isinstance(msg, FunctionMessage):
        return Message(role="tool", content=_text(msg, where), name=msg.name)
    if isinstance(msg, ChatMessage) and msg.role in ROLES:
        return Message(role=msg.role, content=_text(msg, where), name=msg.name)
    raise ConfigError(f"{where}.type", getattr(msg, "role", msg.type), f"cannot be stored; session roles are {list(ROLES)}")


def _in_memory(url: str) -> bool:
    return url.startswith("sqlite") and url.split("?")[0] in ("sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://")


class ChatSnapKV(BaseChatModel):
    """A LangChain chat model over a local Hugging Face causal LM with a SnapKV-compressed, recoverable session.

    Parameters
    ----------
    model : bundle or hub name (``"smollm2-135m-instruct"``), a local folder, a ``(model, tokenizer)`` pair or a
        ``ModelRunner``; loaded on first use (names once per process). Never serialised.
    policy : reference policy name (``"default"``, ``"rag-qa"``, ``"agent-strict"``), YAML path, dict or Policy;
        checked when the chat model is built (a bad one raises ``PolicyError`` naming the field).
    store : SQLAlchemy URL, a file path, or a ``SessionStore``. ``None`` (default) or an in-memory SQLite URL: a
        private SQLite file in a temporary directory, removed with the store (an in-memory SQLite database is
        one database per thread, and LangChain's async calls run in worker threads).
    redis_url : optional Redis for hot state and locks (see the store).
    dtype : the weights' dtype when ``model`` is a name: ``"auto"`` (bf16 where the hardware runs it natively),
        ``"bfloat16"``, ``"float32"`` (default, None) or ``"float16"``; a thread's session is bound to it.
    thread_id : the conversation used when a call names none. A call names one with
        ``config={"configurable": {"thread_id": ...}}`` (as LangGraph does) or ``thread_id=...``.
    max_tokens : reply length cap (alias ``max_new_tokens``).
    temperature, top_k, top_p, seed : sampling (``temperature=0``: greedy).
    stop : stop strings (a call's ``stop`` replaces them).
    streaming : ``invoke`` streams internally (LangChain convention).

    ``api_key``, ``base_url``, ``timeout`` and ``max_retries`` are accepted and ignored (nothing goes over a
    network); any other unknown parameter is an error.

    Notes
    -----
    Calls on one thread are serialised (the whole call, so that two conversations never interleave in one
    session). ``usage_metadata.input_tokens`` counts the tokens prefilled by the turn: the conversation already
    in the cache is not re-read, which is the point of a session (the context size is in
    ``response_metadata["context_tokens"]``).
    """

    model: Any = Field(default="smollm2-135m-instruct", exclude=True)
    policy: Any = "default"
    store: Any = Field(default=None, exclude=True)
    redis_url: str | None = None
    dtype: str | None = None
    thread_id: str = "default"
    max_tokens: int = Field(default=128, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)

    _policy: Policy = PrivateAttr()
    _store: SessionStore | None = PrivateAttr(default=None)
    _threads: dict[str, Session] = PrivateAttr(default_factory=dict)
    _locks: dict[str, threading.Lock] = PrivateAttr(default_factory=dict)
    _guard: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _drop_remote_params(cls, values: Any) -> Any:
        if isinstance(values, dict):
            return {k: v for k, v in values.items() if k not in REMOTE_PARAMS}
        return values

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # After pydantic, so that a bad policy raises the library's PolicyError, not a wrapped ValidationError.
        if isinstance(self.model, str):
            ModelSpec.parse(self.model, self.dtype)  # a bad dtype raises ConfigError naming it, before any load
        given = Policy.load(self.policy)
        self._policy = given.stated()  # as a new session stores it
        # a thread's session may predate the tiered memory: stored under the policy as it was given then
        self._legacy_shas = given.earlier_hashes()

    # ------------------------------------------------------------------ LangChain metadata

    @property
    def _llm_type(self) -> str:
        return "snapkv-sessions"

    @property
    def model_name(self) -> str:
        """The model's name: as given, or the loaded model's ``_name_or_path``."""
        if isinstance(self.model, str):
            return self.model
        loaded = getattr(self.model, "model", None) or (self.model[0] if isinstance(self.model, tuple) else None)
        return str(getattr(getattr(loaded, "config", None), "_name_or_path", "") or type(loaded).__name__)

    @property
    def _model_id(self) -> str:
        """What the thread's sessions are stored under: the name, with the dtype when it is not float32."""
        if isinstance(self.model, str):
            return ModelSpec.parse(self.model, self.dtype).model_id
        loaded = getattr(self.model, "model", None) or self.model[0]
        return model_id_of(loaded, self.model_name)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "policy": self._policy.name, "policy_sha256": self._policy.sha256,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"ls_provider": "snapkv_sessions", "ls_model_type": "chat",
                                  "ls_model_name": kwargs.get("model") if isinstance(kwargs.get("model"), str)
                                  else self.model_name,
                                  "ls_temperature": kwargs.get("temperature", self.temperature),
                                  "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens)}
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ------------------------------------------------------------------ thread ids reach _generate as a kwarg

    @staticmethod
    def _thread_kwargs(config: RunnableConfig | None, kwargs: dict) -> dict:
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        return kwargs if thread is None or "thread_id" in kwargs else {**kwargs, "thread_id": str(thread)}

    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return super().invoke(input, config, stop=stop, **self._thread_kwargs(config, kwargs))

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                      stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **self._thread_kwargs(config, kwargs))

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        return super().stream(input, config, stop=stop, **self._thread_kwargs(config, kwargs))

    def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        return super().astream(input, config, stop=stop, **self._thread_kwargs(config, kwargs))

    # ------------------------------------------------------------------ tools

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Any], *, tool_choice: str | bool | dict | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` takes); they enter the prompt as a pinned
        ``tool_schema`` message. ``tool_choice`` ("auto", "any"/"required", "none" or a tool name) becomes an
        instruction in that message: a local model is asked to call a tool, it cannot be forced to."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    # ------------------------------------------------------------------ sessions

    def session(self, thread_id: str | None = None) -> Session | None:
        """The Session now serving ``thread_id`` (default: this model's ``thread_id``), None before its first call."""
        return self._threads.get(thread_id or self.thread_id)

    def _session_store(self) -> SessionStore:
        with self._guard:
            if self._store is None:
                self._store = self._open_store()
            return self._store

    def _open_store(self) -> SessionStore:
        if isinstance(self.store, SessionStore):
            return self.store
        if self.store is not None and not isinstance(self.store, (str, Path)):
            raise ConfigError("store", type(self.store).__name__, "must be a URL, a path or a SessionStore")
        url = str(self.store) if self.store is not None else None
        if url is None or _in_memory(url):
            folder = tempfile.mkdtemp(prefix="snapkv-langchain-")
            store = SessionStore(f"sqlite:///{folder}/sessions.db", redis_url=self.redis_url)
            weakref.finalize(store, shutil.rmtree, folder, True)
            return store
        if "://" not in url:
            url = f"sqlite:///{Path(url).expanduser().resolve()}"
        return SessionStore(url, redis_url=self.redis_url)

    def _thread_lock(self, thread_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(thread_id, threading.Lock())

    def _title(self, thread_id: str) -> str:
        return f"langchain thread {thread_id}"

    def _reopen(self, thread_id: str) -> Session | None:
        """The thread's latest session in a persistent store (same model and policy), rebuilt from the store.

        Found through the indexed ``sessions.thread_id``; sessions written before that column existed carry the
        thread in their title only, which the store reads only when the indexed lookup misses.
        """
        store = self._session_store()
        sid = store.session_for_thread(thread_id, model_id=self._model_id, policy_sha256=self._policy.sha256,
                                       legacy_title=self._title(thread_id))
        for earlier in self._legacy_shas:  # the thread's session may predate the tier or drift.follow_ups
            if sid is not None:
                break
            sid = store.session_for_thread(thread_id, model_id=self._model_id, policy_sha256=earlier,
                                           legacy_title=self._title(thread_id))
        return None if sid is None else Session.open(sid, model=self._model_id if isinstance(self.model, str)
                                                     else self.model, store=store)

    def _session_for(self, thread_id: str, wanted: list[Message], tools: list[str] | None) -> tuple[Session, list[Message]]:
        """The thread's session and the messages it has not seen; a new session when ``wanted`` does not extend it."""
        session = self._threads.get(thread_id) or self._reopen(thread_id)
        if session is not None and (found := resolve(session, wanted, tools)).outcome == "continued":
            self._threads[thread_id] = session
            return session, list(found.new)
        # the title is for people listing sessions; the thread is found again through the indexed thread_id
        session = Session.create(self._model_id if isinstance(self.model, str) else self.model,
                                 policy=self._policy, store=self._session_store(), title=self._title(thread_id),
                                 thread_id=thread_id, history=wanted[:-1])
        self._threads[thread_id] = session
        return session, wanted[-1:]

    # ------------------------------------------------------------------ one call

    def _wanted(self, messages: list[BaseMessage], tools: list[dict] | None, tool_choice: Any) -> list[Message]:
        return with_tools([to_message(m, i) for i, m in enumerate(messages)], tools, tool_choice)

    def _generation(self, stop: list[str] | None, kwargs: dict) -> dict:
        gen = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
               "top_p": self.top_p, "seed": self.seed}
        for name, value in kwargs.items():
            if name not in _GENERATION_KWARGS:
                raise ConfigError(name, value, "is not a ChatSnapKV call parameter")
            if value is not None:  # None keeps the model's own setting
                gen[_GENERATION_KWARGS[name]] = value
        gen["stop"] = list(stop if stop is not None else self.stop or [])
        return {k: v for k, v in gen.items() if v is not None}

    def _thread_of(self, kwargs: dict) -> str:
        thread = kwargs.pop("thread_id", None)
        if thread is None:  # inside a chain or graph the config travels in a context variable
            thread = ((var_child_runnable_config.get() or {}).get("configurable") or {}).get("thread_id")
        return str(thread) if thread is not None else self.thread_id

    @contextlib.contextmanager
    def _turn(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> Iterator[_Turn]:
        kwargs = dict(kwargs)
        thread_id = self._thread_of(kwargs)
        tools, tool_choice = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        if kwargs.get("model", self.model_name) != self.model_name:
            raise ConfigError("model", kwargs["model"], "a thread's session is bound to its model; build another ChatSnapKV")
        kwargs.pop("model", None)
        generation = self._generation(stop, kwargs)
        wanted = self._wanted(messages, tools, tool_choice)
        names = tool_names(tools) if tools else None
        with self._thread_lock(thread_id):
            session, new = self._session_for(thread_id, wanted, names)
            session.add_messages(new[:-1])  # one transaction: all of them or none
            yield _Turn(session, new[-1], generation, names, thread_id)

    def _reply_parts(self, turn: _Turn, reply: Reply) -> tuple[str, list[dict], UsageMetadata, dict]:
        content, calls = reply_view(reply.session_id, reply.turn, reply.text, turn.tools)
        usage = UsageMetadata(input_tokens=reply.prompt_tokens, output_tokens=reply.completion_tokens,
                              total_tokens=reply.prompt_tokens + reply.completion_tokens)
        drift = next((payload for kind, payload in reply.events if kind == "drift"), {})
        meta = {"model_name": self.model_name, "finish_reason": "tool_calls" if calls else FINISH[reply.stop_reason],
                "stop_reason": reply.stop_reason, "session_id": reply.session_id, "thread_id": turn.thread_id,
                "turn": reply.turn, "context_tokens": reply.context_tokens, "cache_tokens": max(reply.cache_tokens),
                "kept_per_role": reply.kept_per_role, "drift_score": drift.get("score"),
                "drift_decision": drift.get("decision"), "reprefill": any(k == "reprefill" for k, _ in reply.events),
                "timings_ms": {k: round(v, 2) for k, v in reply.timings.items()}}
        return content, calls, usage, meta

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        with self._turn(messages, stop, kwargs) as turn:
            reply = turn.session.chat(turn.message, **turn.generation)
            content, calls, usage, meta = self._reply_parts(turn, reply)
        message = AIMessage(content=content, usage_metadata=usage, response_metadata=meta,
                            tool_calls=[{"name": c["name"], "args": c["arguments"], "id": c["id"], "type": "tool_call"}
                                        for c in calls])
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        with self._turn(messages, stop, kwargs) as turn:
            shown = StreamFilter(bool(turn.tools))  # the session already holds back stop strings
            for piece in turn.session.stream(turn.message, **turn.generation):
                text = shown.feed(piece)
                if text:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                    if run_manager:
                        run_manager.on_llm_new_token(text, chunk=chunk)
                    yield chunk
            content, calls, usage, meta = self._reply_parts(turn, turn.session.last_reply)
        # What was shown is a prefix of the final content: the session never yields a stop string, the filter
        # never passes a call.
        rest = content[len(shown.shown):]
        chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["arguments"], ensure_ascii=False), id=c["id"],
                                  index=i) for i, c in enumerate(calls)]
        last = ChatGenerationChunk(message=AIMessageChunk(content=rest, tool_call_chunks=chunks, usage_metadata=usage,
                                                          response_metadata=meta, chunk_position="last"))
        if run_manager:
            run_manager.on_llm_new_token(rest, chunk=last)
        yield last


__all__ = ["ChatSnapKV", "reply_view", "to_message"]
