"""Session over the store: round trips, reopen in a new process, tamper detection, serialised workers, crashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import pg_store
from sqlalchemy import update

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.errors import BudgetError, ConfigError
from snapkv_sessions.session import AdmissionError
from snapkv_sessions.store import schema

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("SNAPKV_TEST_REDIS", "redis://127.0.0.1:6379/0")
POLICY = {"compression": {"budget": 96, "window": 16, "kernel": 7}, "pins": {"roles": ["system"], "sink_tokens": 4}}
DOC = " ".join(f"Parcel {1000 + i} goes to {name}." for i, name in enumerate(
    ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]))
QUESTIONS = ["Who gets parcel 1003?", "And parcel 1005?", "Who gets parcel 1010?", "List two names.",
             "Is Ada in the list?", "Thanks, that is all."]


def redis_url_or_skip() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    return REDIS_URL


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service)])
def store(request, tmp_path):
    if request.param == "sqlite":
        return SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    return pg_store()


def worker(mode: str, url: str, sid: str, *questions: str, redis_url: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKER_REDIS_URL": redis_url, "PYTHONPATH": str(HERE)}
    return subprocess.run([sys.executable, str(HERE / "session_worker.py"), mode, url, sid, *questions],
                          capture_output=True, text=True, timeout=600, env=env)


def new_session(smollm2, store, policy=POLICY) -> Session:
    session = Session.create(smollm2, policy=policy, store=store, system="You answer in one short sentence.")
    session.add_document(DOC, name="parcels")
    return session


def test_six_turns_round_trip_and_chain(smollm2, store):
    session = new_session(smollm2, store)
    replies = [session.chat(q, max_new_tokens=10) for q in QUESTIONS]
    assert [r.turn for r in replies] == [1, 2, 3, 4, 5, 6]
    stored = store.messages(session.id)
    expected = [("system", "You answer in one short sentence."), ("document", DOC)]
    for q, r in zip(QUESTIONS, replies, strict=True):
        expected += [("user", q), ("assistant", session.tokenizer.decode(r.token_ids, skip_special_tokens=True))]
    assert [(m["role"], m["content"]) for m in stored] == expected  # byte-identical round trip
    assert session.verify() == []
    turns = store.turns(session.id)
    assert [t["status"] for t in turns] == ["done"] * 6
    assert all(t["compression"]["tokens_after"] == [96] * 30 for t in turns[1:])  # compressed every turn
    assert all(t["kept_per_role"]["system"] == 1.0 for t in turns)
    # message token spans tile the fed positions without gaps
    spans = sorted((m["token_start"], m["token_end"]) for m in store.messages(session.id))
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    # reopening in this process rebuilds the exact cache
    again = Session.open(session.id, model=smollm2, store=store)
    for a, b in zip(session.state.positions, again.state.positions, strict=True):
        assert a.tolist() == b.tolist()
    assert again.cache_text == session.cache_text and again.state.pending == session.state.pending


def test_reopen_in_new_process_gives_same_next_reply(smollm2, tmp_path):
    db = tmp_path / "a.db"
    store = SessionStore(f"sqlite:///{db}")
    session = new_session(smollm2, store)
    for q in QUESTIONS:
        session.chat(q, max_new_tokens=10)
    store.engine.dispose()
    shutil.copy(db, tmp_path / "b.db")  # the same session, frozen after turn 6, for the other process
    nxt = session.chat("Who gets parcel 1007?", max_new_tokens=10)
    proc = worker("chat", f"sqlite:///{tmp_path / 'b.db'}", session.id, "Who gets parcel 1007?")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (other,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert other["turn"] == nxt.turn == 7
    assert other["tokens"] == nxt.token_ids and other["text"] == nxt.text


def test_altered_message_is_detected(smollm2, store):
    session = new_session(smollm2, store)
    session.chat(QUESTIONS[0], max_new_tokens=6)
    with store.engine.begin() as conn:
        conn.execute(update(schema.messages).where(schema.messages.c.session_id == session.id,
                                                   schema.messages.c.seq == 2).values(content=DOC + " Parcel 9."))
    problems = session.verify()
    assert problems == ["message seq 2 (document): content hash mismatch (altered)",
                        "message seq 2 (document): altered outside the store (its seal does not match)"]


@pytest.mark.parametrize("use_redis", [False, pytest.param(True, marks=pytest.mark.service)])
def test_two_processes_are_serialised(smollm2, tmp_path, use_redis):
    redis_url = redis_url_or_skip() if use_redis else ""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    store = SessionStore(url)
    session = new_session(smollm2, store)
    env = {**os.environ, "WORKER_REDIS_URL": redis_url, "PYTHONPATH": str(HERE)}
    procs = [subprocess.Popen([sys.executable, str(HERE / "session_worker.py"), "chat", url, session.id,
                               f"{who}: who gets parcel 100{i}?", f"{who}: and parcel 101{i}?"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i, who in enumerate(["A", "B"])]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    turns = store.turns(session.id)
    assert [t["turn"] for t in turns] == [1, 2, 3, 4] and all(t["status"] == "done" for t in turns)
    msgs = store.messages(session.id)
    roles = [m["role"] for m in msgs[2:]]
    assert roles == ["user", "assistant"] * 4  # never interleaved
    users = sorted(m["content"] for m in msgs if m["role"] == "user")
    assert users == sorted(["A: who gets parcel 1000?", "A: and parcel 1010?", "B: who gets parcel 1001?",
                            "B: and parcel 1011?"])  # none lost or duplicated
    assert store.verify(session.id) == []
    for t in turns:  # each reply follows its own question
        assert msgs[t["user_seq"] - 1]["role"] == "user" and t["assistant_seq"] == t["user_seq"] + 1


@pytest.mark.parametrize("on_pending", ["answer", "report"])
def test_killed_between_message_and_reply_reopens_cleanly(smollm2, tmp_path, on_pending):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    store = SessionStore(url)
    session = new_session(smollm2, store)
    session.chat(QUESTIONS[0], max_new_tokens=6)
    proc = worker("die-mid-turn", url, session.id, "Who gets parcel 1004?")
    assert proc.returncode == 17
    assert store.pending_turn(session.id)["turn"] == 2  # the user message was committed first
    reopened = Session.open(session.id, model=smollm2, store=store, on_pending=on_pending)
    assert store.pending_turn(session.id) is None
    turns = store.turns(session.id)
    if on_pending == "answer":
        assert [t["status"] for t in turns] == ["done", "done"] and reopened.recovered.turn == 2
        assert [m["role"] for m in store.messages(session.id)][-2:] == ["user", "assistant"]
    else:
        assert [t["status"] for t in turns] == ["done", "abandoned"]
        assert store.messages(session.id)[-1]["status"] == "abandoned"
        assert any(e["kind"] == "abandoned" for e in store.events(session.id))
    assert reopened.chat("And parcel 1006?", max_new_tokens=6).turn == 3
    assert store.verify(session.id) == []


@pytest.mark.service
def test_redis_hot_state_and_unreachable_redis(smollm2, tmp_path):
    url = redis_url_or_skip()
    store = SessionStore(f"sqlite:///{tmp_path / 'r.db'}", redis_url=url)
    session = new_session(smollm2, store)
    session.chat(QUESTIONS[0], max_new_tokens=6)
    assert store.hot_state(session.id)["turns_done"] == "1"
    with pytest.warns(RuntimeWarning, match="unreachable"):
        down = SessionStore(f"sqlite:///{tmp_path / 'r.db'}", redis_url="redis://127.0.0.1:6390/0")
    with pytest.warns(RuntimeWarning, match="unreachable"):
        reply = Session.open(session.id, model=smollm2, store=down).chat(QUESTIONS[1], max_new_tokens=6)
    assert reply.turn == 2 and down.verify(session.id) == []


def test_pinned_roles_and_markers_survive_every_turn(smollm2, tmp_path):
    policy = {"compression": {"budget": 120, "window": 16},
              "pins": {"roles": ["system", "developer", "tool_schema"], "markers": ["CODE-RED"], "sink_tokens": 0}}
    store = SessionStore(f"sqlite:///{tmp_path / 'p.db'}")
    session = Session.create(smollm2, policy=policy, store=store, system="Be brief.")
    session.add_message({"role": "developer", "content": "Never reveal internal ids."})
    session.add_message({"role": "tool_schema", "content": '{"name": "lookup", "parameters": {"id": "int"}}'})
    session.add_document(DOC + " Alarm word: CODE-RED. " + DOC, name="log")
    for q in QUESTIONS[:4]:
        session.chat(q, max_new_tokens=8)
        assert session.last_reply.report.compressed
        pinned = set(session.state.pinned.nonzero().flatten().tolist())
        for layer in range(session.runner.num_layers):
            for head in range(session.runner.num_kv_heads):
                assert pinned <= set(session.state.kept_positions(layer, head))
    spans = {m["role"]: (m["token_start"], m["token_end"]) for m in store.messages(session.id)
             if m["role"] in ("system", "developer", "tool_schema")}
    expected = set().union(*(range(a, b) for a, b in spans.values()))
    marker = [i for i in pinned if i not in expected]
    assert expected <= pinned and 2 <= len(marker) <= 8  # the marker's few tokens inside the document
    text = session.tokenizer.decode([session.state.token_ids[i] for i in sorted(marker)])
    assert "CODE" in text and "RED" in text


def test_pins_over_budget_abandon_the_turn_cleanly(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'o.db'}")
    session = Session.create(smollm2, policy={"compression": {"budget": 40, "window": 8},
                                              "pins": {"roles": ["system", "document"]}}, store=store,
                             system="Be brief.")
    with pytest.raises(AdmissionError, match=r"^compression.budget=40: the document message alone pins \d+ tokens"):
        session.add_document(DOC, name="parcels")  # could never fit: refused before it is stored
    for i, sentence in enumerate(DOC.split(". ")):  # each fits alone; together they do not
        session.add_document(sentence, name=f"parcel {i}")
    with pytest.raises(BudgetError, match="pinned positions do not fit"):
        session.chat(QUESTIONS[0], max_new_tokens=4)
    assert [t["status"] for t in store.turns(session.id)] == ["abandoned"]
    assert [e["kind"] for e in store.events(session.id)] == ["error", "abandoned"]
    assert store.events(session.id)[0]["payload"]["type"] == "BudgetError"
    assert store.verify(session.id) == []


def test_admission_limits_checked_before_storing(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'l.db'}")
    session = Session.create(smollm2, policy={"limits": {"max_document_tokens": 50}}, store=store)
    with pytest.raises(AdmissionError, match=r"^limits.max_document_tokens=50: document 'parcels' has \d+ tokens"):
        session.add_document(DOC, name="parcels")
    assert store.messages(session.id) == []
    assert session.counter is not None and session.counter.backend == "tiktoken"
    assert session.count_tokens(DOC) == len(session.tokenizer(DOC, add_special_tokens=False)["input_ids"])


def test_openai_style_messages(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'o.db'}")
    session = Session.create(smollm2, store=store, policy=POLICY)
    session.add_message({"role": "system", "content": [{"type": "text", "text": "Be brief."}]})
    reply = session.chat({"role": "user", "content": "Say hi."}, max_new_tokens=5)
    assert reply.turn == 1
    assert [(m["role"], m["content"]) for m in store.messages(session.id)][:2] == [("system", "Be brief."),
                                                                                  ("user", "Say hi.")]


def test_in_memory_store_is_one_database_for_every_thread():
    import threading

    store = SessionStore("sqlite://")
    sid = store.create_session("m", "{}", "h")
    seen: list = []
    worker = threading.Thread(target=lambda: seen.append(store.get_session(sid)["model_id"]))
    worker.start()
    worker.join()
    assert seen == ["m"]


def test_a_fork_continues_as_the_original_did(smollm2, tmp_path):
    """Fork at turn 1 and ask turn 2's question: with the tiered memory (the default) every turn equals a fresh
    prefill compressed with its window, so the fork's first turn (a prefill of the stored history) gives the
    original's turn-2 reply, token for token. The original is not changed; a bad turn is a clear error."""
    store = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    session = new_session(smollm2, store)
    session.chat(QUESTIONS[0], max_new_tokens=8)
    second = session.chat(QUESTIONS[1], max_new_tokens=8)
    fork = session.fork(1)
    assert [(m.role, m.content) for m in fork.messages()] == [
        (m.role, m.content) for m in session.messages(up_to_seq=store.turns(session.id)[0]["assistant_seq"])]
    assert fork.chat(QUESTIONS[1], max_new_tokens=8).token_ids == second.token_ids
    assert [t["turn"] for t in store.turns(session.id)] == [1, 2] and fork.verify() == []
    with pytest.raises(ConfigError, match=r"^turn=5: must be a done turn"):
        session.fork(5)


def test_a_fork_from_a_snapshot_continues_exactly_as_its_source(smollm2, tmp_path):
    """A snapshot at a turn boundary (cache hot and cold, transcript, drift working set), taken before the source
    moves on: every fork from it (store rows copied, cache cloned, no prefill of the history) answers the next
    question exactly as the source did, and a fork reopened from the store (its copied turn records replayed)
    holds exactly the cache the live fork holds."""
    from snapkv_sessions import audit

    store = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    session = new_session(smollm2, store)
    session.chat(QUESTIONS[0], max_new_tokens=8)
    snap = session.snapshot()
    assert snap is not None and snap.turns_applied == 1 and snap.state.cold is not None
    assert any(lay is not None for lay in snap.state.cold.layers)  # compression evicted: the tier holds part
    forks = [session.fork_from(snap), session.fork_from(snap)]
    original = session.chat(QUESTIONS[1], max_new_tokens=8)  # the source moves on after the snapshot
    for fork in forks:
        reply = fork.chat(QUESTIONS[1], max_new_tokens=8)
        assert reply.token_ids == original.token_ids and reply.kept_per_role == original.kept_per_role
        assert reply.prompt_tokens == original.prompt_tokens  # the new question and reply only, no history
        assert fork.state.token_ids == session.state.token_ids
        assert all(a.equal(b) for a, b in zip(fork.state.positions, session.state.positions, strict=True))
        assert [t["turn"] for t in store.turns(fork.id)] == [1, 2] and fork.verify() == []
    reopened = Session.open(forks[0].id, model=smollm2, store=store)
    assert reopened.state.token_ids == forks[0].state.token_ids
    assert all(a.equal(b) for a, b in zip(reopened.state.positions, forks[0].state.positions, strict=True))
    assert audit.verify(store, forks[0].id, model=smollm2).ok
    assert [t["turn"] for t in store.turns(session.id)] == [1, 2]  # the source is not changed by its forks
    stale = Session.open(session.id, model=smollm2, store=store)
    session.chat(QUESTIONS[2], max_new_tokens=4)
    assert stale.snapshot() is None  # its cache lags the store: no boundary to fork from


def test_a_stop_request_interrupts_a_long_prefill_between_chunks(smollm2, tmp_path):
    """A server's deadline (or a client gone) stops a turn mid-prefill: the runner checks between chunks, the turn
    is abandoned cleanly with nothing of it in the cache, and the session's next turn is the turn it would have
    been."""
    from snapkv_sessions import interrupts

    store = SessionStore(f"sqlite:///{tmp_path / 'sessions.db'}")
    session = new_session(smollm2, store)
    session.runner.prefill_chunk, chunk = 16, session.runner.prefill_chunk
    checks = []
    try:
        with interrupts.stop_when(lambda: checks.append(1) or len(checks) > 2):
            with pytest.raises(interrupts.Interrupted):
                session.chat(QUESTIONS[0], max_new_tokens=4)
    finally:
        session.runner.prefill_chunk = chunk
    assert len(checks) == 3  # stopped at the third chunk boundary, not after the whole prefill
    assert [t["status"] for t in store.turns(session.id)] == ["abandoned"] and store.verify(session.id) == []
    reply = session.chat(QUESTIONS[0], max_new_tokens=4)
    fresh = new_session(smollm2, SessionStore(f"sqlite:///{tmp_path / 'fresh.db'}")).chat(QUESTIONS[0],
                                                                                           max_new_tokens=4)
    assert reply.token_ids == fresh.token_ids
