"""heap.release gives freed memory back to the system, and the server does it after every turn unless told not to."""

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
