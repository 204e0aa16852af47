"""Behaviour unchanged across refactors (issue 25): a fresh golden capture equals the one recorded before them.

The capture (``tests/golden.py``) covers pins, pyramid, span-aware, streaming, ratio budgets, re-prefill,
tiered (replies fed again or kept) and batched decode on SmolLM2 in fp32: replies, token ids, kept positions per
layer and KV head, turn records, audit rows, ``replay`` and ``replay --turn`` output, the hash chain and the
reopened session's kept sets. A change that means to alter behaviour records a new capture
(``python tests/golden.py tests/data/golden.json``) and says why in its commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden import capture, digest

GOLDEN = Path(__file__).parent / "data" / "golden.json"


@pytest.mark.slow
def test_sessions_equal_the_golden_capture(smollm2):
    want = json.loads(GOLDEN.read_text())
    got = digest(capture(*smollm2))
    assert sorted(got) == sorted(want)
    differ = [(run, key) for run in want for key in want[run] if got[run][key] != want[run][key]]
    assert not differ, f"sections that differ from the golden capture: {differ}"
