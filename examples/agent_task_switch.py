"""A session that changes task: the drift score, the exact re-prefill from the store, and the audit.

    python examples/agent_task_switch.py            # readable report
    python examples/agent_task_switch.py --json     # ... then a JSON summary on the last line

Runs on the offline SmolLM2 bundle. The cache is compressed hard (128 tokens per layer and KV head), so a turn
about another staff member, or another task, finds its evidence evicted. Before each turn the session scores the
new question against the questions that shaped the cache (MiniLM embedding drift, key terms no longer held, a
subject never named); above the policy's threshold it rebuilds the prompt from the store and prefills it again.
The audit afterwards reads the same facts back from the store and re-executes the session to verify it.

New sessions keep what compression evicts in the tiered memory, which serves such shifts without a re-prefill
(docs/tiered-memory.md); this example asks for re-prefills on shifts (``memory.on_shift: reprefill``) to show them.
"""

from __future__ import annotations

import argparse
import json

from snapkv_sessions import Session, SessionStore, audit

POLICY = {
    "name": "agent-task-switch",
    "compression": {"budget": 128, "window": 16, "kernel": 7},
    "pins": {"roles": ["system"], "sink_tokens": 4},
    "drift": {"embedder": "minilm", "threshold": 0.6, "new_subject": True, "action": "reprefill"},
    "recovery": {"max_reprefills": 5, "min_turns_between": 1},
    "memory": {"on_shift": "reprefill"},
}
SYSTEM = "You are an office assistant. Answer in one short sentence using the staff list."
STAFF = [("Ada Moreau", "Finance", 214), ("Ben Okafor", "Legal", 118), ("Chen Weber", "Sales", 305),
         ("Dana Ruiz", "IT", 122), ("Eli Novak", "Finance", 219), ("Farah Khan", "Sales", 310),
         ("Goran Lind", "IT", 125), ("Hana Sato", "Legal", 121), ("Ivo Petrov", "Sales", 312),
         ("Jun Park", "Finance", 221), ("Kira Holm", "IT", 128), ("Leo Varga", "Legal", 119)]
QUESTIONS = [
    "Which office is Chen Weber in?",                           # a lookup: the cache is shaped around Chen Weber
    "And which department does Chen Weber work in?",            # a follow-up: same subject, low drift
    "Which office is Kira Holm in?",                            # another record: its evidence was evicted
    "Draft a one-sentence welcome note for new staff members.",  # another task altogether
]


def staff_list() -> str:
    return "\n".join(f"{name}: department {dept}, office {room}, extension {4000 + room}." for name, dept, room in STAFF)


def show_turn(reply) -> dict:
    """Print what the session decided before the turn and what it answered; return it as a row."""
    drift = next((payload for kind, payload in reply.events if kind == "drift"), {})
    redo = next((payload for kind, payload in reply.events if kind == "reprefill"), None)
    row = {"turn": reply.turn, "reply": reply.text.strip(), "drift_score": drift.get("score"),
           "embedding_drift": drift.get("embedding_drift"), "decision": drift.get("decision", "n/a"),
           "missing_terms": drift.get("missing_terms", []), "new_terms": drift.get("new_terms", []),
           "reprefill_tokens": redo and redo["tokens_reprefilled"], "prompt_tokens": reply.prompt_tokens,
           "cache_tokens": max(reply.cache_tokens)}
    line = "  drift -" if row["drift_score"] is None else f"  drift {row['drift_score']:.3f}"
    if row["embedding_drift"] is not None:
        line += f" (embedding {row['embedding_drift']:.3f})"
    line += f" -> {row['decision']}"
    if row["missing_terms"]:
        line += f", evicted: {row['missing_terms']}"
    if row["new_terms"]:
        line += f", new subject: {row['new_terms']}"
    if redo:
        line += f"; re-prefilled {redo['tokens_reprefilled']} tokens from the store in {redo['ms']:.0f} ms"
    else:
        line += f"; prefilled {reply.prompt_tokens} new tokens onto the compressed cache"
    print(line)
    print(f"  assistant: {row['reply']}")
    return row


def audit_table(store: SessionStore, session_id: str) -> list[dict]:
    """The per-turn audit rows (``snapkv_sessions.audit.turn_rows``), printed as a compact table."""
    rows = audit.turn_rows(store, session_id)
    print(f"{'turn':>4} {'context':>7} {'kept':>5} {'system':>6} {'document':>8} {'user':>5} {'drift':>6}  decision")
    for r in rows:
        roles = r["kept_per_role"]
        drift = "-" if r["drift_score"] is None else f"{r['drift_score']:.3f}"
        print(f"{r['turn']:>4} {r['context_tokens']:>7} {r['kept_max']:>5} {roles.get('system', 0):>6.0%} "
              f"{roles.get('document', 0):>8.0%} {roles.get('user', 0):>5.0%} {drift:>6}  {r['drift_decision']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--db", default="sqlite://", help="SQLAlchemy URL of the store (default: in memory)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--skip-verify", action="store_true", help="skip the re-execution (it reruns every turn)")
    parser.add_argument("--json", action="store_true", help="also print a JSON summary as the last line")
    args = parser.parse_args()

    store = SessionStore(args.db)
    session = Session.create(args.model, policy=POLICY, store=store, system=SYSTEM, title="task switch example")
    session.add_document(staff_list(), name="staff")
    print(f"session {session.id}: budget {POLICY['compression']['budget']} tokens per layer and head, "
          f"drift threshold {POLICY['drift']['threshold']}")
    turns = []
    for question in QUESTIONS:
        print(f"\nuser: {question}")
        turns.append(show_turn(session.chat(question, max_new_tokens=args.max_new_tokens)))

    print("\naudit (snapkv_sessions.audit.turn_rows; the CLI prints the same as `snapkv-sessions replay ID --db URL`):")
    rows = audit_table(store, session.id)
    redone = [r["turn"] for r in rows if r["drift_decision"] == "reprefill"]
    detail = audit.turn_detail(store, session.id, redone[0]) if redone else None
    if detail is not None:
        print(f"\nwhy turn {redone[0]} re-prefilled (`replay ID --turn {redone[0]}`):")
        for event in detail["events"]:
            if event["kind"] in ("drift", "reprefill"):
                print(f"  {event['kind']}: {json.dumps(event['payload'], sort_keys=True)}")
    verified = None
    if not args.skip_verify:
        result = audit.verify(store, session.id, args.model)
        verified = {"ok": result.ok, "turns_checked": result.turns_checked,
                    "mismatch": None if result.mismatch is None else str(result.mismatch)}
        print("\n`replay ID --verify`: " + (f"hash chain intact, {result.turns_checked} turns re-executed identically"
                                              if result.ok else f"MISMATCH {result.mismatch}"))
    if args.json:
        print(json.dumps({"session_id": session.id, "threshold": POLICY["drift"]["threshold"], "turns": turns,
                          "audit": [{k: r[k] for k in ("turn", "context_tokens", "kept_max", "kept_per_role",
                                                       "drift_score", "drift_decision")} for r in rows],
                          "reprefill_turns": redone,
                          "reprefill_event": next((e["payload"] for e in detail["events"] if e["kind"] == "reprefill"),
                                                  None) if detail else None,
                          "verify": verified}))


if __name__ == "__main__":
    main()
