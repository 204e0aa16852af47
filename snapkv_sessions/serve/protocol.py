"""The OpenAI Chat Completions wire format: requests checked into session messages, responses and stream chunks.

Only what a local text model can honour is accepted. Content parts other than text, ``n`` other than 1 and
parameters this server cannot apply are refused with an error naming the field, never silently dropped.
Parameters that change nothing here (``user``, ``store``, ``parallel_tool_calls``, zero penalties) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import Message
from ..errors import ConfigError
from ..store.schema import MAX_SEED

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # one stop string
MAX_TOOLS = 128  # as OpenAI
MAX_METADATA = 16  # pairs, as OpenAI (keys up to 64 characters, values up to 512)
MAX_JSON_DEPTH = 64  # arrays and objects nested in a body (or in a tool call's arguments): deeper is refused
SEED_RANGE = (0, MAX_SEED)  # what the turns table's seed column holds on every backend
# Accepted and ignored: they change nothing for one local model (values checked in `_check_extras`).
HARMLESS = {"user", "store", "parallel_tool_calls", "logprobs", "presence_penalty", "frequency_penalty",
            "service_tier", "prompt_cache_key", "safety_identifier"}


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant message echoed back by the SDK carries it (None)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: the fields this server reads. Unknown fields are checked in :func:`parse`."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    n: int = 1
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=MAX_METADATA)


class TooDeep(ConfigError):
    """JSON nested past :data:`MAX_JSON_DEPTH`."""


def loads(raw: str | bytes, param: str = "body", max_depth: int = MAX_JSON_DEPTH) -> object:
    """JSON text parsed with its nesting bounded: :class:`TooDeep` naming ``param`` past ``max_depth`` (the parser
    itself would recurse until a ``RecursionError``); ``json.JSONDecodeError`` / ``UnicodeDecodeError`` as
    ``json.loads`` raises them."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TooDeep(param, "<nested JSON>", f"is nested more than {max_depth} levels deep") from None
    check_depth(value, param, max_depth)
    return value


def check_depth(value: object, param: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse ``value`` when its arrays and objects nest past ``max_depth``; iterative, so no input can make it
    recurse."""
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise TooDeep(param, "<nested JSON>", f"is nested more than {max_depth} levels deep")
        todo.extend((child, depth + 1) for child in children)


def parse(body: object, max_messages: int | None = None) -> ChatCompletionRequest:
    """The request, checked; a :class:`ConfigError` names the first bad field (``messages[2].content``).

    ``max_messages``: the most messages one request may carry, checked before any message is validated, so
    that a body of many thousands of messages is refused at once.
    """
    check_depth(body, "body")
    if max_messages is not None and isinstance(body, dict) and isinstance(body.get("messages"), list) \
            and len(body["messages"]) > max_messages:
        raise ConfigError("messages", f"<{len(body['messages'])} messages>",
                          f"a request carries at most {max_messages} messages")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in err["loc"]).replace(".[", "[")
        raise ConfigError(where or "body", err.get("input"), err["msg"]) from None
    if req.n != 1:
        raise ConfigError("n", req.n, "only n=1 is supported (one session continues one conversation)")
    _check_extras(req.model_extra or {})
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ConfigError("stop", req.stop, f"at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                          "characters")
    return req


def _check_extras(extra: dict) -> None:
    for name, value in extra.items():
        if name not in HARMLESS:
            raise ConfigError(name, value, "is not supported by this server")
        if name.endswith("_penalty") and value not in (None, 0, 0.0):
            raise ConfigError(name, value, "penalties are not supported (use 0 or leave it out)")
        if name == "logprobs" and value:
            raise ConfigError(name, value, "log probabilities are not returned")


def to_messages(req: ChatCompletionRequest) -> list[Message]:
    """The request's messages as session messages; a tool result is stored with ``name`` = its ``tool_call_id``."""
    out = []
    for i, msg in enumerate(req.messages):
        text = _text(msg.content, f"messages[{i}].content")
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise ConfigError(f"messages[{i}].tool_call_id", msg.tool_call_id, "a tool message needs one")
            out.append(Message.coerce({"role": "tool", "content": text, "name": msg.tool_call_id}))
            continue
        if msg.tool_calls and msg.role != "assistant":
            raise ConfigError(f"messages[{i}].tool_calls", msg.role, "only assistant messages carry tool calls")
        raw: dict = {"role": msg.role, "content": text, "name": None if msg.role == "assistant" else msg.name}
        if msg.tool_calls:
            raw["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": _arguments(c, i)}
                                 for c in msg.tool_calls]
            raw["content"] = text or None
        out.append(Message.coerce(raw))
    return out


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ConfigError(f"{where}[{j}].type", part.type, "only text content is supported by a local text model")
        parts.append(part.text)
    return "".join(parts)


def _arguments(call: ToolCall, i: int) -> dict:
    try:
        args = loads(call.function.arguments or "{}", f"messages[{i}].tool_calls.function.arguments")
    except json.JSONDecodeError:
        raise ConfigError(f"messages[{i}].tool_calls.function.arguments", call.function.arguments,
                          "must be a JSON object") from None
    if not isinstance(args, dict):
        raise ConfigError(f"messages[{i}].tool_calls.function.arguments", call.function.arguments,
                          "must be a JSON object")
    return args


# ---------------------------------------------------------------------- responses


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI ``tool_calls`` from the reply view's ``{"name", "arguments", "id"}`` dicts."""
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(cid: str, model: str, content: str, calls: list[dict], finish: str, use: dict, extra: dict) -> dict:
    message: dict = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = tool_calls(calls)
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": use, **extra}


def chunk(cid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None,
          choices: bool = True) -> dict:
    """One stream chunk; ``choices=False`` is the usage-only chunk of ``stream_options.include_usage``."""
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
    if use is not None:
        out["usage"] = use
    return out


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
