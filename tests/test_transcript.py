"""Transcript and TurnPlan: one plan per turn, stored and run again; live and replay share ModelRunner.run."""

from __future__ import annotations

import pytest
import torch

from snapkv_sessions import Session, SessionStore
from snapkv_sessions import transcript as transcript_mod
from snapkv_sessions.errors import PlanError
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.runner import ModelRunner
from snapkv_sessions.transcript import TurnPlan, observation_window, to_ranges

DOC = "\n".join(f"Parcel {1000 + i}: courier agent A{i * 7 % 13}, RULE {i}: fragile." for i in range(24))
POLICY = {"compression": {"budget": 256, "window": 8},
          "pins": {"roles": ["system"], "markers": ["fragile"], "patterns": [r"RULE \d+"], "sink_tokens": 4},
          "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill", "follow_ups": False},
          "recovery": {"min_turns_between": 2},
          "memory": {"on_shift": "reprefill"}}  # re-prefills and tiered turns alternate
QUESTIONS = ["Who is the courier for parcel 1003?", "And parcel 1010?", "Which parcels are fragile?",
             "Who has parcel 1020?", "Thanks."]


def test_plan_record_round_trip_and_flags():
    plan = TurnPlan(tokens=(5, 6, 7, 8), first_position=10, owners=((1, 0, 9), (2, 9, 14)),
                    pinned=((9, 11), (13, 20)), protect=((10, 14),), window=4, reprefill=True)
    again = TurnPlan.from_record(plan.to_record(), [5, 6, 7, 8])
    assert again == plan and again.end_position == 14
    assert plan.pinned_flags() == [True, False, False, True]
    assert to_ranges([True, True, False, True], 10) == ((10, 12), (13, 14))
    with pytest.raises(PlanError, match="without its plan"):
        TurnPlan.from_record(None, [1])
    legacy = TurnPlan.from_record({"pinned": [], "protect": [], "window": 4, "reprefill": False}, [5, 6])
    assert legacy.owners == () and legacy.first_position == -1  # filled in by Transcript.attach


def test_one_window_rule():
    assert observation_window(32, n_todo=10, context=50) == 10
    assert observation_window(32, n_todo=100, context=150) == 32
    assert observation_window(32, n_todo=100, context=150, min_prompt_tokens=200) is None


def test_pins_are_found_once_per_message_at_commit(smollm2, monkeypatch):
    calls = []
    real = transcript_mod.find_pins
    monkeypatch.setattr(transcript_mod, "find_pins", lambda chunk, pins: calls.append(chunk) or real(chunk, pins))
    session = Session.create(smollm2, policy={**POLICY, "drift": {"embedder": "none"}}, store=SessionStore("sqlite://"),
                             system="You are terse.")
    session.add_document(DOC, name="parcels")
    for q in QUESTIONS[:3]:
        session.chat(q, max_new_tokens=6)
    # system, document, then a user message and a reply per turn: each searched once, never again per turn
    assert len(calls) == 2 + 2 * 3
    stored = session.store.messages(session.id)
    assert all(m["pins"] is not None for m in stored)
    doc = next(m for m in stored if m["role"] == "document")
    assert len(doc["pins"]["ranges"]) == 2 * 24  # 24 "RULE n" matches and 24 "fragile" markers
    # the pinned tokens are exactly those overlapping a marker or pattern (plus the system role and sinks)
    text = session.tokenizer.decode([session.state.token_ids[p] for p in session.state.pinned.nonzero().flatten()])
    asked = QUESTIONS[:3]
    assert text.count("fragile") == DOC.count("fragile") + sum(q.count("fragile") for q in asked)
    assert text.count("RULE") == 24


def test_live_and_replay_share_run(smollm2, monkeypatch):
    """A 5-turn session with re-prefills and a pending turn, reopened: every turn goes through ModelRunner.run,
    replayed turns with their recorded reply forced, and the rebuilt cache equals the live one."""
    runs: list[tuple[TurnPlan, bool]] = []
    real_run = ModelRunner.run

    def spy(self, state, plan, compression, gen=None, forced=None):
        runs.append((plan, forced is not None))
        return real_run(self, state, plan, compression, gen, forced)

    monkeypatch.setattr(ModelRunner, "run", spy)
    store = SessionStore("sqlite://")
    session = Session.create(smollm2, policy=POLICY, store=store, system="You are terse.")
    session.add_document(DOC, name="parcels")
    for q in QUESTIONS:
        session.chat(q, max_new_tokens=8)
    live = [plan for plan, forced in runs]
    assert len(live) == 5 and not any(forced for _, forced in runs)
    records = store.turns(session.id, status="done")
    assert [TurnPlan.from_record(r["segments"], r["prefill_tokens"]) for r in records] == live
    assert any(p.reprefill for p in live[1:]) and any(not p.reprefill for p in live[1:])
    # a worker dies after the write-ahead of turn 6
    store.begin_turn(session.id, "Who has parcel 1001?", None, session.policy.sha256, session.model_id,
                     GenerationConfig(max_new_tokens=8).record(), None)
    runs.clear()
    again = Session.open(session.id, model=smollm2, store=store, on_pending="answer")
    assert [plan for plan, _ in runs[:5]] == live and all(forced for _, forced in runs[:5])
    assert len(runs) == 6 and not runs[5][1]  # the pending turn is answered live, through run too
    assert again.recovered is not None and again.recovered.turn == 6
    # the fresh worker that answered turn 6 and the first worker (catching up by replay) hold the same cache
    session.chat("And parcel 1002?", max_new_tokens=4)
    again.chat("And parcel 1003?", max_new_tokens=4)
    session._sync()
    assert session.state.token_ids == again.state.token_ids and session.cache_text == again.cache_text
    for a, b in zip(session.state.positions, again.state.positions, strict=True):
        assert torch.equal(a, b)


class GroupingTokenizer:
    """A template that, like Qwen2.5's, writes consecutive tool results in one user block, closed after the last:
    its rendering of a tool result changes once another follows it."""

    chat_template = "grouping"

    def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=False):
        out = []
        for i, m in enumerate(msgs):
            if m["role"] != "tool":
                out.append(f"<{m['role']}>{m['content']}</end>\n")
                continue
            if i == 0 or msgs[i - 1]["role"] != "tool":
                out.append("<user>")
            out.append(f"[result {m['content']}]")
            if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
                out.append("</end>\n")
        return "".join(out) + ("<assistant>" if add_generation_prompt else "")


def test_a_template_that_rewrites_earlier_messages_renders_them_one_by_one():
    """Two tool results in a row: from the second on, each message is its own block, so every rendering of a
    longer conversation extends the shorter one's (the cache is never rewritten behind its end)."""
    from snapkv_sessions.chat import ChatFormatter, Message

    fmt = ChatFormatter(GroupingTokenizer())
    msgs = [Message("system", "S", seq=1), Message("user", "Q", seq=2), Message("assistant", "call a, b", seq=3),
            Message("tool", "A", name="a", seq=4), Message("tool", "B", name="b", seq=5),
            Message("assistant", "done", seq=6), Message("user", "thanks", seq=7)]
    text, spans = fmt.render(msgs)
    assert text == ("<system>S</end>\n<user>Q</end>\n<assistant>call a, b</end>\n<user>[result A]</end>\n"
                    "<user>[result B]</end>\n<assistant>done</end>\n<user>thanks</end>\n<assistant>")
    assert [text[a:b] for _, a, b in spans][3:5] == ["<user>[result A]</end>\n", "<user>[result B]</end>\n"]
    for k in range(1, len(msgs)):  # every shorter conversation's rendering (without the prompt) is a prefix
        shorter, _ = fmt.render(msgs[:k], generation_prompt=False)
        assert text.startswith(shorter)
    # a conversation the template renders stably is rendered exactly as the template does
    stable = msgs[:4]
    assert fmt.render(stable)[0] == GroupingTokenizer().apply_chat_template(
        [m.for_template() for m in stable], add_generation_prompt=True)
