"""The audit: replay tables (exact output), turn details, --verify, --against full, --plot."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from sqlalchemy import update

from snapkv_sessions import Session, SessionStore, audit
from snapkv_sessions import models as models_mod
from snapkv_sessions.cli import main
from snapkv_sessions.store import schema
from snapkv_sessions.store.blobs import pack_positions, unpack_positions

DOC = " ".join(f"Parcel {1000 + i} goes to {name}." for i, name in enumerate(
    ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]))
POLICY = {"compression": {"budget": 64, "window": 8}, "drift": {"threshold": 0.6}, "memory": {"on_shift": "reprefill"}}


def synthetic_session(store: SessionStore) -> str:
    """A session written straight into the store, so that every figure in the output is fixed."""
    sid = store.create_session("tiny-model", '{"name":"t"}', "f" * 64, title="synthetic")
    store.add_message(sid, "system", "Be brief.")
    store.add_message(sid, "document", "Parcel 1 goes to Ada.", name="doc")
    rows = [  # turn, question, reply, owners, kept (2 layers x 2 heads), drift, decision
        (1, "Who gets parcel 1?", "Ada.", [[1, 0, 4], [2, 4, 12], [3, 12, 16]],
         [np.array([[0, 1, 2, 3, 6, 14, 15], [0, 1, 2, 3, 9, 14, 15]]), np.array([[0, 1, 2, 3, 5, 14, 15]] * 2)],
         None, "n/a"),
        (2, "Summarise it.", "A parcel list.", [[1, 0, 4], [2, 4, 12], [3, 12, 16], [4, 16, 19], [5, 19, 24]],
         [np.array([[0, 1, 2, 3, 14, 22, 23]] * 2), np.array([[0, 1, 2, 3, 7, 22, 23], [0, 1, 2, 3, 8, 22, 23]])],
         0.8125, "reprefill"),
    ]
    for turn, question, reply, owners, kept, drift, decision in rows:
        t, _ = store.begin_turn(sid, question, None, "f" * 64, "tiny-model", {"max_new_tokens": 8}, None)
        context = owners[-1][2]
        record = {
            "prefill_tokens": [1, 2], "decode_tokens": [3], "pending_tokens": [4],
            "segments": {"owners": owners, "pinned": [[0, 4]], "protect": [], "window": 2, "reprefill": False},
            "tokens_in": context - (0 if turn == 1 else 16), "tokens_out": 2,
            "kept_per_role": {"system": 1.0, "document": 0.25 if turn == 1 else 0.125, "user": 1.0, "assistant": 1.0},
            "retention": {"tokens_after": [7, 7], "budgets": [7, 7], "min_share": round(7 / context, 4),
                          "max_share": round(7 / context, 4)},
            "kept_positions": pack_positions(kept),
            "compression": {"tokens_after": [7, 7], "kv_bytes_before": context * 512, "kv_bytes_after": 7 * 512},
            "drift_score": drift, "drift_decision": decision,
            "timings": {"compression_ms": 1.25, "prefill_ms": 40.0, "decode_ms": 12.0}, "stop_reason": "eos",
        }
        events = [("reprefill", {"drift_score": drift, "missing_terms": [], "tokens_reprefilled": 19, "ms": 40.0})] \
            if decision == "reprefill" else []
        store.finish_turn(sid, t, reply, record, events, {})
    return sid


EXPECTED_TABLE = """\
turn  context  kept  system  developer  tool_schema  document  user  assistant  layer min..max  drift  decision   comp ms  prefill ms  decode ms       KV bytes
   1       16     7    100%          -            -       25%  100%       100%        44%..44%      -  n/a            1.2          40         12   8,192->3,584
   2       24     7    100%          -            -       12%  100%       100%        29%..29%  0.812  reprefill      1.2          40         12  12,288->3,584"""

EXPECTED_DETAIL = """\
turn 1 (done): drift -, decision n/a
  kept / context tokens per message, min..max over layers and KV heads:
    msg   1 system      positions [0, 4): kept 4..4 of 4
    msg   2 document    positions [4, 12): kept 1..1 of 8
    msg   3 user        positions [12, 16): kept 2..2 of 4"""


def test_replay_table_and_detail_exact(tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    sid = synthetic_session(SessionStore(db))
    res = CliRunner().invoke(main, ["replay", sid, "--db", db])
    assert res.exit_code == 0, res.output
    assert "\n".join(line.rstrip() for line in res.output.rstrip().splitlines()) == EXPECTED_TABLE
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--turn", "1"])
    assert res.output.rstrip() == EXPECTED_DETAIL
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--turn", "2", "--json"])
    detail = json.loads(res.output)
    assert detail["layers"][1][1]["kept_positions"] == [0, 1, 2, 3, 8, 22, 23]
    assert detail["layers"][1][1]["per_message"]["2"] == {"kept": 1, "evicted": 7}
    assert [e["kind"] for e in detail["events"]] == ["reprefill"]
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--json"])
    rows = json.loads(res.output)
    assert [r["drift_decision"] for r in rows] == ["n/a", "reprefill"] and rows[1]["reprefill"]["tokens_reprefilled"] == 19
    res = CliRunner().invoke(main, ["sessions", "show", sid, "--db", db, "--json"])
    shown = json.loads(res.output)
    shown["session"]["id"] = "<SID>"
    assert shown["session"]["id"] == "<SID>" and [m["role"] for m in shown["messages"]] == [
        "system", "document", "user", "assistant", "user", "assistant"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+(\+00:00)?", shown["messages"][0]["created_at"])


def test_replay_errors_are_clean(tmp_path):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    SessionStore(db)
    res = CliRunner().invoke(main, ["replay", "missing", "--db", db])
    assert res.exit_code == 1 and res.output.startswith("Error: session_id='missing': no such session")


@pytest.fixture
def recorded(smollm2, tmp_path, monkeypatch):
    """A real 3-turn session (with one re-prefill) on SmolLM2, the model shared with the CLI."""
    monkeypatch.setitem(models_mod._MODELS, ("smollm2-135m-instruct", "float32"), smollm2)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    store = SessionStore(db)
    session = Session.create("smollm2-135m-instruct", policy=POLICY, store=store, system="Be brief.")
    session.add_document(DOC, name="parcels")
    for q in ["Who gets parcel 1003?", "Who gets parcel 1003, again?", "Who gets parcel 1010?"]:
        session.chat(q, max_new_tokens=6)
    assert [t["drift_decision"] for t in store.turns(session.id)] == ["n/a", "kept", "reprefill"]
    return db, store, session.id


def test_verify_passes_then_names_what_was_altered(recorded):
    db, store, sid = recorded
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"ok": True, "turns_checked": 3, "mismatch": None}
    shown = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify"])  # text mode says it is alive
    assert shown.exit_code == 0 and shown.stderr.splitlines() == [f"re-executed turn {i} of 3" for i in (1, 2, 3)]
    assert shown.stdout.startswith("verified: hash chain intact, 3 turns re-executed identically")

    # a kept set altered in the record: named with turn, layer and head
    rec = store.turns(sid)[1]
    kept = unpack_positions(rec["kept_positions"])
    kept[4][1][10] += 1  # shift one kept position of layer 4, head 1
    with store.engine.begin() as conn:
        conn.execute(update(schema.turns).where(schema.turns.c.id == rec["id"])
                     .values(kept_positions=pack_positions(kept)))
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify", "--json"])
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert out["mismatch"]["turn"] == 2 and out["mismatch"]["field"] == "kept_positions[layer 4, head 1]"

    # the policy altered: named before any re-execution
    sess = store.get_session(sid)
    with store.engine.begin() as conn:
        conn.execute(update(schema.sessions).where(schema.sessions.c.id == sid)
                     .values(policy_json=sess["policy_json"].replace('"budget":64', '"budget":65')))
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify"])
    assert res.exit_code == 1 and res.output.startswith("MISMATCH session: policy differs")
    with store.engine.begin() as conn:  # put it back: each alteration is named on its own
        conn.execute(update(schema.sessions).where(schema.sessions.c.id == sid).values(policy_json=sess["policy_json"]))

    # a stored message altered: the hash chain names it first
    with store.engine.begin() as conn:
        conn.execute(update(schema.messages).where(schema.messages.c.session_id == sid, schema.messages.c.seq == 3)
                     .values(content="Who gets parcel 1004?"))
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify", "--json"])
    out = json.loads(res.output)
    assert res.exit_code == 1 and out["mismatch"]["field"] == "hash_chain"
    assert out["mismatch"]["reexecuted"] == "message seq 3 (user): content hash mismatch (altered)"


def test_against_full_and_plot(recorded, tmp_path):
    db, store, sid = recorded
    rows = audit.against_full(store, sid)
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["match_rate"] <= 1.0 for r in rows)
    assert all((r["first_divergence"] is None) == (r["match_rate"] == 1.0) for r in rows)
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--against", "full"])
    assert res.exit_code == 0 and len(res.output.strip().splitlines()) == 3

    png = tmp_path / "r.png"
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--plot", str(png), "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == {"plot": str(png), "turn": 3}
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    assert img.shape[:2] == (700, 1200)
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 50  # a real heatmap, not a blank canvas
    assert ((np.abs(rgb - [214, 39, 40]).sum(1)) < 10).sum() > 500  # the system span's colour band


def test_sessions_export_and_delete(tmp_path):
    db = f"sqlite:///{tmp_path / 'x.db'}"
    store = SessionStore(db)
    sid = synthetic_session(store)
    res = CliRunner().invoke(main, ["sessions", "export", sid, "--db", db, "--json"])
    exported = json.loads(res.output)
    assert [t["turn"] for t in exported["turns"]] == [1, 2] and len(exported["messages"]) == 6
    assert "kept_positions" not in exported["turns"][0]
    res = CliRunner().invoke(main, ["sessions", "delete", sid, "--db", db, "--json"])
    assert json.loads(res.output) == {"deleted": sid} and store.list_sessions() == []


def test_find_names_the_evicted_digits_and_their_margins(smollm2, tmp_path):
    """replay --find: a number's digits evicted at a small budget; what each layer and head held agrees with the
    recorded kept positions, and every evicted token lost by a margin >= 0 (its score under the kept floor)."""
    from snapkv_sessions.audit import find

    store = SessionStore(f"sqlite:///{tmp_path / 'f.db'}")
    policy = {"compression": {"budget": 48, "window": 8}, "drift": {"embedder": "none"}, "memory": {"cold": False}}
    session = Session.create(smollm2, policy=policy, store=store, system="Be brief.")
    session.add_document(" ".join(f"Parcel {1000 + i} weighs {3 * i + 17}.{i} kg and goes to {n}."
                                  for i, n in enumerate("Ada Bob Cyd Dee Eve Fay Gus Hal".split())), name="p")
    session.chat("How much does parcel 1003 weigh?", max_new_tokens=6)
    found = find(store, session.id, "35.6", model=smollm2)
    (occ,) = found["occurrences"]
    assert "".join(occ["tokens"]) == "35.6"
    (turn,) = occ["turns"]
    recorded = unpack_positions(store.turns(session.id)[0]["kept_positions"])  # per layer (Hkv, K)
    evicted_digits = 0
    for lay in turn["layers"]:
        for h, head in enumerate(lay["heads"]):
            kept = set(recorded[lay["layer"]][h].tolist())
            assert {e["position"] for e in head["evicted"]} == set(occ["positions"]) - kept
            assert head["held"] == len(set(occ["positions"]) & kept)
            assert all(e["margin"] >= 0 for e in head["evicted"])
            evicted_digits += sum(occ["tokens"][occ["positions"].index(e["position"])].isdigit()
                                  for e in head["evicted"])
    assert evicted_digits > 0
    res = CliRunner().invoke(main, ["replay", session.id, "--db", str(tmp_path / "f.db"), "--find", "35.6"])
    assert res.exit_code == 0 and "evicted in" in res.output and "median margin" in res.output, res.output
