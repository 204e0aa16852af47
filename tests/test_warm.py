"""The server's warm start: a throwaway session served before the first request, bounded, leaving nothing behind."""

from __future__ import annotations

import tempfile

import pytest
from click.testing import CliRunner

from snapkv_sessions.cli import main
from snapkv_sessions.errors import ConfigError
from snapkv_sessions.serve.warm import MAX_WARM_TOKENS, document
from tests.conftest import word_tokenizer

POLICY = {"compression": {"budget": 16, "window": 4}, "drift": {"embedder": "none"}}


def _service(tmp_path, batch: int):
    from snapkv_sessions.serve import Capacity, Service
    from snapkv_sessions.store import SessionStore
    from tests.conftest import build_tiny

    model = build_tiny("qwen2")
    model.config._name_or_path = "tiny"
    return Service((model, word_tokenizer()), POLICY, SessionStore(f"sqlite:///{tmp_path / 's.db'}"),
                   Capacity(batch=batch))


@pytest.mark.parametrize("batch", [0, 2])
def test_the_warm_start_serves_two_turns_and_stores_nothing(tmp_path, monkeypatch, batch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    service = _service(tmp_path, batch)
    try:
        report = service.warm(48)
        assert 0 < report.tokens <= 48 and len(report.turn_s) == 2
        assert report.total_s >= sum(report.turn_s)
        assert service.store.list_sessions() == []  # the server's store never saw it
        assert list((tmp_path / "tmp").glob("snapkv-warm-*")) == []  # its private store is gone
        assert f"a {report.tokens}-token document" in report.line()
    finally:
        service.close()


@pytest.mark.parametrize("batch", [0, 2])
def test_the_warm_start_runs_on_a_thread_that_ends_with_it(tmp_path, monkeypatch, batch):
    """Model work left on the caller's thread (the server's main thread, which lives on in the event loop) made
    every later decode step slower (docs/against-vllm.md): the warm start's model and tokenizer calls run on a
    thread of its own, gone when ``warm`` returns."""
    import threading

    from snapkv_sessions.runner import ModelRunner

    service = _service(tmp_path, batch)
    seen: list[threading.Thread] = []
    turn = ModelRunner.turn if batch == 0 else None
    prefill = ModelRunner._prefill  # every prefill, a turn's included, runs through it

    def watch(fn):
        def wrapped(self, *a, **k):
            seen.append(threading.current_thread())
            return fn(self, *a, **k)
        return wrapped

    monkeypatch.setattr(ModelRunner, "_prefill", watch(prefill))
    if turn is not None:
        monkeypatch.setattr(ModelRunner, "turn", watch(turn))
    try:
        service.warm(48)
        assert seen and threading.main_thread() not in seen and threading.current_thread() not in seen
        assert all(not t.is_alive() for t in seen if t.name == "snapkv-warm")
        assert {t.name for t in seen} <= {"snapkv-warm", "snapkv-scheduler"}
    finally:
        service.close()


def test_a_failing_warm_start_raises_in_the_callers_thread(tmp_path, monkeypatch):
    import snapkv_sessions.serve.service as service_mod

    def boom(*a, **k):
        raise RuntimeError("the warm start failed")

    monkeypatch.setattr(service_mod, "warm_up", boom)
    service = _service(tmp_path, 0)
    with pytest.raises(RuntimeError, match="the warm start failed"):
        service.warm(48)


def test_the_document_never_exceeds_its_tokens():
    tok = word_tokenizer()
    for n in (1, 10, 97):
        text = document(tok, n)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) <= n
    assert len(tok(document(tok, 97), add_special_tokens=False)["input_ids"]) > 80  # it does fill them


def test_a_warm_start_out_of_bounds_is_refused(tmp_path):
    service = _service(tmp_path, 0)
    for bad in (0, MAX_WARM_TOKENS + 1):
        with pytest.raises(ConfigError, match="warm_tokens") as err:
            service.warm(bad)
        assert str(bad) in str(err.value)
    assert service.store.list_sessions() == []


def test_serve_refuses_a_negative_warm_start_before_loading_anything():
    out = CliRunner().invoke(main, ["serve", "--model", "no-such-model", "--warm-tokens", "-1"])
    assert out.exit_code == 1 and "--warm-tokens=-1" in out.output


def test_in_fresh_thread_returns_raises_and_ends():
    import threading

    from snapkv_sessions.serve.worker import in_fresh_thread

    ran: list[threading.Thread] = []

    def work() -> int:
        ran.append(threading.current_thread())
        return 7

    assert in_fresh_thread(work, "snapkv-test") == 7
    assert ran[0] is not threading.current_thread() and ran[0].name == "snapkv-test" and not ran[0].is_alive()
    with pytest.raises(KeyError, match="nope"):
        in_fresh_thread(lambda: {}["nope"], "snapkv-test")


def test_a_fork_boundary_is_copied_on_a_thread_that_ends(tmp_path, monkeypatch):
    """The boundary's copy of a session's cache (every continued turn takes one) ran on the long-lived worker
    thread and slowed every later decode step (docs/against-vllm.md): it runs on a thread of its own."""
    import threading

    from snapkv_sessions.session import Session

    service = _service(tmp_path, 0)
    where: list[threading.Thread] = []
    original = Session.snapshot

    def watched(self):
        where.append(threading.current_thread())
        return original(self)

    monkeypatch.setattr(Session, "snapshot", watched)
    try:
        from types import SimpleNamespace

        session = Session.create_on(service.runner, service.model_id, service.policy, service.store, {})
        session.chat("one two three four five six seven eight nine ten", max_new_tokens=2)
        service._keep_boundary(session, SimpleNamespace(prefix_head="head"))
        assert where and where[0] is not threading.current_thread() and where[0].name == "snapkv-boundary"
        assert not where[0].is_alive() and service._boundaries["head"][1] is not None  # kept, as before
    finally:
        service.close()
