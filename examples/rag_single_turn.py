"""One long document, one question, an aggressive policy: what SnapKV keeps for a single retrieval turn.

    python examples/rag_single_turn.py            # readable report
    python examples/rag_single_turn.py --json     # ... then a JSON summary on the last line

Runs on the offline SmolLM2 bundle with an in-memory store. The policy is ``policies/rag-qa.yaml``: 20% of the
context per layer (PyramidKV: more in low layers, less in high ones), the system prompt pinned, the question kept
through its own turn. The document is what gets compressed.
"""

from __future__ import annotations

import argparse
import json

from snapkv_sessions import Session, SessionStore

SYSTEM = "You answer questions about the warehouse log. Answer with the bin code only."
CITIES = ["Oslo", "Lyon", "Porto", "Graz", "Turku", "Ghent", "Brno", "Cork"]


def warehouse_log(records: int) -> str:
    """A synthetic log: every line names an item, its city and a bin code (a lookup has one right answer)."""
    return "\n".join(f"Item {4000 + i}: stored in {CITIES[i % len(CITIES)]}, bin {chr(65 + i % 26)}-{(i * 37) % 97:02d}."
                     for i in range(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--policy", default="rag-qa", help="policy name or YAML path")
    parser.add_argument("--records", type=int, default=40, help="lines in the document (about 17 tokens each)")
    parser.add_argument("--item", type=int, default=4017, help="the item to ask about")
    parser.add_argument("--db", default="sqlite://", help="SQLAlchemy URL of the store (default: in memory)")
    parser.add_argument("--json", action="store_true", help="also print a JSON summary as the last line")
    args = parser.parse_args()

    document = warehouse_log(args.records)
    i = args.item - 4000
    expected = f"{chr(65 + i % 26)}-{(i * 37) % 97:02d}"
    store = SessionStore(args.db)
    session = Session.create(args.model, policy=args.policy, store=store, system=SYSTEM, title="rag example")
    session.add_document(document, name="warehouse log")
    reply = session.chat(f"Which bin holds item {args.item}?", max_new_tokens=12)

    report = reply.report
    if report is None:
        raise SystemExit(f"the prompt ({reply.context_tokens} tokens) is below min_prompt_tokens: nothing was "
                         "compressed; use more --records")
    # pin_overflow "grow" (rag-qa) lets a layer whose budget is smaller than its pins plus the window hold exactly
    # that much: every pin survives and nothing else is added
    floor = report.pinned_total + report.window
    within = all(after <= max(budget, floor) for after, budget in zip(report.tokens_after, report.budgets, strict=True))
    grown = [layer for layer, (after, budget) in enumerate(zip(report.tokens_after, report.budgets, strict=True))
             if after > budget]
    print(f"policy {session.policy.name}: budget {session.policy.compression.budget_ratio:.0%} of the context, "
          f"window {report.window}, strategy {session.policy.compression.strategy}")
    print(f"question: which bin holds item {args.item}?  (the log says {expected})")
    print(f"answer: {reply.text.strip()}  | contains the logged bin: {'yes' if expected in reply.text else 'no'}")
    print(f"context {report.context_tokens} tokens -> kept per layer {min(report.tokens_after)}..{max(report.tokens_after)} "
          f"(budgets {min(report.budgets)}..{max(report.budgets)}, within budget: {'yes' if within else 'NO'})")
    if grown:
        print(f"  layers {grown} grew to {floor} = {report.pinned_total} pinned + {report.window} window tokens "
              "(their budget is smaller; pin_overflow: grow)")
    print("kept per role: " + ", ".join(f"{role} {share:.0%}" for role, share in reply.kept_per_role.items()))
    print(f"KV bytes {report.kv_bytes_before:,} -> {report.kv_bytes_after:,}; compression {report.total_ms:.1f} ms, "
          f"prefill {reply.timings['prefill_ms']:.0f} ms, decode {reply.timings['decode_ms']:.0f} ms")
    print(f"pinned positions kept: {report.pinned_kept}/{report.pinned_total}")
    if args.db in ("sqlite://", "sqlite:///:memory:"):
        print(f"session {session.id} lived in memory; keep it with --db sqlite:///rag.db, then audit it with "
              "snapkv-sessions replay ID --db sqlite:///rag.db")
    else:
        print(f"audit it with: snapkv-sessions replay {session.id} --db {args.db}")
    if args.json:
        print(json.dumps({
            "session_id": session.id, "policy": session.policy.name, "context_tokens": report.context_tokens,
            "window": report.window, "budgets": report.budgets, "tokens_after": report.tokens_after,
            "within_budget": within, "grown_layers": grown, "kept_per_role": reply.kept_per_role,
            "pinned_total": report.pinned_total, "pinned_kept": report.pinned_kept,
            "kv_bytes_before": report.kv_bytes_before, "kv_bytes_after": report.kv_bytes_after,
            "answer": reply.text.strip(), "expected": expected, "answer_has_expected": expected in reply.text,
            "compression_ms": round(report.total_ms, 2)}))


if __name__ == "__main__":
    main()
