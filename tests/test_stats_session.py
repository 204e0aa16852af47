"""The stats stream is fed by the engine itself (issue 25): a sink registered around a session's turns counts
exactly what the session's turn records hold (tokens fed and decoded, re-prefills, recalled slots, tier bytes),
a reopened session's replay is counted as replayed turns, and a batched decode emits its steps."""

from __future__ import annotations

from snapkv_sessions import Session, SessionStore, stats

TURNS = ["The moon has phases: new moon, waxing crescent, first quarter, waxing gibbous, full moon, waning "
         "gibbous, last quarter and waning crescent. Tell me about the moon.", "What did I ask about?",
         "Name a planet with rings.", "Which phase comes after the full moon?"]


class Recorder:
    def __init__(self) -> None:
        self.got: list = []

    def record(self, stat) -> None:
        self.got.append(stat)


def _session_under(sink, smollm2, policy: dict, store: SessionStore) -> Session:
    with stats.sinks(sink):
        session = Session.create(smollm2, policy=policy, store=store, system="You are brief.")
        for text in TURNS:
            session.chat(text, max_new_tokens=9)
    return session


def test_a_sinks_counts_equal_the_turn_records_of_a_tiered_session(smollm2, tmp_path):
    store = SessionStore(f"sqlite:///{tmp_path}/s.db")
    counter, recorder = stats.Counter(), Recorder()
    with stats.sinks(recorder):
        session = _session_under(counter, smollm2, {"compression": {"budget": 48, "window": 8}}, store)
    records = store.turns(session.id, status="done")
    turns = [s for s in recorder.got if isinstance(s, stats.TurnStat)]
    assert [t.turn for t in turns] == [r["turn"] for r in records] and not any(t.replay for t in turns)
    assert counter.turns == len(records) == len(TURNS)
    assert counter.prompt_tokens == sum(r["tokens_in"] for r in records)
    assert counter.decoded_tokens == sum(r["tokens_out"] for r in records)
    assert counter.reprefills == sum(r["drift_decision"] == "reprefill" for r in records) == 0
    tiers = [r["compression"]["tier"] for r in records]
    assert counter.recalled_slots == sum(t["recalled"] for t in tiers) > 0
    assert [(t.hot_bytes, t.cold_bytes) for t in turns] == [(x["hot_bytes"], x["cold_bytes"]) for x in tiers]
    # each turn feeds the plan's tokens, the last reply again (decoded into the cache) and its pending token
    fed = [r["tokens_in"] + (len(p["decode_tokens"]) + len(p["pending_tokens"]) if p else 0)
           for p, r in zip([None, *records[:-1]], records, strict=True)]
    assert [t.prefilled_tokens for t in turns] == fed
    # one decode step per token decoded into the cache (the last one stays pending)
    assert counter.decode_steps == sum(len(r["decode_tokens"]) for r in records)
    assert counter.count("compression") == sum(r["compression"] is not None for r in records)

    replayed = stats.Counter()
    with stats.sinks(replayed):
        Session.open(session.id, smollm2, store=store)
    # a replay feeds each recorded reply but its last token, which it leaves pending as the live turn did
    assert replayed.replayed_turns == len(records)
    assert replayed.decoded_tokens == sum(len(r["decode_tokens"]) for r in records)
    assert replayed.prompt_tokens == counter.prompt_tokens and replayed.prefilled_tokens == counter.prefilled_tokens


def test_re_prefills_are_counted_with_their_reason(smollm2, tmp_path):
    policy = {"compression": {"budget": 64, "window": 8}, "memory": {"cold": False},
              "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill", "follow_ups": False},
              "recovery": {"min_turns_between": 0}}
    store = SessionStore(f"sqlite:///{tmp_path}/r.db")
    recorder = Recorder()
    session = _session_under(recorder, smollm2, policy, store)
    records = store.turns(session.id, status="done")
    turns = [s for s in recorder.got if isinstance(s, stats.TurnStat)]
    assert [t.decision for t in turns] == [r["drift_decision"] for r in records]
    assert [t.reprefill_reason for t in turns] == ["drift" if r["drift_decision"] == "reprefill" else None
                                                  for r in records]
    assert sum(t.decision == "reprefill" for t in turns) >= 2
    # a re-prefill feeds the whole prompt again: what the record's plan holds
    assert [t.prefilled_tokens for t in turns if t.decision == "reprefill"] == [
        r["tokens_in"] for r in records if r["drift_decision"] == "reprefill"]


def test_a_batched_decode_emits_its_steps_with_their_rows_and_bytes():
    from conftest import build_tiny, run_in_threads

    from snapkv_sessions.generation import GenerationConfig
    from snapkv_sessions.runner import ModelRunner
    from snapkv_sessions.scheduler import Scheduler

    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=3)
    gen = GenerationConfig(max_new_tokens=12, eos_token_ids=())
    recorder = Recorder()
    try:
        with stats.sinks(recorder):
            runner = scheduler.runner
            run_in_threads(lambda i: runner.turn(runner.new_state(), list(range(3 + i, 30 + i)), None, gen), range(3))
    finally:
        scheduler.close()
    steps = [s for s in recorder.got if isinstance(s, stats.DecodeStepStat)]
    assert len(steps) == scheduler.stats.steps and sum(s.batch_size for s in steps) == scheduler.stats.rows
    assert max(s.batch_size for s in steps) == scheduler.stats.largest > 1
    # each row read its whole slot: (prompt + tokens fed so far) keys and values, 2 layers, 2 KV heads of 16
    per_token = 2 * 2 * 2 * 16 * 4
    assert all(s.kv_bytes_read % per_token == 0 and s.kv_bytes_read >= s.batch_size * 27 * per_token for s in steps)
    loops = [s for s in recorder.got if isinstance(s, stats.SchedulerStepStat)]
    assert sum(s.calls for s in loops) == scheduler.stats.calls
