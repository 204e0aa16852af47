"""heap: freed memory given back to the system after every turn (release), and freed blocks kept for reuse within one
(keep_freed)."""

from __future__ import annotations

import pytest
from conftest import build_tiny, word_tokenizer

from snapkv_sessions import heap


def _rss_mib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) // 1024 for line in fh if line.startswith("VmRSS"))


@pytest.mark.skipif(not heap.available(), reason="the C library has no malloc_trim (not glibc)")
def test_release_returns_what_freed_blocks_kept():
    import torch

    blocks = [torch.ones(16_000) for _ in range(4_000)]  # 4,000 blocks of 64 KB: below glibc's mmap threshold
    last = blocks[-1]  # the heap's top block stays in use, so freeing the rest does not shrink the heap by itself
    held = _rss_mib()
    del blocks
    freed = _rss_mib()
    assert heap.release() is True
    assert freed - _rss_mib() > 150 and held - freed < 50  # freeing kept the pages; release gave them back
    assert last.shape == (16_000,)


@pytest.mark.parametrize("trim", [True, False])
def test_the_service_releases_after_every_turn_unless_told_not_to(tmp_path, monkeypatch, trim):
    from fastapi.testclient import TestClient

    from snapkv_sessions.serve import Capacity, ServeOptions, Service, create_app
    from snapkv_sessions.store import SessionStore

    calls = []
    monkeypatch.setattr(heap, "release", lambda: calls.append(1) or True)
    model = build_tiny("qwen2")
    model.config._name_or_path = "tiny"
    service = Service((model, word_tokenizer()), {"compression": {"budget": 16, "window": 4},
                                                  "drift": {"embedder": "none"}},
                      SessionStore(f"sqlite:///{tmp_path / 's.db'}"), Capacity(max_tokens=3, trim_memory=trim))
    messages = [{"role": "user", "content": "the river is long"}]
    with TestClient(create_app(service, ServeOptions()), raise_server_exceptions=False) as client:
        for _ in range(2):
            res = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
            assert res.status_code == 200, res.text
            messages += [res.json()["choices"][0]["message"], {"role": "user", "content": "and the lake"}]
    assert len(calls) == (2 if trim else 0)


_FAULTS = """
import resource, sys
import torch
from snapkv_sessions import heap
kept = heap.keep_freed() if sys.argv[1] == "keep" else False
block = torch.ones(16 << 20)  # 64 MB: above glibc's largest automatic mmap threshold (32 MB)
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = torch.ones(12 << 20)  # 48 MB, as the next layer's activations: it fits in the freed block
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not heap.available(), reason="the C library is not glibc")
def test_keep_freed_serves_a_freed_block_again_without_faulting_its_pages_in():
    """A prefill frees and allocates large activations in every layer: with the C library's defaults a 48 MB block
    after a freed 64 MB one faults its 12,288 pages in; after keep_freed it is served from the freed block.
    (Not the same size again: an aligned request asks for its alignment more than a freed aligned block holds.)"""
    import subprocess
    import sys

    def second_block_faults(mode: str, env: dict | None = None) -> tuple[bool, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                             env=env, timeout=120).stdout.split()
        return out[0] == "True", int(out[1])

    import os

    kept, faults = second_block_faults("keep")
    assert kept and faults < 1_000, (kept, faults)
    default = second_block_faults("default")
    assert default == (False, default[1]) and default[1] > 12_000  # every page of the block again
    opted_out = second_block_faults("keep", {**os.environ, heap.ENV: "system"})
    assert opted_out[0] is False and opted_out[1] > 12_000


def test_the_command_line_and_the_server_keep_freed_blocks(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from snapkv_sessions.cli import main
    from snapkv_sessions.serve import Service
    from snapkv_sessions.store import SessionStore

    calls = []
    monkeypatch.setattr(heap, "keep_freed", lambda: calls.append(1) or True)
    assert CliRunner().invoke(main, ["resolve", "--help"]).exit_code == 0
    assert calls == [1]
    model = build_tiny("qwen2")
    model.config._name_or_path = "tiny"
    service = Service((model, word_tokenizer()), None, SessionStore(f"sqlite:///{tmp_path / 's.db'}"))
    assert calls == [1, 1] and service.heap_kept is True
