"""The scheduler (issue 17): sessions decoded together, in one forward per step, with prefills and compressions
between the steps, each get the reply they get alone, token for token."""

from __future__ import annotations

import heapq
import time

import pytest
import torch
from conftest import build_tiny, run_in_threads

from snapkv_sessions import Session
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.generation import GenerationConfig
from snapkv_sessions.packed import exact as packed_exact
from snapkv_sessions.packed import is_packed, pack_linears, unpack_linears
from snapkv_sessions.runner import ModelRunner
from snapkv_sessions.scheduler import Scheduler
from snapkv_sessions.store import SessionStore


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]


# (prompt lengths per turn, budget, generation): different lengths, budgets, greedy and seeded sampling
ENGINE_CASES = [
    ([17, 9], None, GenerationConfig(max_new_tokens=7, eos_token_ids=())),
    ([60, 30], 40, GenerationConfig(max_new_tokens=12, eos_token_ids=())),
    ([45, 5, 22], 24, GenerationConfig(max_new_tokens=9, temperature=0.9, top_k=20, seed=5, eos_token_ids=())),
    ([33, 40], 32, GenerationConfig(max_new_tokens=15, temperature=1.2, top_p=0.8, seed=11, eos_token_ids=(7,))),
    ([80], 48, GenerationConfig(max_new_tokens=3, eos_token_ids=())),
]


def _converse(runner: ModelRunner, case, seed: int, tiered: bool) -> tuple[list[list[int]], object]:
    lengths, budget, gen = case
    state = runner.new_state(tiered=tiered)
    comp = CompressionConfig.make(budget=budget, window=4) if budget else None
    replies = [runner.turn(state, ids, comp, gen).tokens for ids in _prompts(seed, lengths)]
    return replies, state


def _together(runner: ModelRunner, cases, tiered: bool) -> list:
    got = run_in_threads(lambda i: _converse(runner, cases[i], i, tiered), range(len(cases)), 120)
    return [got[i] for i in range(len(cases))]


@pytest.mark.parametrize(("kind", "tiered", "slots", "packed"),
                         [("llama", False, 8, False), ("qwen2", False, 2, False), ("llama", True, 3, False),
                          ("qwen2", True, 4, True)])
def test_sessions_decoded_together_equal_each_alone(kind, tiered, slots, packed):
    model = build_tiny(kind, layers=3)
    if packed:  # both conditions run on the packed weights
        pack_linears(model)
    alone = [_converse(ModelRunner(model), case, i, tiered) for i, case in enumerate(ENGINE_CASES)]
    runner = ModelRunner(model)
    scheduler = Scheduler(runner, slots=slots)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    try:
        together = _together(runner, ENGINE_CASES, tiered)
    finally:
        scheduler.close()
    Scheduler(scheduler.model_runner, slots=1).close()  # closed, it lets the model's runner go
    for (replies_a, state_a), (replies_b, state_b) in zip(alone, together, strict=True):
        assert replies_a == replies_b  # token for token, every turn
        assert state_a.token_ids == state_b.token_ids and state_a.pending == state_b.pending
        assert all(torch.equal(p, q) for p, q in zip(state_a.positions, state_b.positions, strict=True))  # kept sets
        for la, lb in zip(state_a.cache.layers, state_b.cache.layers, strict=True):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
    stats = scheduler.stats.to_dict()
    assert 1 < stats["largest_batch"] <= slots
    assert stats["steps"] < sum(len(r) for rs, _ in alone for r in rs)  # steps were shared


def test_a_reader_that_leaves_frees_its_slot_and_the_others_go_on():
    model = build_tiny("llama", layers=2)
    runner = ModelRunner(model)
    gen = GenerationConfig(max_new_tokens=40, eos_token_ids=())
    reference = ModelRunner(model).turn(runner.new_state(), list(range(5, 30)), None, gen).tokens
    scheduler = Scheduler(runner, slots=2)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    try:
        state = runner.new_state()
        run = runner.run(state, _plan(state, list(range(5, 30))), None, gen)
        tokens = iter(run)
        first = [next(tokens) for _ in range(3)]
        tokens.close()  # leaves mid-reply
        assert not scheduler.pool.slots and first == reference[:3]
        again = runner.turn(runner.new_state(), list(range(5, 30)), None, gen).tokens
        assert again == reference
    finally:
        scheduler.close()


def _plan(state, ids):
    from snapkv_sessions.transcript import TurnPlan

    return TurnPlan(tokens=tuple(ids), first_position=state.next_position, pinned=(), window=None)


def test_a_failing_step_reaches_every_reader_and_the_scheduler_goes_on():
    model = build_tiny("llama", layers=2)
    runner = ModelRunner(model)
    scheduler = Scheduler(runner, slots=4)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    gen = GenerationConfig(max_new_tokens=5, eos_token_ids=())
    try:
        real = scheduler.pool.step
        scheduler.pool.step = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
        with pytest.raises(RuntimeError, match="device lost"):
            runner.turn(runner.new_state(), [5, 6, 7, 8], None, gen)
        assert not scheduler.pool.slots
        scheduler.pool.step = real
        assert len(runner.turn(runner.new_state(), [5, 6, 7, 8], None, gen).tokens) == 5
    finally:
        scheduler.close()


def test_one_scheduler_per_runner_and_a_closed_one_refuses_work():
    runner = ModelRunner(build_tiny("llama", layers=2))
    scheduler = Scheduler(runner, slots=1)
    with pytest.raises(ValueError, match="already has a scheduler"):
        Scheduler(runner)
    with pytest.raises(ValueError, match="already has a scheduler"):
        Scheduler(scheduler.runner)  # nor does the view its sessions run on
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.call(lambda: 1)


def test_packed_linears_equal_the_default_to_rounding_and_unpack_exactly():
    model = build_tiny("llama", layers=2)
    ids = torch.arange(3, 40)[None]  # (1, 37)
    with torch.inference_mode():
        plain = model(input_ids=ids).logits  # (1, 37, V)
        assert pack_linears(model) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert pack_linears(model) == 0 and is_packed(model)  # idempotent
        packed = model(input_ids=ids).logits
        torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
        unpack_linears(model)
        assert not is_packed(model) and torch.equal(model(input_ids=ids).logits, plain)
    with pytest.raises(ConfigError, match="packed_weights.*fp32 or bf16"):
        pack_linears(build_tiny("llama", layers=2).to(torch.float16))


@pytest.mark.skipif(not packed_exact(torch.bfloat16), reason="this CPU has no native bf16 (AVX-512 BF16 or AMX)")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_bf16_linears_give_the_same_bits_where_the_cpu_runs_bf16(kind):
    """What lets serve pack a bf16 model by default: the prompt's logits and every greedy step's, bit for bit."""
    model = build_tiny(kind, layers=3).to(torch.bfloat16)

    def run():
        state = runner.new_state()
        logits, _ = runner.prefill(state, list(range(3, 70)))  # (V,)
        steps = [logits]
        for _ in range(6):
            steps.append(runner.step(state, int(steps[-1].argmax())))  # (V,)
        return torch.stack(steps)  # (7, V)

    runner = ModelRunner(model)
    plain = run()
    pack_linears(model)
    try:
        assert any(hasattr(m, "_snapkv_fused") for m in model.modules())  # decode steps join q/k/v and gate/up
        assert torch.equal(run(), plain)
    finally:
        unpack_linears(model)


# ---------------------------------------------------------------------- sessions on SmolLM2

POLICIES = {
    "tiered-64": {"compression": {"budget": 64, "window": 8}},
    "snapkv-96": {"compression": {"budget": 96, "window": 8}, "memory": {"cold": False}},
    "full": {"compression": {"budget": 4096, "window": 8}, "memory": {"cold": False}},  # covers everything
    # drift flags every turn: a re-prefill from the store on turns 2 and 3, while the others decode
    "reprefill": {"compression": {"budget": 64, "window": 8}, "memory": {"cold": False},
                  "drift": {"embedder": "minilm", "threshold": 0.0, "action": "reprefill", "follow_ups": False},
                  "recovery": {"min_turns_between": 0}},
}
GENERATION = {
    "tiered-64": {"max_new_tokens": 14},
    "snapkv-96": {"max_new_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 3},
    "full": {"max_new_tokens": 12, "stop": ["."]},
    "reprefill": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9, "seed": 8},
}
TURNS = ["The moon has phases: new moon, waxing crescent, first quarter, waxing gibbous, full moon, waning gibbous, "
         "last quarter and waning crescent. Tell me about the moon and its phases in detail.",
         "What did I ask about?", "Name a planet with rings."]


def _session_replies(smollm2, runner_model, name: str, store: SessionStore) -> tuple[list[list[int]], list[str]]:
    session = Session.create(runner_model, policy=POLICIES[name], store=store, system="You are brief.")
    replies = [session.chat(text, **GENERATION[name]) for text in TURNS]
    decisions = [r.get("drift_decision") for r in store.turns(session.id, status="done")]
    return [r.token_ids for r in replies], decisions


def test_sessions_with_different_policies_and_sampling_decoded_together(smollm2, tmp_path):
    model, tokenizer = smollm2
    alone_runner = ModelRunner(model, tokenizer)
    store = SessionStore(f"sqlite:///{tmp_path}/alone.db")
    alone = {name: _session_replies(smollm2, alone_runner, name, store) for name in POLICIES}
    assert alone["reprefill"][1][1:] == ["reprefill", "reprefill"]

    runner = ModelRunner(model, tokenizer)
    scheduler = Scheduler(runner, slots=4)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    shared = SessionStore(f"sqlite:///{tmp_path}/together.db")
    try:
        together = run_in_threads(lambda name: _session_replies(smollm2, runner, name, shared), POLICIES, 300)
    finally:
        scheduler.close()
    assert together == alone  # every reply token for token, and the same re-prefills
    assert scheduler.stats.largest > 1


# ---------------------------------------------------------------------- one reply's failure (issue 29)

# Long replies that are still decoding when the failing one joins; greedy, top-k and top-p sampling.
CONFINED_CASES = [
    ([21], GenerationConfig(max_new_tokens=150, eos_token_ids=())),
    ([34], GenerationConfig(max_new_tokens=150, temperature=0.9, top_k=20, seed=5, eos_token_ids=())),
    ([15], GenerationConfig(max_new_tokens=150, temperature=1.2, top_p=0.8, seed=11, eos_token_ids=())),
]
FAILING = GenerationConfig(max_new_tokens=9, temperature=0.8, seed=2, eos_token_ids=())  # 9: how the fault finds it


def _failing_among_others(monkeypatch, where: str) -> None:
    """Three replies decoding together; a fourth joins and fails in ``where`` ("accept": its decoder raises on its
    3rd token; "admit": the pool cannot take it). The fourth's reader gets the error; the others' replies equal
    each of them alone, token for token; the scheduler goes on."""
    from snapkv_sessions.generation import Decoder

    model = build_tiny("llama", layers=2)
    alone = [ModelRunner(model).turn(ModelRunner(model).new_state(), _prompts(i, lengths)[0], None, gen).tokens
             for i, (lengths, gen) in enumerate(CONFINED_CASES)]
    runner = ModelRunner(model)
    scheduler = Scheduler(runner, slots=4)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    in_pool_at_fault: list[int] = []
    if where == "accept":
        accept = Decoder.accept

        def faulty_accept(self, logits):
            if self.gen.max_new_tokens == FAILING.max_new_tokens and len(self.produced) == 2:
                in_pool_at_fault.append(len(scheduler.pool.slots))
                raise RuntimeError("this row's sampler failed")
            return accept(self, logits)

        monkeypatch.setattr(Decoder, "accept", faulty_accept)
    else:
        admit = scheduler.pool.admit

        def faulty_admit(state, extra):
            if extra == FAILING.max_new_tokens:
                in_pool_at_fault.append(len(scheduler.pool.slots))
                raise RuntimeError("this row's sampler failed")
            return admit(state, extra)

        monkeypatch.setattr(scheduler.pool, "admit", faulty_admit)

    def work(key):
        if key == "failing":  # joins once the others are all decoding
            deadline = time.monotonic() + 60
            while len(scheduler.pool.slots) < len(CONFINED_CASES) and time.monotonic() < deadline:
                time.sleep(0.001)
            with pytest.raises(RuntimeError, match="this row's sampler failed"):
                runner.turn(runner.new_state(), [5, 6, 7, 8, 9], None, FAILING)
            return "raised"
        lengths, gen = CONFINED_CASES[key]
        return runner.turn(runner.new_state(), _prompts(key, lengths)[0], None, gen).tokens

    try:
        got = run_in_threads(work, [*range(len(CONFINED_CASES)), "failing"], 120)
        assert got["failing"] == "raised"
        assert [got[i] for i in range(len(CONFINED_CASES))] == alone  # token for token, as alone
        # the fault struck while the others were in the batch ("accept": the failing reply holds a slot as well)
        assert in_pool_at_fault == [len(CONFINED_CASES) + (where == "accept")]
        assert not scheduler.pool.slots
        lengths, gen = CONFINED_CASES[0]
        assert runner.turn(runner.new_state(), _prompts(0, lengths)[0], None, gen).tokens == alone[0]  # goes on
    finally:
        scheduler.close()


def test_a_reply_whose_sampler_fails_leaves_alone_and_the_others_equal_their_replies_alone(monkeypatch):
    _failing_among_others(monkeypatch, "accept")


def test_a_reply_that_cannot_be_admitted_fails_alone_and_the_others_equal_their_replies_alone(monkeypatch):
    _failing_among_others(monkeypatch, "admit")


def test_a_tiny_temperature_among_others_decodes_greedily_and_fails_no_one():
    """The issue's case: temperature 1e-300 (and top_p 1e-300) next to other clients' replies."""
    model = build_tiny("llama", layers=2)
    cases = [(list(range(5, 30)), GenerationConfig(max_new_tokens=20, temperature=1e-300, seed=1, eos_token_ids=())),
             (list(range(7, 40)), GenerationConfig(max_new_tokens=20, temperature=0.9, top_p=1e-300, seed=2,
                                                   eos_token_ids=())),
             (list(range(9, 33)), GenerationConfig(max_new_tokens=20, temperature=1.1, seed=3, eos_token_ids=()))]
    greedy = GenerationConfig(max_new_tokens=20, eos_token_ids=())
    alone = [ModelRunner(model).turn(ModelRunner(model).new_state(), ids, None, gen).tokens for ids, gen in cases]
    assert alone[0] == ModelRunner(model).turn(ModelRunner(model).new_state(), cases[0][0], None, greedy).tokens
    runner = ModelRunner(model)
    scheduler = Scheduler(runner, slots=3)
    runner = scheduler.runner  # its sessions run on the scheduler's view of the model
    try:
        got = run_in_threads(lambda i: runner.turn(runner.new_state(), cases[i][0], None, cases[i][1]).tokens,
                             range(len(cases)), 120)
    finally:
        scheduler.close()
    assert [got[i] for i in range(len(cases))] == alone


def test_the_waiting_call_with_the_fewest_tokens_left_to_prefill_runs_first(monkeypatch):
    """Calls queued while the scheduler is busy run by tokens left to prefill (0, a compression, first), ties in
    arrival order: a short turn does not wait behind a long document's chunks. (A slow assumed prefill rate makes
    the tokens outweigh the milliseconds between the calls' arrivals.)"""
    import threading

    import snapkv_sessions.scheduler as sched

    monkeypatch.setattr(sched, "PREFILL_RATE", 1e-3)
    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=1)
    busy, ran = threading.Event(), []
    try:
        first = threading.Thread(target=scheduler.call, args=(busy.wait, 1))
        first.start()
        time.sleep(0.2)  # the scheduler's thread is now inside the first call
        threads = []
        for name, remaining in [("long", 4096), ("short-a", 12), ("compress", 0), ("short-b", 12), ("mid", 900)]:
            th = threading.Thread(target=scheduler.call, args=(lambda name=name: ran.append(name), remaining))
            th.start()
            threads.append(th)
            deadline = time.monotonic() + 5
            while len(scheduler._calls) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.01)  # queued in this order
        busy.set()
        for th in [first, *threads]:
            th.join(timeout=10)
    finally:
        scheduler.close()
    assert ran == ["compress", "short-a", "short-b", "mid", "long"]


def test_a_prefill_tells_its_executor_the_tokens_it_has_left():
    from snapkv_sessions.runner import Inline

    class Recording(Inline):
        def __init__(self, runner):
            super().__init__(runner)
            self.seen = []

        def call(self, fn, remaining=0):
            self.seen.append(remaining)
            return fn()

    runner = ModelRunner(build_tiny("llama", layers=2), prefill_chunk=8)
    executor = Recording(runner)
    runner.executor = executor
    state = runner.new_state()
    runner.turn(state, list(range(3, 23)), CompressionConfig.make(budget=12, window=4),
                GenerationConfig(max_new_tokens=2, eos_token_ids=()))
    # 20 tokens in chunks of 8, then the compression and the one decode step (0 left: not a prefill)
    assert executor.seen == [20, 12, 4, 0, 0]


def test_calls_go_on_within_an_iteration_only_while_they_took_less_time_than_its_step():
    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=1)
    try:
        with scheduler._wake:  # the loop is idle (waiting on this condition): queue two calls by hand
            for key, name in [(30.0, "b"), (0.0, "a")]:
                heapq.heappush(scheduler._calls, (key, next(scheduler._arrivals), 0, name, None))
        assert scheduler._next_call(0.5, 0.2) is None  # the calls took longer than the step: the step comes next
        assert scheduler._next_call(0.0, 0.0) is None  # no step ran (nothing decodes): the loop itself goes on
        assert scheduler._next_call(0.1, 0.2)[3] == "a" and scheduler._next_call(0.1, 0.2)[3] == "b"
        assert scheduler._next_call(0.1, 0.2) is None  # none left
    finally:
        scheduler.close()


def test_two_prompts_arriving_together_prefill_one_after_the_other(monkeypatch):
    """Each thread queues its next chunk only once the previous one returned; the loop waits for it (bounded)
    instead of starting the other prompt, so the chunks do not interleave."""
    import threading

    import snapkv_sessions.scheduler as sched

    monkeypatch.setattr(sched, "FOLLOW_UP_S", 2.0)  # a loaded CI machine may take a while to wake a thread
    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=1)
    busy, ran = threading.Event(), []

    def prompt(name):
        for left in (40, 30, 20, 10, 0):  # four chunks of 10 tokens, then the compression
            scheduler.call(lambda left=left: ran.append((name, left)), left)

    try:
        first = threading.Thread(target=scheduler.call, args=(busy.wait, 1))
        first.start()
        time.sleep(0.2)
        threads = [threading.Thread(target=prompt, args=(name,)) for name in ("x", "y")]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 5
        while len(scheduler._calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy.set()
        for th in [first, *threads]:
            th.join(timeout=30)
    finally:
        scheduler.close()
    names = [name for name, _ in ran]
    assert len(ran) == 10 and names in (["x"] * 5 + ["y"] * 5, ["y"] * 5 + ["x"] * 5), ran


def test_a_long_prompt_that_waited_goes_before_newer_short_turns(monkeypatch):
    """A call's key is when its turn would end alone (its start plus its tokens left at PREFILL_RATE): a short
    turn arriving soon after a long one goes first, one arriving later does not, so the long one cannot starve."""
    import threading

    import snapkv_sessions.scheduler as sched

    clock = [100.0]
    monkeypatch.setattr(sched, "_clock", lambda: clock[0])
    monkeypatch.setattr(sched, "PREFILL_RATE", 256.0)
    scheduler = Scheduler(ModelRunner(build_tiny("llama", layers=2)), slots=1)

    def elsewhere(left):  # a call from another session's thread
        got = []
        th = threading.Thread(target=lambda: got.append(scheduler._key(left)))
        th.start()
        th.join()
        return got[0]

    try:
        assert scheduler._key(8192) == 132.0  # a long prompt starts at 100: 32 s of prefill
        clock[0] = 110.0
        assert scheduler._key(4096) == 116.0  # its next chunk keeps the turn's start
        assert elsewhere(20) == 110.0 + 20 / 256  # a short turn arriving now ends first: it goes first
        clock[0] = 117.0
        assert elsewhere(20) == 117.0 + 20 / 256  # arriving later than the long one would end: after it
        clock[0] = 130.0
        assert scheduler._key(0) == 100.0  # the long turn's compression, after its last chunk
        clock[0] = 140.0
        assert scheduler._key(512) == 142.0  # the same thread's next turn starts anew
    finally:
        scheduler.close()
