"""The command line and the examples, run for real on the offline SmolLM2 bundle."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from snapkv_sessions.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_json(smollm2, tmp_path):
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    res = CliRunner().invoke(main, ["demo", "--json", "--max-new-tokens", "8", "--budget", "120", "--db", db])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    head, rows, tail = lines[0], lines[1:-1], lines[-1]
    assert head["event"] == "session" and str(tmp_path / "demo.db") in head["store"]
    assert tail == {"event": "verified", "session_id": head["session_id"], "hash_chain_ok": True, "problems": []}
    assert [r["turn"] for r in rows] == [1, 2, 3, 4]
    assert all(r["kept_per_role"]["system"] == 1.0 for r in rows)
    # turn 2 follows up on turn 1; turns 3 and 4 ask about another parcel and switch task: drift re-prefills
    assert [r["reprefill"] for r in rows][:2] == [False, False] and any(r["reprefill"] for r in rows[2:])
    assert all(r["cache_after"] == 120 for r in rows)
    assert all(r["pinned_kept"] == r["pinned_total"] > 10 for r in rows)
    contexts = [r["context_tokens"] for r in rows]
    assert contexts == sorted(contexts) and contexts[0] > 120
    assert all(r["kv_bytes_after"] < r["kv_bytes_before"] for r in rows)


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
    res = CliRunner().invoke(main, ["demo", "--json", "--max-new-tokens", "4", "--db", db])
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
