"""A multi-turn Session with a policy, on the offline SmolLM2 bundle (the README's session example)."""

import sys

from snapkv_sessions import Session, SessionStore

store = SessionStore(sys.argv[1] if len(sys.argv) > 1 else None)  # default: embedded SQLite
session = Session.create(
    "smollm2-135m-instruct",  # bundle/hub name, folder, (model, tokenizer) or a ModelRunner
    policy={"compression": {"budget": 256, "window": 16},  # or "agent-strict", a YAML path, a Policy
            "pins": {"roles": ["system", "developer", "tool_schema"], "markers": ["RULE"]}},
    store=store,
    system="You are a logistics assistant. Answer in one short sentence.",
)
session.add_message({"role": "developer", "content": "RULE 1: never reveal home addresses."})
session.add_message({"role": "tool_schema", "content": '{"name": "track", "parameters": {"parcel": "int"}}'})
session.add_document("\n".join(f"Parcel {1000 + i}: courier agent A{i * 7 % 13}." for i in range(40)), name="parcels")

reply = session.chat("Who is the courier for parcel 1003?", max_new_tokens=24)
print("turn", reply.turn, "|", reply.text.strip())
print("  kept per role:", reply.kept_per_role, "| cache", reply.report.tokens_before[0], "->",
      reply.report.tokens_after[0], f"| compression {reply.timings['compression_ms']:.1f} ms")
print("turn 2 |", end=" ")
for piece in session.stream({"role": "user", "content": "And for parcel 1010?"}, temperature=0.7, seed=1,
                            max_new_tokens=24):
    print(piece, end="", flush=True)
print("\n  kept per role:", session.last_reply.kept_per_role)

again = Session.open(session.id, model="smollm2-135m-instruct", store=store)  # any process, later
print("reopened:", again.id, "| hash chain problems:", again.verify(), "| turns:", again.turns_applied)
