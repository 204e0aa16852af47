"""OpenAI-style tools and tool calls for a local model: the prompt that lists the tools, and the parser that finds
the calls in what the model wrote.

A local model has no function-calling API: the tools are written into the prompt (a pinned ``tool_schema``
message) and the model answers a call in text. Qwen and Hermes-tuned models write
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; smaller ones often write the bare JSON object. Both
are recognised; anything else stays plain text, so a reply is never silently turned into a call it was not.

This module imports neither torch nor any agent framework.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from ..chat import Message, format_tool_calls
from ..errors import ConfigError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.S)


def tool_function(tool: dict) -> dict:
    """The ``{"name", "description", "parameters"}`` part of an OpenAI tool (``{"type": "function", ...}``)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ConfigError("tools", tool, "each tool must be an OpenAI tool dict with a function name")
    return {k: fn[k] for k in ("name", "description", "parameters") if k in fn}


def tool_names(tools: Iterable[dict]) -> list[str]:
    return [tool_function(t)["name"] for t in tools]


def _choice_line(tool_choice: str | bool | dict | None) -> str:
    """The instruction that stands for ``tool_choice``: a local model is asked, not forced."""
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if tool_choice in (None, "auto", False):
        return "Call a tool only when it is needed to answer; otherwise answer directly."
    if tool_choice in ("any", "required", True):
        return "You must answer with a tool call."
    if tool_choice == "none":
        return "Do not call a tool; answer directly."
    if isinstance(tool_choice, str):
        return f"You must answer with a call to the tool {tool_choice!r}."
    raise ConfigError("tool_choice", tool_choice, "must be None, 'auto', 'any', 'required', 'none' or a tool name")


def tool_schema_message(tools: list[dict], tool_choice: str | bool | dict | None = None) -> Message:
    """The ``tool_schema`` message listing ``tools`` (OpenAI format) and how to call one.

    It is pinned whatever the policy's pinned roles: a tool list half evicted would have the model call tools
    with made-up parameters. The text is deterministic for the same tools, so a conversation that binds the same
    tools again matches what its session already holds.
    """
    if not tools:
        raise ConfigError("tools", tools, "bind at least one tool")
    functions = [tool_function(t) for t in tools]
    text = (json.dumps(functions, ensure_ascii=False) + "\n\nTo call a tool, reply with only:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": <tool name>, "arguments": <JSON object>}}\n{TOOL_CALL_CLOSE}\n'
            + _choice_line(tool_choice))
    return Message(role="tool_schema", content=text, pinned=True)


def _as_call(obj: object, names: set[str] | None) -> dict | None:
    """``{"name", "arguments"}`` from a decoded JSON object, or None when it is not a call to a known tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ("arguments", "parameters", "args") if k in obj), None)
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if args is None and set(obj) == {"name"}:
        args = {}  # a call without arguments
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return {"name": obj["name"], "arguments": args}


def _loads_whole(text: str) -> object:
    """The JSON value that is all of ``text`` (surrounding whitespace aside), or None."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return value if not text[end:].strip() else None


def _loads_sequence(text: str) -> list | None:
    """The JSON values that are all of ``text``, written one after another and separated by whitespace or commas
    (``{...}, {...}``, as small models list several calls), or None."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (values and text[at] == ",")):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse_tool_calls(text: str, names: Iterable[str] | None = None) -> tuple[str, list[dict]]:
    """Split a reply into its text and its tool calls.

    Parameters
    ----------
    text : the reply as the model wrote it (stop strings already cut)
    names : the tools that may be called; a call to any other name stays text (None: any name)

    Returns
    -------
    (content, calls) : ``content`` is ``text`` without the recognised ``<tool_call>`` blocks (empty when only
        whitespace is left, or when the whole reply was one bare JSON call); ``calls`` are
        ``{"name", "arguments"}`` dicts in the order written. Unparsable blocks stay in ``content``. Without
        blocks, a reply that is only calls (one JSON object, a list of them, or several written one after another)
        is read as those calls.
    """
    allowed = set(names) if names is not None else None
    if TOOL_CALL_OPEN in text:
        calls, kept, last = [], [], 0
        for match in _BLOCK.finditer(text):
            call = _as_call(_loads_whole(match.group(1)), allowed)
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:match.start()])
            last = match.end()
        kept.append(text[last:])
        content = "".join(kept)
        return ("" if not content.strip() else content), calls
    body = text.strip()
    fenced = _FENCE.match(body)
    values = _loads_sequence(fenced.group(1) if fenced else body)
    if values is None:
        return text, []
    items = values[0] if len(values) == 1 and isinstance(values[0], list) and values[0] else values
    calls = [_as_call(item, allowed) for item in items]
    if all(c is not None for c in calls):
        return "", calls
    return text, []


def could_be_tool_call(text: str) -> bool:
    """True while a streamed reply may still turn out to be a bare JSON call (so none of it is shown yet)."""
    head = text.lstrip()
    return not head or head.startswith(("{", "[", "```")) or "```".startswith(head)


def openai_message(text: str, names: Iterable[str] | None = None, id_prefix: str = "call") -> dict:
    """An OpenAI Chat Completions assistant message from a reply's text, tool calls parsed out.

    The calls get the ids ``{id_prefix}_0``, ``{id_prefix}_1``, ...; the result can be appended to an OpenAI-style
    message list and given back to :meth:`Session.chat` / ``Session.create(history=...)`` with the tool results.
    """
    content, calls = parse_tool_calls(text, names)
    msg: dict = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = [{"id": f"{id_prefix}_{i}", "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                             for i, c in enumerate(calls)]
    return msg


def stored_text(content: str, calls: list[dict]) -> str:
    """How an assistant message with ``calls`` (``{"name", "arguments", "id"}``) is stored (see ``Message.coerce``)."""
    if not calls:
        return content
    blocks = format_tool_calls(calls)
    return f"{content}\n{blocks}" if content else blocks


__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "could_be_tool_call", "openai_message", "parse_tool_calls",
           "stored_text", "tool_function", "tool_names", "tool_schema_message"]
