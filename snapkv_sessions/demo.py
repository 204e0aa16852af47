"""The scripted demo behind ``snapkv-sessions demo``: a multi-turn Session on the embedded SQLite store.

A short delivery list, four questions: a lookup, a follow-up on the same record (the cache is kept), a lookup of
another record (a new subject, which drift sees) and a summary of the whole list; the tiered memory serves both
from what compression evicted, without a re-prefill.
Every turn compresses the cache to the budget. Each question's expected fact is part of the script, so a wrong
answer shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .models import ModelSpec
from .policy import Policy
from .session import Session
from .store import SessionStore

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"

SYSTEM = "You are a logistics assistant. Answer in one short sentence. Never reveal agent home addresses."
RECORDS = [  # (customer, courier, depot)
    ("Maria", "Tom", "Oslo"), ("Omar", "Ali", "Lyon"), ("Lena", "Eva", "Porto"), ("Tariq", "Sam", "Graz"),
    ("Sofia", "Ben", "Turin"), ("Hugo", "Zoe", "Ghent"), ("Amara", "Max", "Malmo"), ("Felix", "Ada", "Leeds"),
    ("Noor", "Kim", "Split"), ("Ivan", "Joe", "Cork"), ("Clara", "Ray", "Bern"), ("Kenji", "Liv", "Riga"),
]
DOCUMENT = "\n".join(f"{who}'s parcel is delivered by courier {courier} from the {depot} depot."
                     for who, courier, depot in RECORDS)


@dataclass(frozen=True)
class Question:
    text: str
    expected: str  # the fact a correct answer contains
    note: str  # what the turn shows


QUESTIONS = [
    Question("Who delivers Maria's parcel?", "Tom", "a lookup"),
    Question("And which depot does Maria's parcel leave from?", "Oslo", "a follow-up: the compressed cache is kept"),
    Question("Who delivers Tariq's parcel?", "Sam", "another record, likely evicted: the tier brings it back"),
    Question("Summarise in one sentence what this whole list is about.", "parcel",
             "a summary of the whole list: the tier serves it"),
]


def demo_policy(policy: str | None, budget: int | None, window: int | None) -> Policy:
    base = Policy.load(policy or "default").model_dump(mode="json")
    if budget is not None:
        base["compression"].update(budget=budget, budget_ratio=None)
    if window is not None:
        base["compression"]["window"] = window
    return Policy.from_dict(base)


def run_demo(model_name: str, policy: Policy, db: str | None, max_new_tokens: int,
             stream: bool = False, dtype: str | None = None) -> Iterator[dict]:
    """Yield the session, then per turn its question (before any compute), the reply's text pieces as they are
    decoded (``stream=True``) and the turn's figures, then the hash-chain check. ``dtype``: as
    :class:`~snapkv_sessions.session.SessionOptions`' (None: float32)."""
    store = SessionStore(db)
    session = Session.create(model_name, policy=policy, store=store, system=SYSTEM, title="demo", dtype=dtype)
    session.add_document(DOCUMENT, name="parcels")
    yield {"event": "session", "session_id": session.id, "store": repr(store), "policy": policy.name,
           "model": model_name, "dtype": ModelSpec.parse(session.model_id).dtype}
    for number, question in enumerate(QUESTIONS, start=1):
        yield {"event": "question", "turn": number, "user": question.text, "note": question.note}
        for piece in session.stream(question.text, max_new_tokens=max_new_tokens):
            if stream:
                yield {"event": "piece", "turn": number, "text": piece}
        reply = session.last_reply
        rep = reply.report
        text = reply.text.strip()
        yield {
            "turn": reply.turn,
            "user": question.text,
            "reply": text,
            "expected": question.expected,
            "correct": question.expected.lower() in text.lower(),
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
            # "tiered": drift saw a shift and the tiered memory served it (no re-prefill)
            "decision": session.store.turns(session.id)[-1]["drift_decision"],
            "cold_bytes": rep.tier["cold_bytes"] if rep and rep.tier else None,
            "kv_bytes_before": rep.kv_bytes_before if rep else None,
            "kv_bytes_after": rep.kv_bytes_after if rep else None,
        }
    problems = session.verify()
    yield {"event": "verified", "session_id": session.id, "hash_chain_ok": not problems, "problems": problems}
