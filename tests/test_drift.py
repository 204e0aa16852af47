"""Task-shift detection and exact recovery by re-prefill from the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.drift import WorkingSet, evidence_missing, key_terms, make_embedder, names_known, new_subject

DOC = " ".join(f"Parcel {1000 + i} goes to {name}." for i, name in enumerate(
    ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]))
SYSTEM = "Be brief."
# these tests pin down drift re-prefills: shifts are re-prefilled even with the tiered memory on
POLICY = {"compression": {"budget": 64, "window": 8}, "pins": {"roles": ["system"], "sink_tokens": 4},
          "memory": {"on_shift": "reprefill"},
          "drift": {"embedder": "minilm", "threshold": 0.6, "action": "reprefill"}}


def test_paraphrase_scores_low_new_task_high():
    emb = make_embedder("minilm")
    ws = WorkingSet(emb.dim)
    ws.add("q", emb.embed(["Who is the courier for parcel 1003?"])[0])
    follow = ws.drift(emb.embed(["And which courier handles parcel 1003, again?"])[0])
    shifts = [ws.drift(v) for v in emb.embed(["Summarise the document in one sentence.",
                                              "Copy the third line exactly.", "What rule was stated at the top?"])]
    assert follow < 0.2 and min(shifts) > 0.6
    assert ws.drift(emb.embed(["Who is the courier for parcel 1003?"])[0]) == pytest.approx(0.0, abs=1e-5)
    assert WorkingSet(emb.dim).drift(emb.embed(["x"])[0]) is None


def test_key_terms_and_evidence_check():
    assert key_terms("Who is the courier for parcel 1010 and for Ada?") == ["1010", "Ada"]
    assert key_terms("Summarise the document.") == []
    context = "Parcel 1003 goes to Ada. Parcel 1010 goes to Kai."
    char_pos = np.arange(len(context))  # one "token" per character, for the test
    occ_1010 = context.index("1010")
    kept_all = [np.arange(len(context))[None].repeat(2, 0)]  # (Hkv=2, K) everything kept
    assert evidence_missing(["1010"], context, char_pos, kept_all) == []
    evicted = np.array([p for p in range(len(context)) if not occ_1010 <= p < occ_1010 + 4])
    kept = [evicted[None].repeat(2, 0), evicted[None].repeat(2, 0)]  # 2 layers x 2 heads without 1010
    assert evidence_missing(["1010", "1003", "9999"], context, char_pos, kept) == ["1010"]
    # held by exactly half of the layer/head pairs: not more than the quorum, still a miss
    kept_half = [np.arange(len(context))[None].repeat(2, 0), evicted[None].repeat(2, 0)]
    assert evidence_missing(["1010"], context, char_pos, kept_half) == ["1010"]


def test_new_subject_signal():
    assert names_known("Rossi", ["Sofia Rossi"]) and names_known("Sofia Rossi", ["Rossi"])
    assert not names_known("Sofia Berg", ["Sofia Rossi"]) and not names_known("Ross", ["Sofia Rossi"])
    # a query naming only things the working set never named is a new subject; naming nothing is not
    assert new_subject(["Sofia Berg"], ["Sofia Rossi", "EMP-1234"])
    assert not new_subject(["Sofia Berg", "EMP-1234"], ["Sofia Rossi", "EMP-1234"])
    assert not new_subject([], ["Sofia Rossi"])
    emb = make_embedder("minilm")
    ws = WorkingSet(emb.dim)
    ws.add("What is the office of Sofia Rossi?", emb.embed(["What is the office of Sofia Rossi?"])[0])
    assert ws.terms == ["Sofia Rossi"]
    ws.reset()
    assert ws.terms == [] and ws.queries == []


def chat_all(session: Session, questions: list[str]) -> list:
    return [session.chat(q, max_new_tokens=8) for q in questions]


def test_forced_shift_triggers_exactly_one_reprefill(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'd.db'}")
    session = Session.create(smollm2, policy=POLICY, store=store, system=SYSTEM)
    session.add_document(DOC, name="parcels")
    chat_all(session, ["Who gets parcel 1003?", "Who gets parcel 1003, again?", "Who gets parcel 1010?",
                       "Who gets parcel 1010, once more?"])
    decisions = [t["drift_decision"] for t in store.turns(session.id)]
    assert decisions == ["n/a", "kept", "reprefill", "kept"]
    reprefills = [e for e in store.events(session.id) if e["kind"] == "reprefill"]
    assert len(reprefills) == 1 and reprefills[0]["turn"] == 3
    assert reprefills[0]["payload"]["missing_terms"] == ["1010"] and reprefills[0]["payload"]["tokens_reprefilled"] > 200


def test_reprefill_equals_fresh_session_and_pins_survive(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'e.db'}")
    session = Session.create(smollm2, policy=POLICY, store=store, system=SYSTEM)
    session.add_document(DOC, name="parcels")
    chat_all(session, ["Who gets parcel 1003?", "Who gets parcel 1003, again?"])
    history = [{"role": m.role, "content": m.content, "name": m.name} for m in session.messages()]
    shifted = session.chat("Summarise the document in one sentence.", max_new_tokens=12)
    assert store.turns(session.id)[-1]["drift_decision"] == "reprefill"

    fresh = Session.create(smollm2, policy=POLICY, store=store, history=history)
    reference = fresh.chat("Summarise the document in one sentence.", max_new_tokens=12)
    assert store.turns(fresh.id)[-1]["drift_decision"] == "n/a"
    assert shifted.token_ids == reference.token_ids and shifted.text == reference.text
    assert session.state.token_ids == fresh.state.token_ids
    for layer, (a, b) in enumerate(zip(session.state.cache.layers, fresh.state.cache.layers, strict=True)):
        assert torch.equal(session.state.positions[layer], fresh.state.positions[layer])
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    system_positions = set(range(*next((m["token_start"], m["token_end"]) for m in store.messages(session.id)
                                       if m["role"] == "system")))
    assert len(system_positions) > 5
    for layer in range(session.runner.num_layers):
        for head in range(session.runner.num_kv_heads):
            assert system_positions <= set(session.state.kept_positions(layer, head))
    # reopening replays the re-prefill turn exactly
    again = Session.open(session.id, model=smollm2, store=store)
    for a, b in zip(session.state.positions, again.state.positions, strict=True):
        assert torch.equal(a, b)
    assert [question for question, _ in again.drift._queued] == ["Summarise the document in one sentence."]


@pytest.mark.parametrize(("drift", "recovery", "expected"), [
    ({"action": "warn"}, {}, "warn"),
    ({"action": "never"}, {}, "ignored"),
    ({"action": "reprefill"}, {"max_reprefills": 0}, "limited"),
    ({"embedder": "none"}, {}, "n/a"),
])
def test_drift_actions_and_limits(smollm2, tmp_path, drift, recovery, expected):
    policy = {**POLICY, "drift": {**POLICY["drift"], **drift}, "recovery": recovery}
    store = SessionStore(f"sqlite:///{tmp_path / 'f.db'}")
    session = Session.create(smollm2, policy=policy, store=store, system=SYSTEM)
    session.add_document(DOC, name="parcels")
    chat_all(session, ["Who gets parcel 1003?", "Summarise the document in one sentence."])
    assert store.turns(session.id)[-1]["drift_decision"] == expected
    assert not any(e["kind"] == "reprefill" for e in store.events(session.id))


def test_model_embedder_fallback(smollm2):
    model, tok = smollm2
    emb = make_embedder("model", model, tok)
    vecs = emb.embed(["Who gets parcel 1003?", "Who gets parcel 1003?", "Summarise the document."])
    assert vecs.shape == (3, model.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-5)
    ws = WorkingSet(emb.dim)
    ws.add("q", vecs[0])
    assert ws.drift(vecs[1]) == pytest.approx(0.0, abs=1e-5) and ws.drift(vecs[2]) > 0.01


def test_question_text_is_the_question_not_the_pasted_document():
    from snapkv_sessions.drift import question_text

    doc = "\n".join(f"Item {i}: price {i}.50, stock {i * 3}." for i in range(60))
    assert question_text("Who gets parcel 1003?") == "Who gets parcel 1003?"
    assert question_text(f"Here is the list:\n\n{doc}\n\nWhat does item 7 cost?") == "What does item 7 cost?"
    assert question_text(f"{doc}\nAnd item 9?") == "And item 9?"
    long_last = "Background. " * 60 + "Which item is cheapest?"
    assert question_text(long_last) == "Which item is cheapest?"  # the last sentences of an over-long paragraph


def test_key_terms_read_names_in_the_context():
    context = "steel bracket: price 12.40, stock 113.\nblue widget: price 3.10, stock 40.\nPriya Nair: office A-1."
    # lowercase multi-word names that the context holds; stop words never begin or end one
    assert key_terms("What is the price of the steel bracket?", context) == ["steel bracket"]
    assert key_terms("And what is the price of it?", context) == []
    # a capitalised common word opening a sentence is not a name; one the context holds is
    assert key_terms("Draft a reorder note for the blue widget.", context) == ["blue widget"]
    assert key_terms("Priya, which office?", context) == ["Priya"]
    assert key_terms("Draft a note.") == ["Draft"]  # without a context, as before
    assert new_subject(key_terms("What is the price of the blue widget?", context), ["steel bracket"])
    assert not new_subject(key_terms("Is the steel bracket in stock?", context), ["steel bracket"])


@pytest.mark.parametrize("layout", ["lynx: owner Ana, due 3 May.", "lynx,Ana,3 May", "lynx\tAna\t3 May",
                                    "| lynx | Ana | 3 May |", "- lynx (owner Ana, due 3 May)", "2. lynx \u2014 owner Ana"])
def test_one_lowercase_word_that_keys_a_record_is_a_name(layout):
    other = layout.replace("lynx", "otter").replace("Ana", "Bo")
    context = f"PROJECTS\n\n{layout}\n{other}"
    assert key_terms("What is the due date of lynx?", context) == ["lynx"]
    assert new_subject(key_terms("What is the due date of otter?", context), ["lynx"])  # another record: a shift
    assert not new_subject(key_terms("Who owns lynx?", context), ["lynx"])
    assert key_terms("What is the due date of lynx?") == []  # without the document, an ordinary word


def test_line_keys_leave_out_prose_fields_and_stop_words():
    from snapkv_sessions.drift import line_keys

    fields = "\n".join(f"owner: {n}" for n in ("Ana", "Bo", "Cy", "Di"))  # begins every record: a field
    prose = "make the note shorter\neviction is what a budget does\nthe: not a name"
    assert line_keys(f"falcon: due 3 May\n{fields}\n{prose}") == {"falcon"}
    # a word of the question that is only inside a multi-word name is not a name of its own
    context = "steel bracket: price 12.40\nsteel: a metal"
    assert key_terms("What is the price of the steel bracket?", context) == ["steel bracket"]


def test_detector_bench_reports_every_shape():
    from snapkv_sessions.bench import detector

    out = detector.run(2, calibration=2)
    assert set(out["cells"]) == {f"{k}/{s}" for k in detector.KINDS for s in detector.SHAPES}
    for name, cell in out["cells"].items():
        s = cell["at_default"]
        labels = [t.label for seed in range(2) for t in detector.scenario(seed, *name.split("/")).turns]
        assert s["tp"] + s["fn"] == labels.count("shift") and s["fp"] + s["tn"] == labels.count("follow")
    # the question, not the pasted document, is what the detector reads: both shapes score alike
    assert out["cells"]["people/pasted"]["at_default"] == out["cells"]["people/message"]["at_default"]


@pytest.mark.parametrize(("question", "expected"), [
    ("How many of them are in stock?", True),
    ("Which bin is that one kept in?", True),
    ("And what does it cost?", True),
    ("By how much?", True),  # elliptical: a few words ending in a question mark
    ("Why?", True),
    ("What is the price of the blue widget?", False),
    ("Draft a short reorder note for the steel bracket.", False),
    ("Write a haiku about the sea.", False),
    # a pronoun inside its own sentence counts too (a known limit); the new name still makes this one a shift
    ("Now list the rivers of Peru and their lengths in km.", True),
    ("Is the itinerary ready for the hotel stay next week?", False),  # "it" only inside words
])
def test_refers_back(question, expected):
    from snapkv_sessions.drift import refers_back

    assert refers_back(question) is expected


def test_a_follow_up_is_not_scored_by_its_wording():
    """drift.follow_ups: a question that refers back is not a shift by embedding drift alone; a new subject or
    evicted evidence still is. A policy stored before the setting existed keeps it off and keeps its hash."""
    from snapkv_sessions.drift import DriftMonitor, shift_score
    from snapkv_sessions.policy import Policy

    assert shift_score(0.9, False, False) == 0.9 and shift_score(0.9, False, False, follow_up=True) == 0.0
    assert shift_score(0.9, True, False, follow_up=True) == 1.0 and shift_score(0.2, False, True, follow_up=True) == 1.0
    context = "PARTS\nsteel bracket: price 12.50, stock 40.\nblue widget: price 3.10, stock 7."
    on, off = DriftMonitor("minilm", follow_ups=True), DriftMonitor("minilm", follow_ups=False)
    for monitor in (on, off):
        monitor.observe("What is the price of the steel bracket?", context)
    kept = [np.arange(len(context))[None]]
    positions = np.arange(len(context))
    follow = "How many of them are in stock?"
    assert off.assess(follow, context, positions, kept).score == off.assess(follow, context, positions, kept).embedding_drift
    assert on.assess(follow, context, positions, kept).score == 0.0
    assert on.assess("What is the price of the blue widget?", context, positions, kept).score == 1.0  # a new subject
    old = Policy.from_dict({"compression": {"budget": 64, "window": 8}, "memory": {"cold": True}})
    assert old.drift.follow_ups is None and "follow_ups" not in old.canonical_json()
    assert old.stated().drift.follow_ups is True and old.sha256 in old.earlier_hashes()
