"""Prefill chunks: the scheduler sizes them by what waits on the model, a turn records the chunks it ran, and a
replay (verify, a rebuild from the store) runs the same ones, since the chunking changes the last bits."""

from __future__ import annotations

import heapq

import pytest
import torch
from conftest import TINY_POLICY, build_tiny, word_tokenizer

from snapkv_sessions import Session
from snapkv_sessions.audit.verify import verify
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.errors import ConfigError, PlanError
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.runner import Inline, ModelRunner
from snapkv_sessions.scheduler import Scheduler
from snapkv_sessions.store import SessionStore
from snapkv_sessions.transcript import TurnPlan

TEXT = ("the special magic number for grass is hidden within the following text . here we go there and back "
        "again . the sky is blue and the sun is yellow . what is the special magic number for grass ?")


class Sized(Inline):
    """An executor that sizes the chunks from a list (then the runner's largest) and records every forward."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        super().__init__(runner)
        self.sizes, self.asked = list(sizes), []

    def chunk(self, most: int) -> int:
        self.asked.append(most)
        return self.sizes.pop(0) if self.sizes else most


def _chunked_session(tmp_path) -> tuple[Session, SessionStore]:
    """A new session on a tiny model whose prefills run in chunks of 4, then 13, then at most 9 tokens."""
    model, tokenizer = build_tiny("qwen2", layers=2), word_tokenizer()
    model.config._name_or_path = "tiny"
    runner = ModelRunner(model, tokenizer, prefill_chunk=9)
    runner.executor = Sized(runner, [4, 13])
    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    return Session.create(runner, policy=TINY_POLICY, store=store, system="you will quiz about the text"), store


def _prefill_forwards(runner: ModelRunner) -> list[int]:
    """The tokens of each prefill forward ``runner`` runs from now on (appended as they run)."""
    fed: list[int] = []
    forward = runner._forward_now
    runner._forward_now = lambda state, ids, probe, whole, split=False: (
        fed.append(len(ids)) if whole else None) or forward(state, ids, probe, whole, split)
    return fed


def test_the_scheduler_feeds_a_whole_chunk_when_nothing_waits_and_its_busy_chunk_when_something_does():
    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=1, busy_chunk=32)
    try:
        assert scheduler.chunk(4096) == 4096 and scheduler.chunk(8) == 8  # idle: the runner's own chunk
        with scheduler._wake:  # another session's call waits (queued by hand; the loop is idle on the condition)
            heapq.heappush(scheduler._calls, (0.0, next(scheduler._arrivals), 0, "other", None))
        assert scheduler.chunk(4096) == 32 and scheduler.chunk(8) == 8
        with scheduler._wake:
            scheduler._calls.clear()
            scheduler._active.append(object())  # a reply decoding
        assert scheduler.chunk(4096) == 32
        with scheduler._wake:
            scheduler._active.clear()
        assert scheduler.chunk(4096) == 4096
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match="busy_chunk"):
        Scheduler(ModelRunner(build_tiny("llama", layers=2)), busy_chunk=0)


def test_a_prefill_sizes_each_chunk_by_asking_and_keeps_the_window_in_the_last_one():
    runner = ModelRunner(build_tiny("llama", layers=2), prefill_chunk=64)
    runner.executor = Sized(runner, [5, 9])
    state = runner.new_state()
    result = runner.turn(state, list(range(3, 23)), CompressionConfig.make(budget=12, window=8),
                         GenerationConfig(max_new_tokens=2, eos_token_ids=()))
    # 5; then 9 would leave 6 tokens, fewer than the window: 7; then the last 8 (asked for 64)
    assert result.chunks == [5, 7, 8] and runner.executor.asked == [64, 64, 64]
    plain = ModelRunner(runner.model, prefill_chunk=64)
    again = plain.new_state()
    assert plain.turn(again, list(range(3, 23)), CompressionConfig.make(budget=12, window=8),
                      GenerationConfig(max_new_tokens=2, eos_token_ids=())).chunks == [20]


def test_a_plan_with_chunks_runs_exactly_them_and_a_wrong_one_is_a_clear_error():
    model = build_tiny("qwen2", layers=2)
    ids = list(range(3, 33))
    chunked = ModelRunner(model, prefill_chunk=7)
    recorded = chunked.run(chunked.new_state(), TurnPlan(tuple(ids), 0, window=4), CompressionConfig.make(
        budget=16, window=4), GenerationConfig(max_new_tokens=3, eos_token_ids=())).finish()
    assert recorded.chunks == [7, 7, 7, 5, 4]
    replayer = ModelRunner(model)  # its own chunk is 4,096: the plan's chunks decide
    replayer.executor = Sized(replayer, [])
    state = replayer.new_state()
    again = replayer.run(state, TurnPlan(tuple(ids), 0, window=4, chunks=tuple(recorded.chunks)),
                         CompressionConfig.make(budget=16, window=4),
                         GenerationConfig(max_new_tokens=3, eos_token_ids=())).finish()
    assert again.chunks == recorded.chunks and replayer.executor.asked == [] and again.tokens == recorded.tokens
    for chunks in [(7, 7), (0, 30), (26, 4, 0), (28, 2)]:  # short, empty, zero, the window split
        with pytest.raises(ConfigError, match="chunks="):
            replayer.run(replayer.new_state(), TurnPlan(tuple(ids), 0, window=4, chunks=chunks),
                         CompressionConfig.make(budget=16, window=4), GenerationConfig(max_new_tokens=1))


@pytest.mark.parametrize("chunks", ["7,7", [], [3, 0], [2.5, 3], [True], {"a": 1}])
def test_recorded_chunks_that_are_not_positive_counts_are_a_plan_error(chunks):
    record = TurnPlan((5, 6, 7), 0, window=None).to_record() | {"chunks": chunks}
    with pytest.raises(PlanError, match="segments.chunks"):
        TurnPlan.from_record(record, [5, 6, 7])
    assert TurnPlan.from_record(record | {"chunks": [2, 1]}, [5, 6, 7]).chunks == (2, 1)
    assert TurnPlan.from_record(TurnPlan((5,), 0).to_record(), [5]).chunks is None  # an older record


def test_a_session_records_its_chunks_and_verify_re_executes_them(tmp_path):
    """Turns prefilled in chunks an executor chose (as the scheduler does, by load) verify on a runner with another
    chunk size: the re-execution feeds the recorded chunks, forward by forward."""
    session, store = _chunked_session(tmp_path)
    model, tokenizer = session.runner.model, session.runner.tokenizer
    for text in (TEXT, "what is the special magic number for sky ?"):
        session.chat(text, max_new_tokens=3)
    recorded = [t["segments"]["chunks"] for t in store.turns(session.id, status="done")]
    assert recorded[0][:2] == [4, 13] and all(c <= 9 for c in recorded[0][2:]) and len(recorded[1]) >= 1

    other = ModelRunner(model, tokenizer)  # chunks of 4,096
    fed = _prefill_forwards(other)
    result = verify(store, session.id, model=other)
    assert result.ok and result.turns_checked == 2
    assert fed == [c for turn in recorded for c in turn]


def test_a_session_reopened_elsewhere_replays_its_turns_in_their_recorded_chunks(tmp_path):
    """Another process (here: another runner, with another chunk size) rebuilds the cache from the store by running
    each recorded plan again: forward by forward in the live turn's chunks, so the cache it rebuilds is the live
    one, bit for bit."""
    session, store = _chunked_session(tmp_path)
    model, tokenizer = session.runner.model, session.runner.tokenizer
    session.chat(TEXT, max_new_tokens=3)
    recorded = store.turns(session.id, status="done")[0]["segments"]["chunks"]
    live = [(lay.keys.clone(), lay.values.clone()) for lay in session.state.cache.layers]

    other = ModelRunner(model, tokenizer)  # chunks of 4,096
    fed = _prefill_forwards(other)
    reopened = Session.open(session.id, model=other, store=store)
    assert fed == recorded
    rebuilt = [(lay.keys, lay.values) for lay in reopened.state.cache.layers]
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(live, rebuilt, strict=True))
