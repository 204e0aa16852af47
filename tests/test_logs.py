"""Structured logs of ``serve`` (issue 28): ``--log-format text|json`` and ``--log-content``.

In process, on a tiny random model (no bundle), with the package's loggers configured as ``serve`` configures them
(``stats.configure_logging``): one record per request, per turn and per fault, every line JSON under the json
format; the API key (and its digest) and message content absent by default; the bounded last user message on the
request line with ``log_content``. The command's own plumbing (flags, start-up lines) with a fake service.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from click.testing import CliRunner
from conftest import tiny_app
from sqlalchemy.exc import TimeoutError as PoolTimeout

from snapkv_sessions import stats
from snapkv_sessions.cli import main
from snapkv_sessions.cli import serve as serve_cli
from snapkv_sessions.serve.app import LOG_CONTENT_CHARS
from snapkv_sessions.serve.service import owner_of

KEY = "sk-test-" + "q7" * 12  # 32 characters
WRONG_KEY = "sk-wrong-" + "z9" * 12
SECRET_WORD = "zanzibar"  # message content that must not reach the log unless asked for


@pytest.fixture
def package_logger():
    """The package logger as ``serve`` leaves it, restored after: the handler ``configure_logging`` installs is a
    new one (an earlier test's is set aside, not reconfigured), and its level."""
    logger = logging.getLogger(stats.PACKAGE_LOGGER)
    handlers, level = list(logger.handlers), logger.level
    logger.handlers[:] = [h for h in handlers if not isinstance(h, stats._StreamHandler)]
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _ask(client, model: str, messages: list[dict], key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/chat/completions", headers=headers,
                       json={"model": model, "messages": messages, "max_tokens": 3, "temperature": 0})


def _records(err: str) -> list[dict]:
    """Every line of stderr as JSON (json.loads fails the test on a line that is not)."""
    return [json.loads(line) for line in err.splitlines()]


def _of(records: list[dict], stat_type: str) -> list[dict]:
    return [r for r in records if r.get("stat_type") == stat_type]


def test_json_logs_one_record_per_request_turn_and_fault_without_key_or_content(tmp_path, package_logger, capsys,
                                                                                monkeypatch):
    stats.configure_logging("INFO", "json")  # what serve --log-format json does
    _, client, service = tiny_app(tmp_path, api_keys=frozenset({KEY}))
    model = service.model_name
    with client:
        ok = _ask(client, model, [{"role": "user", "content": f"the {SECRET_WORD} magic number"}], KEY)
        assert ok.status_code == 200, ok.text
        assert _ask(client, model, [{"role": "user", "content": "hello"}], WRONG_KEY).status_code == 401

        def no_connection(*_args, **_kwargs):
            raise PoolTimeout("QueuePool limit reached")

        monkeypatch.setattr(service.store.engine, "connect", no_connection)  # the store's pool is exhausted
        down = _ask(client, model, [{"role": "user", "content": "another question"}], KEY)
        monkeypatch.undo()
        assert down.status_code == 503 and down.json()["error"]["code"] == "store_unavailable", down.text
        assert client.get("/health").status_code == 200  # operator routes: no record
        assert sum(isinstance(s, stats.LogSink) for s in stats.registered()) == 1  # while the app runs
    assert not any(isinstance(s, stats.LogSink) for s in stats.registered())  # and removed at its shutdown
    err = capsys.readouterr().err
    records = _records(err)  # every line is JSON

    body = ok.json()
    (turn,) = _of(records, "turn")
    assert turn["level"] == "INFO" and turn["logger"] == "snapkv_sessions.stats"
    assert (turn["stat"]["session_id"], turn["stat"]["turn"]) == (body["session_id"], body["turn"]) == (
        body["session_id"], 1)
    # a first turn has no drift decision to make
    assert turn["stat"]["decision"] == "n/a" and turn["stat"]["replay"] is False
    assert turn["stat"]["prompt_tokens"] == turn["stat"]["prefilled_tokens"] == body["usage"]["prompt_tokens"]
    assert turn["stat"]["decoded_tokens"] == body["usage"]["completion_tokens"]
    (stored,) = service.store.turns(body["session_id"], status="done")
    assert turn["stat"]["prefilled_tokens"] == stored.tokens_in and turn["stat"]["decoded_tokens"] == stored.tokens_out

    (fault,) = _of(records, "fault")
    assert fault["level"] == "WARNING" and fault["stat"]["kind"] == "store_unavailable"
    assert fault["stat"]["detail"].startswith("no connection free within")

    requests = _of(records, "http")
    assert [(r["stat"]["method"], r["stat"]["path"], r["stat"]["status"]) for r in requests] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 401),
        ("POST", "/v1/chat/completions", 503)]
    assert requests[0]["stat"]["session"] == body["session_id"] and requests[1]["stat"]["session"] is None
    assert all("content" not in r["stat"] for r in requests)
    assert len(records) == 6 and records[-1]["message"] == "stopped"  # 3 requests, 1 turn, 1 fault, the stop

    for secret in (KEY, WRONG_KEY, owner_of(KEY), owner_of(WRONG_KEY), SECRET_WORD):
        assert secret not in err


def test_log_content_puts_the_bounded_last_user_message_on_the_request_line(tmp_path, package_logger, capsys):
    stats.configure_logging("INFO", "json")
    _, client, service = tiny_app(tmp_path, log_content=True)
    long_question = "where " + "w" * 500
    with client:
        res = _ask(client, service.model_name, [{"role": "user", "content": f"the {SECRET_WORD} number"},
                                                {"role": "assistant", "content": "is hidden"},
                                                {"role": "user", "content": long_question}])
        assert res.status_code == 200, res.text
        short = _ask(client, service.model_name, [{"role": "user", "content": "the magic number"}])
        assert short.status_code == 200, short.text
    records = _records(capsys.readouterr().err)
    contents = [r["stat"]["content"] for r in _of(records, "http")]
    assert contents == [long_question[:LOG_CONTENT_CHARS - 1] + "\u2026", "the magic number"]
    assert len(contents[0]) == LOG_CONTENT_CHARS
    assert not any(SECRET_WORD in json.dumps(r) for r in records)  # the last user message only
    assert len(_of(records, "turn")) == 2 and all("content" not in r["stat"] for r in _of(records, "turn"))


def test_text_logs_are_one_readable_line_per_request_and_turn(tmp_path, package_logger, capsys):
    stats.configure_logging("INFO", "text")  # serve's default
    _, client, service = tiny_app(tmp_path)
    with client:
        res = _ask(client, service.model_name, [{"role": "user", "content": f"the {SECRET_WORD} number"}])
        assert res.status_code == 200, res.text
    lines = capsys.readouterr().err.splitlines()
    sid = res.json()["session_id"]
    assert len(lines) == 3
    assert re.search(r" INFO snapkv_sessions\.stats: turn 1 of " + sid[:8] + r": n/a, \d+ prefilled, \d+ decoded, ",
                     lines[0]), lines
    assert re.search(r" INFO snapkv_sessions\.serve: POST /v1/chat/completions 200 \d+ ms session " + sid + "$",
                     lines[1]), lines
    assert lines[2].endswith("snapkv_sessions.serve: stopped") and SECRET_WORD not in "\n".join(lines)


class _FakeService:
    model_id = model_name = "fake"

    def __init__(self, *_args) -> None:
        pass

    def warm(self, tokens: int):
        from snapkv_sessions.serve.warm import WarmReport

        return WarmReport(tokens, [0.0, 0.0], 0.0)


def test_serve_flags_configure_the_loggers_and_reach_the_app(monkeypatch, package_logger):
    from snapkv_sessions import serve as serve_pkg
    from snapkv_sessions import store as store_pkg
    from snapkv_sessions.serve import app as app_module

    seen: dict = {}
    monkeypatch.setattr(serve_cli, "quiet_loaders", lambda: None)
    monkeypatch.setattr(serve_pkg, "Service", _FakeService)
    monkeypatch.setattr(store_pkg, "SessionStore", lambda *a, **k: None)
    monkeypatch.setattr(serve_pkg, "create_app", lambda service, options: seen.update(options=options))
    monkeypatch.setattr(app_module, "run_server", lambda app, host, port, grace: None)

    res = CliRunner().invoke(main, ["serve", "--model", "m", "--log-format", "json", "--log-content",
                                    "--host", "0.0.0.0", "--warm-tokens", "64"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen["options"].log_content is True
    records = _records(res.stderr)  # start-up included: no progress line, no plain line
    assert [(r["level"], r["message"].split(":")[0]) for r in records] == [
        ("WARNING", "warning"), ("INFO", "warm start"), ("INFO", "serving fake (float32) on http")]
    (mine,) = [h for h in package_logger.handlers if isinstance(h, stats._StreamHandler)]
    assert isinstance(mine.formatter, stats.JsonFormatter) and package_logger.level == logging.INFO

    res = CliRunner().invoke(main, ["serve", "--model", "m", "--warm-tokens", "0"])
    assert res.exit_code == 0 and seen["options"].log_content is False  # content off by default
    assert res.stderr.strip() == "serving fake (float32) on http://127.0.0.1:8000/v1"  # text: as it always was
    assert not isinstance(mine.formatter, stats.JsonFormatter)

    assert CliRunner().invoke(main, ["serve", "--model", "m", "--log-format", "xml"]).exit_code == 2
    ray = CliRunner().invoke(main, ["serve", "--model", "m", "--ray", "--log-content"])
    assert ray.exit_code == 1 and "not offered with --ray" in ray.output
