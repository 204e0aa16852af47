"""A golden capture of what sessions do, for refactors that must not change behaviour.

``python tests/golden.py OUT.json [FULL.json]`` runs a fixed set of SmolLM2 sessions (fp32, greedy and seeded
sampling) over policies that cover pins, pyramid, span-aware, streaming, re-prefill, tiered and batched decode,
and records what they produced (OUT: a sha256 per section; FULL: everything, for a diff): replies and their
token ids, the kept positions of every layer and KV head after every turn, the turn records, the audit rows,
``replay`` and ``replay --turn`` as text and JSON, the hash-chain check, ``replay --verify``'s re-execution, and
the kept sets of the session reopened from the store. Timings, timestamps, ids and hashes over them are left
out (they differ run to run). ``tests/test_golden.py`` compares a fresh capture with ``tests/data/golden.json``,
captured before the seams refactor (issue 25).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from snapkv_sessions.models import cache_dir

DOC = ("Inventory of the north warehouse. RULE 1: crates of glass MUST stay on the ground floor. Shelf A holds "
       "copper wire, 340 rolls. Shelf B holds steel bolts, 12,500 pieces. Shelf C holds paint, 80 cans of blue "
       "and 45 of red. The loading dock opens at 6 am and closes at 9 pm. Forklift 7 is under repair until Friday.")
TURNS = ["How many rolls of copper wire are on shelf A?",
         "And what does shelf C hold?",
         "Where must the glass crates stay?",
         "Write one sentence about the moon."]
SYSTEM = "You are a warehouse assistant. Answer briefly."

POLICIES: dict[str, dict] = {
    "snapkv": {"compression": {"budget": 48, "window": 8}, "memory": {"cold": False},
               "drift": {"embedder": "none"}},
    "pins": {"compression": {"budget": 64, "window": 8, "pin_overflow": "grow"}, "memory": {"cold": False},
             "drift": {"embedder": "none"},
             "pins": {"roles": ["system", "document"], "markers": ["MUST"], "patterns": [r"RULE \d+:"]}},
    "pyramid": {"compression": {"budget": 64, "window": 8, "strategy": "pyramid", "pyramid_beta": 2},
                "memory": {"cold": False}, "drift": {"embedder": "none"}},
    "span-aware": {"compression": {"budget": 56, "window": 8, "span_aware": True, "span_unit": "line"},
                   "memory": {"cold": False}, "drift": {"embedder": "none"}},
    "streaming": {"compression": {"budget": 48, "window": 8, "method": "streaming"}, "memory": {"cold": False},
                  "drift": {"embedder": "none"}},
    "ratio-max": {"compression": {"budget_ratio": 0.5, "window": 8, "pooling": "max", "head_reduce": "max"},
                  "memory": {"cold": False}, "drift": {"embedder": "none"}},
    "reprefill": {"compression": {"budget": 64, "window": 8}, "memory": {"cold": False},
                  "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill", "follow_ups": False},
                  "recovery": {"min_turns_between": 0}},
    "tiered": {"compression": {"budget": 48, "window": 8}, "drift": {"embedder": "none"}},
    "tiered-pyramid-pins": {"compression": {"budget": 64, "window": 8, "strategy": "pyramid", "pyramid_beta": 2},
                            "pins": {"roles": ["system"], "markers": ["MUST"]}, "drift": {"embedder": "none"}},
    "tiered-keep-reply": {"compression": {"budget": 48, "window": 8}, "memory": {"refeed_reply": False},
                          "drift": {"embedder": "minilm", "threshold": 0.0, "follow_ups": False}},
}
GENERATION: dict[str, dict] = {
    "snapkv": {"max_new_tokens": 12},
    "pins": {"max_new_tokens": 10, "temperature": 0.8, "top_k": 40, "seed": 3},
    "pyramid": {"max_new_tokens": 12},
    "span-aware": {"max_new_tokens": 10, "stop": ["."]},
    "streaming": {"max_new_tokens": 10},
    "ratio-max": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9, "seed": 8},
    "reprefill": {"max_new_tokens": 8},
    "tiered": {"max_new_tokens": 12},
    "tiered-pyramid-pins": {"max_new_tokens": 10, "temperature": 0.9, "seed": 5},
    "tiered-keep-reply": {"max_new_tokens": 9},
}
BATCHED = ("snapkv", "tiered", "pins", "tiered-pyramid-pins")  # decoded together through one Scheduler

# timings, timestamps, hashes and ids; and ``chunks`` (the prefill's chunks a turn records since issue 30, which the
# capture predates: tests/test_chunks.py checks them)
DROP = re.compile(r"(_ms$|^ms$|seconds|created|updated|_at$|^ts$|hash|seal|^id$|session_id|fingerprint|^key$"
                  r"|^chunks$)")


def _clean(value, ids: dict[str, str]):
    """``value`` without timings, timestamps and hashes; session ids replaced by stable names."""
    if isinstance(value, Mapping):  # plain dicts and the store's typed records alike
        return {k: _clean(v, ids) for k, v in value.items() if not DROP.search(str(k))}
    if isinstance(value, (list, tuple)):
        return [_clean(v, ids) for v in value]
    if isinstance(value, str):
        for sid, name in ids.items():
            value = value.replace(sid, name)
        # a bundle's model id is its converted folder, under $SNAPKV_SESSIONS_CACHE when set: not behaviour
        value = value.replace(str(cache_dir()), "<cache>")
        value = re.sub(r'"(\w*_)?ms": [\d.]+', '"ms": <t>', value)
        return re.sub(r"\d+(\.\d+)? ?(ms|s)\b", "<t>", value)
    if isinstance(value, float):
        return round(value, 5)
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _kept(state) -> list:
    return [p[0].tolist() for p in state.positions]


def _one_session(runner, name: str, store) -> dict:
    from snapkv_sessions import Session

    session = Session.create(runner, policy=POLICIES[name], store=store, system=SYSTEM)
    session.add_document(DOC, name="inventory")
    turns = []
    for text in TURNS:
        reply = session.chat(text, **GENERATION[name])
        turns.append({"text": reply.text, "token_ids": reply.token_ids, "context": reply.context_tokens,
                      "cache_tokens": reply.cache_tokens, "kept_per_role": reply.kept_per_role,
                      "stop": reply.stop_reason, "events": [list(e) for e in reply.events],
                      "kept": _kept(session.state), "cold": _cold(session.state)})
    return {"id": session.id, "turns": turns}


def _cold(state) -> list | None:
    if state.cold is None:
        return None
    return [None if lay is None else lay.positions[0].tolist() for lay in state.cold.layers]


def _audit(store, sid: str, runner) -> dict:
    from click.testing import CliRunner

    from snapkv_sessions import Session, audit
    from snapkv_sessions.cli import main

    rows = store.turns(sid)
    out = {"turn_records": rows, "messages": store.messages(sid, include_abandoned=True),
           "events": store.events(sid), "audit_rows": audit.turn_rows(store, sid),
           "detail": [audit.turn_detail(store, sid, r["turn"]) for r in rows], "chain": store.verify(sid)}
    cli = CliRunner()
    url = str(store.engine.url)
    table = cli.invoke(main, ["replay", sid, "--db", url]).output.splitlines()
    # the compression, prefill and decode milliseconds are three adjacent right-aligned columns: blanked
    lo, hi = table[0].index("comp ms") - 1, table[0].index("decode ms") + len("decode ms")
    out["replay_text"] = [table[0]] + [row[:lo] + " " * (hi - lo) + row[hi:] for row in table[1:]]
    out["replay_turn_text"] = [cli.invoke(main, ["replay", sid, "--db", url, "--turn", str(r["turn"])]).output
                               for r in rows]
    out["replay_turn_json"] = [json.loads(cli.invoke(main, ["replay", sid, "--db", url, "--turn", str(r["turn"]),
                                                            "--json"]).output) for r in rows]
    verified = audit.verify(store, sid, runner)  # the recorded plans re-executed and compared
    out["verify"] = {"ok": verified.ok, "turns": verified.turns_checked, "mismatch": str(verified.mismatch)}
    reopened = Session.open(sid, runner, store=store)
    out["reopened_kept"] = _kept(reopened.state)
    out["reopened_cold"] = _cold(reopened.state)
    return out


def capture(model, tokenizer) -> dict:
    from snapkv_sessions import SessionStore
    from snapkv_sessions.runner import ModelRunner
    from snapkv_sessions.scheduler import Scheduler

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import run_in_threads

    runner = ModelRunner(model, tokenizer)
    out: dict = {"alone": {}, "batched": {}}
    ids: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = SessionStore(f"sqlite:///{tmp}/alone.db")
        for name in POLICIES:
            got = _one_session(runner, name, store)
            ids[got["id"]] = f"<{name}>"
            out["alone"][name] = {"turns": got["turns"], **_audit(store, got["id"], runner)}
        batched_runner = ModelRunner(model, tokenizer)
        scheduler = Scheduler(batched_runner, slots=4)
        batched_runner = scheduler.runner  # the sessions run on the scheduler's view of the model
        shared = SessionStore(f"sqlite:///{tmp}/together.db")
        try:
            together = run_in_threads(lambda name: _one_session(batched_runner, name, shared), BATCHED, 600)
        finally:
            scheduler.close()
        for name, got in together.items():
            ids[got["id"]] = f"<batched {name}>"
            out["batched"][name] = {"turns": got["turns"], "turn_records": shared.turns(got["id"])}
    return _clean(out, ids)


def digest(captured: dict) -> dict:
    """What ``tests/data/golden.json`` holds: every section's sha256 (the whole capture is 27 MB), beside the
    replies' text, so that a mismatch names its policy and section and shows the replies."""
    out: dict = {}
    for mode, runs in captured.items():
        for name, sections in runs.items():
            out[f"{mode}/{name}"] = {
                "replies": [t["text"] for t in sections["turns"]],
                **{key: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
                   for key, value in sorted(sections.items())}}
    return out


if __name__ == "__main__":
    from snapkv_sessions.models import load_model

    full = capture(*load_model("smollm2-135m-instruct"))
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(full, indent=1, sort_keys=True, default=str))
    Path(sys.argv[1]).write_text(json.dumps(digest(full), indent=1, sort_keys=True) + "\n")
