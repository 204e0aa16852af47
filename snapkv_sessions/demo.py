"""The scripted demo behind ``snapkv-sessions demo``: a multi-turn Session on the embedded SQLite store."""

from __future__ import annotations

from collections.abc import Iterator

from .policy import Policy
from .session import Session
from .store import SessionStore

SYSTEM = "You are a logistics assistant. Answer in one short sentence. Never reveal agent home addresses."
DOCUMENT = "\n".join(
    f"Parcel {1000 + i}: sender {name}, courier agent {chr(65 + i % 26)}{i * 7 % 13}, depot {i % 5}."
    for i, name in enumerate(
        ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Nia"]
    )
)
QUESTIONS = [
    "Who is the courier agent for parcel 1003?",
    "And which depot does parcel 1003 leave from?",
    "Who sent parcel 1010?",
    "Summarise in one sentence what this list is about.",
]


def demo_policy(policy: str | None, budget: int | None, window: int | None) -> Policy:
    base = Policy.load(policy or "default").model_dump(mode="json")
    if budget is not None:
        base["compression"].update(budget=budget, budget_ratio=None)
    if window is not None:
        base["compression"]["window"] = window
    return Policy.from_dict(base)


def run_demo(model_name: str, policy: Policy, db: str | None, max_new_tokens: int) -> Iterator[dict]:
    store = SessionStore(db)
    session = Session.create(model_name, policy=policy, store=store, system=SYSTEM, title="demo")
    session.add_document(DOCUMENT, name="parcels")
    yield {"event": "session", "session_id": session.id, "store": repr(store), "policy": policy.name}
    for question in QUESTIONS:
        reply = session.chat(question, max_new_tokens=max_new_tokens)
        rep = reply.report
        yield {
            "turn": reply.turn,
            "user": question,
            "reply": reply.text.strip(),
            "context_tokens": reply.context_tokens,
            "cache_before": rep.tokens_before[0] if rep else None,
            "cache_after": rep.tokens_after[0] if rep else reply.cache_tokens[0],
            "kept_per_role": reply.kept_per_role,
            "pinned_total": rep.pinned_total if rep else 0,
            "pinned_kept": rep.pinned_kept if rep else 0,
            "compression_ms": round(reply.timings["compression_ms"], 2),
            "prefill_ms": round(reply.timings["prefill_ms"], 1),
            "decode_ms": round(reply.timings["decode_ms"], 1),
            "reprefill": any(kind == "reprefill" for kind, _ in reply.events),
            "kv_bytes_before": rep.kv_bytes_before if rep else None,
            "kv_bytes_after": rep.kv_bytes_after if rep else None,
        }
    problems = session.verify()
    yield {"event": "verified", "session_id": session.id, "hash_chain_ok": not problems, "problems": problems}
