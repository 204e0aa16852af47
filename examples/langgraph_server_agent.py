"""A LangGraph agent on `snapkv-sessions serve`: `ChatOpenAI` pointed at the server, two tools, one task.

    pip install 'snapkv-sessions[serve]' langgraph langchain-openai
    python examples/langgraph_server_agent.py            # starts a server on 127.0.0.1, runs the agent, stops it
    python examples/langgraph_server_agent.py --json     # ... then a JSON summary on the last line
    python examples/langgraph_server_agent.py --base-url http://127.0.0.1:8000/v1 --api-key KEY   # a running one

The agent is LangGraph's prebuilt ReAct agent; it knows nothing of sessions. Every model call sends the whole
message list in OpenAI's format, tool calls and tool results included. The server finds the session that list
continues (by the content of its messages, scoped to the API key) and prefills only the new messages onto the
compressed cache. Runs on the offline Qwen2.5-Coder-0.5B bundle by default.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
from pathlib import Path

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from snapkv_sessions.bench.serve import start_server

ORDERS = {"A-1042": "shipped on 3 March, arriving 6 March", "A-2210": "waiting for stock"}
RATES = {"lisbon": "12.50 EUR", "lisboa": "12.50 EUR", "oslo": "19.00 EUR", "graz": "9.80 EUR"}
POLICY = {"name": "served-agent", "compression": {"budget": 384, "window": 32},
          "pins": {"roles": ["system", "tool_schema"], "sink_tokens": 4}, "drift": {"embedder": "none"}}
TASK = ("Order A-1042 is going to Lisbon. Use the tools to find the order's status and the shipping cost to "
        "Lisbon, then answer with both.")


@tool
def order_status(order_id: str) -> str:
    """The status of an order, by its id (for example A-1042)."""
    return ORDERS.get(order_id.strip().upper(), f"no order {order_id}")


@tool
def shipping_cost(city: str) -> str:
    """The cost of shipping one parcel to a city."""
    return RATES.get(city.strip().lower(), f"no rate for {city}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto", help="the started server's dtype (auto: bf16 where it is fast)")
    parser.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="also print a JSON summary as the last line")
    args = parser.parse_args()

    key = args.api_key or os.environ.get("SNAPKV_SERVE_KEY") or secrets.token_hex(16)
    folder = Path(tempfile.mkdtemp(prefix="snapkv-serve-example-"))
    proc, url = None, args.base_url
    if url is None:
        policy = folder / "policy.json"
        policy.write_text(json.dumps(POLICY))
        proc, url = start_server(args.model, folder, "--policy", str(policy), "--api-key", key, "--max-tokens", "160",
                                 "--dtype", args.dtype)
    try:
        llm = ChatOpenAI(model=args.model, base_url=url, api_key=key, temperature=0, max_tokens=160, max_retries=0)
        agent = create_react_agent(llm, [order_status, shipping_cost])
        system = ("You are an order assistant. Call each tool you need once. When the tool results are in the "
                  "conversation, answer the user in one sentence and call no more tools.")
        result = agent.invoke({"messages": [("system", system),
                                            ("user", TASK)]}, {"recursion_limit": 8})
        messages = result["messages"]
        calls = [c for m in messages for c in getattr(m, "tool_calls", None) or []]
        tool_results = [m.content for m in messages if m.type == "tool"]
        answer = messages[-1].content
        for m in messages:
            shown = m.content if isinstance(m.content, str) else json.dumps(m.content)
            calls_made = getattr(m, "tool_calls", None)
            extra = f" tool calls: {[(c['name'], c['args']) for c in calls_made]}" if calls_made else ""
            print(f"[{m.type}] {shown.strip()[:200]}{extra}")
        headers = {"Authorization": f"Bearer {key}"}
        listed = httpx.get(f"{url}/sessions", headers=headers, timeout=60).json()["data"]
        turns = [httpx.get(f"{url}/sessions/{s['id']}", headers=headers, timeout=60).json()["turns"] for s in listed]
        print(f"sessions on the server for this key: {len(listed)}; turns: {[len(t) for t in turns]}; "
              f"tokens prefilled per turn: {[[t['tokens_in'] for t in ts] for ts in turns]}")
        if args.json:
            print(json.dumps({"tool_calls": [{"name": c["name"], "args": c["args"]} for c in calls],
                              "tool_results": tool_results, "answer": answer, "sessions": len(listed),
                              "turns": [[{"turn": t["turn"], "status": t["status"], "tokens_in": t["tokens_in"]}
                                         for t in ts] for ts in turns]}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
