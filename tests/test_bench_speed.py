"""bench speed: figures consistent with the cache sizes (timings are printed, never asserted)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from snapkv_sessions.bench.speed import _percentile
from snapkv_sessions.cli import main


def test_percentile():
    assert _percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert _percentile(list(map(float, range(101))), 99) == 99.0


def test_bench_speed_small_run(smollm2, tmp_path):
    png = tmp_path / "speed.png"
    res = CliRunner().invoke(main, ["bench", "speed", "--lengths", "300", "--budgets", "0.1,0.5", "--steps", "4",
                                    "--window", "16", "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    full, tenth, half = out["rows"]
    assert [r["budget"] for r in out["rows"]] == ["full", 0.1, 0.5]
    assert (full["kept_per_layer"], tenth["kept_per_layer"], half["kept_per_layer"]) == (300, 30, 150)
    per_token = full["kv_bytes_read_per_step"] // 300
    assert tenth["kv_bytes_resident_after_compression"] == 30 * per_token  # exactly budget x per-token size
    assert half["kv_bytes_read_per_step"] == 150 * per_token
    bound = (out["weight_bytes"] + 300 * per_token) / (out["weight_bytes"] + 30 * per_token)
    assert abs(tenth["bytes_bound_speedup"] - bound) < 1e-3 and full["bytes_bound_speedup"] == 1.0
    assert png.stat().st_size > 10_000
