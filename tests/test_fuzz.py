"""Property-based checks (Hypothesis): hostile messages and policies get documented errors only, and nothing is
stored on error; a stateful test of the store keeps its invariants under random sequences of operations.

Case counts are fixed (``max_examples``) and derandomized, so a run is reproducible and its size known.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from snapkv_sessions import Session, SessionStore
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.policy import ROLES, Policy, PolicyError
from snapkv_sessions.store import StoreError

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

texts = st.text(st.characters(codec=None), max_size=60)  # any code point: surrogates and NUL included
values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts, st.binary(max_size=8),
                   st.lists(st.integers(), max_size=3))
messages = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), texts), "content": st.one_of(texts, values)},
    optional={"name": st.one_of(texts, values), "pinned": values})


@pytest.fixture(scope="module")
def fuzz_session(smollm2):
    policy = {"compression": {"budget": 96, "window": 8}, "drift": {"embedder": "none"},
              "pins": {"roles": ["system"], "markers": ["NEVER"], "patterns": [r"RULE \d+"]},
              "limits": {"max_document_tokens": 40, "max_session_tokens": 100_000}}
    return Session.create(smollm2, policy=policy, store=SessionStore("sqlite://"), system="Answer briefly.")


@SETTINGS
@given(msg=messages)
def test_fuzzed_messages_get_documented_errors_and_store_nothing(fuzz_session, msg):
    store = fuzz_session.store
    before = len(store.messages(fuzz_session.id))
    try:
        fuzz_session.add_history(msg)
    except ConfigError:  # AdmissionError and PatternTimeout are ConfigErrors too
        assert len(store.messages(fuzz_session.id)) == before
    else:
        assert len(store.messages(fuzz_session.id)) == before + 1
    assert store.verify(fuzz_session.id) == []


json_like = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts),
                         lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                 st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
sections = st.fixed_dictionaries({}, optional={
    "compression": st.one_of(json_like, st.fixed_dictionaries({}, optional={
        "budget": values, "window": values, "kernel": values, "budget_ratio": values, "scorer": values,
        "strategy": values, "pooling": values})),
    "pins": st.one_of(json_like, st.fixed_dictionaries({}, optional={
        "roles": st.lists(texts, max_size=3), "patterns": st.lists(texts, max_size=2), "sink_tokens": values})),
    "drift": json_like, "recovery": json_like, "limits": json_like, "min_prompt_tokens": values})


@SETTINGS
@given(data=st.one_of(sections, json_like))
def test_fuzzed_policies_are_valid_or_a_policy_error(data):
    try:
        policy = Policy.from_dict(data) if isinstance(data, dict) else Policy.from_dict({"compression": data})
    except PolicyError as err:
        assert len(str(err)) < 2000  # bounded, whatever the value
    else:
        assert Policy.from_yaml(policy.canonical_json()).sha256 == policy.sha256


@SETTINGS
@given(text=st.one_of(texts, st.text(alphabet=":-&*[]{}!|>\n #ab'\"", max_size=120)))
def test_fuzzed_yaml_is_valid_or_a_policy_error(text):
    try:
        Policy.from_yaml(text)
    except PolicyError as err:
        assert len(str(err)) < 2000


class StoreMachine(RuleBasedStateMachine):
    """Random add / begin / finish / abandon / crash (reopen) sequences on one session of the raw store."""

    @initialize()
    def start(self) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp()
        self.url = f"sqlite:///{self.dir}/s.db"
        self.store = SessionStore(self.url)
        self.sid = self.store.create_session("m", "{}", "p" * 64)
        self.pending: int | None = None

    @rule(role=st.sampled_from(["system", "document", "developer"]), content=st.text(max_size=20))
    def add(self, role: str, content: str) -> None:
        if self.pending is None:
            self.store.add_message(self.sid, role, content)
        else:  # nothing may come between a pending turn's question and its reply
            with pytest.raises(StoreError, match=f"turn {self.pending} is pending"):
                self.store.add_message(self.sid, role, content)

    @precondition(lambda self: self.pending is None)
    @rule(content=st.text(max_size=20))
    def begin(self, content: str) -> None:
        self.pending, _ = self.store.begin_turn(self.sid, content, None, "p" * 64, "m", {}, None)

    @precondition(lambda self: self.pending is not None)
    @rule(reply=st.text(max_size=20))
    def finish(self, reply: str) -> None:
        self.store.finish_turn(self.sid, self.pending, reply, {"tokens_in": 1}, [], {})
        self.pending = None

    @precondition(lambda self: self.pending is not None)
    @rule()
    def abandon(self) -> None:
        assert self.store.abandon_turn(self.sid, self.pending, reason="fuzz")
        assert not self.store.abandon_turn(self.sid, self.pending, reason="twice")  # only a pending turn closes
        self.pending = None

    @rule()
    def crash(self) -> None:
        self.store.engine.dispose()
        self.store = SessionStore(self.url)  # a new process: the pending turn, if any, is still pending
        found = self.store.pending_turn(self.sid)
        assert (found["turn"] if found else None) == self.pending

    @invariant()
    def contiguous_and_whole(self) -> None:
        if not hasattr(self, "store"):
            return
        msgs = self.store.messages(self.sid)
        assert [m["seq"] for m in msgs] == list(range(1, len(msgs) + 1))
        by_seq = {m["seq"]: m for m in msgs}
        turns = self.store.turns(self.sid)
        assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))
        assert sum(t["status"] == "pending" for t in turns) <= 1
        for t in turns:  # no half turn: a done turn has its reply right after its question
            assert by_seq[t["user_seq"]]["role"] == "user"
            if t["status"] == "done":
                assert by_seq[t["assistant_seq"]]["role"] == "assistant" and t["assistant_seq"] == t["user_seq"] + 1
            else:
                assert t["assistant_seq"] is None
            assert (by_seq[t["user_seq"]]["status"] == "abandoned") == (t["status"] == "abandoned")
        assert self.store.verify(self.sid) == []


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None, derandomize=True)
test_store_state_machine = StoreMachine.TestCase
