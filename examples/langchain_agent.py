"""A LangChain tool-calling loop on a SnapKV session: ChatSnapKV, a bound tool, a tool result, one thread.

    pip install 'snapkv-sessions[langchain]'
    python examples/langchain_agent.py            # readable report
    python examples/langchain_agent.py --json     # ... then a JSON summary on the last line

Runs on the offline SmolLM2 bundle. The tool's schema enters the prompt as a pinned ``tool_schema`` message; a
depot list enters as a document and is what compression evicts. Every call passes the whole message list, as
LangChain does; the thread's session stores it once and prefills only what is new.

SmolLM2-135M rarely writes a tool call (it tends to describe the call in prose). The loop is the usual one: if
the model calls the tool, the tool runs on the model's arguments; if it does not, the application runs the lookup
the user asked for and hands the result back as a tool message. The output says which of the two happened.
"""

from __future__ import annotations

import argparse
import json

from langchain_core.messages import ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from snapkv_sessions.integrations.langchain import ChatSnapKV

PARCELS = {1001: "in transit to Oslo", 1002: "delivered in Lyon", 1003: "held at customs in Porto",
           1004: "out for delivery in Graz"}
DEPOTS = "\n".join(f"Parcel {1000 + i} leaves from depot {'NSEW'[i % 4]}{i % 7}, dock {(i * 5) % 11}."
                   for i in range(1, 13))
POLICY = {"name": "langchain-agent", "compression": {"budget": 256, "window": 16},
          "pins": {"roles": ["system", "tool_schema"], "sink_tokens": 4}, "drift": {"embedder": "none"}}


@tool
def track_parcel(parcel: int) -> str:
    """Where a parcel is now, by its number."""
    return PARCELS.get(parcel, f"no parcel {parcel}")


def report(step: str, msg) -> dict:
    meta, usage = msg.response_metadata, msg.usage_metadata
    roles = ", ".join(f"{role} {share:.0%}" for role, share in meta["kept_per_role"].items()) or "nothing evicted"
    print(f"[{step}] turn {meta['turn']} of session {meta['session_id'][:8]} (thread {meta['thread_id']}): "
          f"prefilled {usage['input_tokens']} new tokens, context {meta['context_tokens']}, "
          f"cache {meta['cache_tokens']} per layer/head")
    print(f"  kept per role: {roles}")
    calls = f" | tool calls: {msg.tool_calls}" if msg.tool_calls else ""
    print(f"  assistant: {msg.content.strip() or '(no text)'}{calls}")
    return {"step": step, "turn": meta["turn"], "session_id": meta["session_id"], "content": msg.content,
            "tool_calls": msg.tool_calls, "usage": dict(usage), "kept_per_role": meta["kept_per_role"],
            "context_tokens": meta["context_tokens"], "cache_tokens": meta["cache_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--db", default=None, help="store URL or path (default: a private temporary SQLite file)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="also print a JSON summary as the last line")
    args = parser.parse_args()

    chat = ChatSnapKV(model=args.model, policy=POLICY, store=args.db, max_tokens=args.max_new_tokens)
    agent = chat.bind_tools([track_parcel])
    config = {"configurable": {"thread_id": "customer-42"}}  # one session per thread, as LangGraph passes it
    messages = [SystemMessage("You are a parcel-tracking assistant. Be brief."),
                ChatMessage(role="document", content=DEPOTS, name="depots"),
                HumanMessage("Where is parcel 1003 now? Use the track_parcel tool.")]
    steps = [report("ask", first := agent.invoke(messages, config=config))]
    messages.append(first)
    if first.tool_calls:  # the model asked for the tool: run it on the model's own arguments
        path = "model called the tool"
        messages += [track_parcel.invoke(call) for call in first.tool_calls]
    else:  # the model answered in prose: the application runs the lookup the user asked for
        path = "model answered without a tool call; the application ran track_parcel(1003) as the user asked"
        messages.append(ToolMessage(track_parcel.invoke({"parcel": 1003}), tool_call_id="user-request-1",
                                    name="track_parcel"))
    tool_result = messages[-1].content
    print(f"  -> {path}; tool result: {tool_result!r}")
    steps.append(report("tool result", answer := agent.invoke(messages, config=config)))
    messages += [answer, HumanMessage("Which depot does parcel 1003 leave from?")]
    steps.append(report("follow-up", agent.invoke(messages, config=config)))

    session = chat.session("customer-42")
    stored = [{"role": m.role, "name": m.name, "pinned": m.pinned} for m in session.messages()]
    print("stored in the session's hash chain: " + ", ".join(m["role"] for m in stored)
          + f" | hash chain problems: {session.verify()}")
    if args.json:
        print(json.dumps({"path": path, "model_called_tool": bool(first.tool_calls), "steps": steps,
                          "stored": stored, "tool_result": tool_result,
                          "session_id": session.id, "hash_chain_problems": session.verify()}))


if __name__ == "__main__":
    main()
