"""``serve``'s numeric options: a bad value is refused in one line naming it, before a model is loaded."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from snapkv_sessions.cli import main
from snapkv_sessions.cli import serve as serve_cli  # the serve command looks these names up in its module

BAD = [  # option, value, the refusal (after "Error: ")
    ("--port", "70000", "--port=70000: must be an integer in 0..65535"),
    ("--port", "-1", "--port=-1: must be an integer in 0..65535"),
    ("--request-timeout", "0", "--request-timeout=0: must be a finite number > 0"),
    ("--request-timeout", "-1", "--request-timeout=-1: must be a finite number > 0"),
    ("--request-timeout", "nan", "--request-timeout=nan: must be a finite number > 0"),
    ("--max-queue", "0", "--max-queue=0: must be an integer >= 1"),
    ("--max-tokens", "0", "--max-tokens=0: must be an integer >= 1"),
    ("--max-live", "0", "--max-live=0: must be an integer >= 1"),
    ("--max-body-mb", "0", "--max-body-mb=0: must be a finite number > 0"),
    ("--max-body-mb", "-2", "--max-body-mb=-2: must be a finite number > 0"),
    ("--max-body-mb", "inf", "--max-body-mb=inf: must be a finite number > 0"),
    ("--max-body-mb", "1e-9", "--max-body-mb=1e-09: must allow at least one byte"),
    ("--batch", "-1", "--batch=-1: must be an integer >= 0"),
    ("--replicas", "0", "--replicas=0: must be an integer >= 1"),
    ("--max-messages", "0", "--max-messages=0: must be an integer >= 1"),
    ("--shutdown-grace", "-1", "--shutdown-grace=-1: must be a finite number >= 0"),
    ("--shutdown-grace", "inf", "--shutdown-grace=inf: must be a finite number >= 0"),
]


@pytest.fixture
def no_model(monkeypatch):
    """Anything past the option checks fails the test loudly: no model may be loaded, no server started."""

    def loaded(*_a, **_k):
        raise AssertionError("serve went on past its option checks")

    monkeypatch.setattr(serve_cli, "quiet_loaders", loaded)
    monkeypatch.setattr(serve_cli, "_serve_ray", loaded)


@pytest.mark.parametrize("option,value,refusal", BAD, ids=[f"{o}={v}" for o, v, _ in BAD])
@pytest.mark.parametrize("ray", [False, True], ids=["single", "ray"])
def test_bad_serve_option_is_one_line(no_model, option, value, refusal, ray):
    start = time.monotonic()
    res = CliRunner().invoke(main, ["serve", "--model", "/nonexistent/model", option, value] + ["--ray"] * ray)
    assert time.monotonic() - start < 5
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 1, res.output
    assert res.output.strip() == f"Error: {refusal}"  # one line, naming the option
    assert "Traceback" not in res.output


def test_good_edge_values_pass_the_checks(monkeypatch):
    """The least (and most) allowed values are not refused: the run goes on to read the keys, here a sentinel."""

    def next_step(*_a, **_k):
        raise AssertionError("serve went on past its option checks")

    monkeypatch.setattr(serve_cli, "_api_keys", next_step)
    for extra in (["--port", "0", "--batch", "0", "--shutdown-grace", "0", "--max-messages", "1", "--docs"],
                  ["--port", "65535", "--max-queue", "1", "--max-live", "1", "--max-tokens", "1", "--request-timeout",
                   "0.001", "--max-body-mb", "0.001", "--replicas", "1"]):
        res = CliRunner().invoke(main, ["serve", "--model", "/nonexistent/model", *extra])
        assert isinstance(res.exception, AssertionError) and "past its option checks" in str(res.exception), \
            (extra, res.output, res.exception)


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--request-timeout", "0"], ["--max-queue", "0"]])
def test_refusal_in_a_real_process_is_fast_and_loads_nothing(argv):
    """As a user runs it: exit 1 within seconds, one line on stderr, and torch never imported."""
    code = ("import sys\nfrom snapkv_sessions.cli import main\ntry:\n"
            f"    main(['serve', '--model', 'smollm2-135m-instruct', *{argv!r}])\n"
            "except SystemExit as exc:\n"
            "    assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'a model stack was imported'\n"
            "    sys.exit(exc.code)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"Error: {argv[0]}={argv[1]}: must be ") and proc.stdout == ""


def test_new_options_reach_serve_options(monkeypatch):
    """--max-messages, --docs and --shutdown-grace are handed to ServeOptions (once the server has those fields)."""
    try:
        from snapkv_sessions import serve as serve_pkg
        from snapkv_sessions import store as store_pkg
    except ImportError as exc:
        pytest.skip(f"the server does not import: {exc}")
    fields = getattr(serve_pkg.ServeOptions, "__dataclass_fields__", {})
    if not {"max_messages", "docs", "shutdown_grace_s"} <= set(fields):
        pytest.skip("ServeOptions has no max_messages/docs/shutdown_grace_s yet")
    from snapkv_sessions.serve import app as app_module

    seen: dict = {}

    class FakeService:
        model_id = model_name = "fake"

        def __init__(self, *args):
            seen["service"] = args
            seen["warm"] = []

        def warm(self, tokens):
            from snapkv_sessions.serve.warm import WarmReport

            seen["warm"].append(tokens)
            return WarmReport(tokens, [0.0, 0.0], 0.0)

    monkeypatch.setattr(serve_cli, "quiet_loaders", lambda: None)
    monkeypatch.setattr(serve_pkg, "Service", FakeService)
    monkeypatch.setattr(store_pkg, "SessionStore", lambda *a, **k: None)
    monkeypatch.setattr(serve_pkg, "create_app", lambda service, options: seen.update(options=options))
    monkeypatch.setattr(app_module, "run_server", lambda app, host, port, grace: seen.update(run=(host, port, grace)))
    res = CliRunner().invoke(main, ["serve", "--model", "m", "--max-messages", "7", "--docs", "--shutdown-grace", "2.5"])
    assert res.exit_code == 0, (res.output, res.exception)
    opts = seen["options"]
    assert (opts.max_messages, opts.docs, opts.shutdown_grace_s) == (7, True, 2.5)
    assert seen["run"] == ("127.0.0.1", 8000, 2.5)  # the drain's grace reaches the server too
    res = CliRunner().invoke(main, ["serve", "--model", "m"])
    opts = seen["options"]
    assert res.exit_code == 0 and (opts.max_messages, opts.docs, opts.shutdown_grace_s) == (1024, False, 10.0)
    assert seen["warm"] == [1024] and "warm start: a 1024-token document" in res.output  # on by default
    res = CliRunner().invoke(main, ["serve", "--model", "m", "--warm-tokens", "0"])
    assert res.exit_code == 0 and seen["warm"] == []  # 0: no warm start
    assert seen["service"][3].trim_memory is True  # each turn's freed memory goes back to the system by default
    res = CliRunner().invoke(main, ["serve", "--model", "m", "--no-trim-memory"])
    assert res.exit_code == 0 and seen["service"][3].trim_memory is False
