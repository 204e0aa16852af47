"""bench compile: the compiled step is checked against the eager one (timings are printed, never asserted)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import build_tiny

from snapkv_sessions.bench.compile import measure, table
from snapkv_sessions.cli import main
from snapkv_sessions.errors import ConfigError


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compiled_step_matches_eager(kind):
    # the "eager" backend traces with dynamo and runs the captured graph with eager kernels: same tokens, same logits
    result = measure(build_tiny(kind), kind, rows=[1, 3], context=12, steps=4, backend="eager")
    assert [r.rows for r in result.rows] == [1, 3]
    for row in result.rows:
        assert row.tokens_equal and row.max_logit_diff < 1e-5
        assert row.eager_ms_p50 > 0 and row.compiled_ms_p50 > 0
    assert (result.dtype, result.context, result.steps) == ("float32", 12, 4)
    assert table(result).splitlines()[2].split()[0] == "1"


def test_compile_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="at least 3 steps"):
        measure(build_tiny("llama"), "tiny", rows=[1], context=8, steps=2)
    res = CliRunner().invoke(main, ["bench", "compile", "--rows", "1,x"])
    assert res.exit_code == 2 and "--rows" in res.output and "'1,x'" in res.output
