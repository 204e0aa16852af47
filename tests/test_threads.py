"""Threads that are not the model's run torch's kernels alone (snapkv_sessions.threads): a worker's OpenMP team
slowed every decode step of the model's thread (docs/against-vllm.md)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from snapkv_sessions.serve.worker import Worker
from snapkv_sessions.threads import serial_kernels

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread already: nothing to keep")


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=fn()))
    thread.start()
    thread.join()
    return box["out"]


def test_serial_kernels_changes_the_calling_thread_alone():
    before = torch.get_num_threads()

    def serial() -> tuple[bool, int, float]:
        ok = serial_kernels()
        x = torch.randn(512, 512)
        return ok, torch.get_num_threads(), float((x @ x).sum())  # a parallel-sized op still runs, serially

    ok, inside, _ = _in_thread(serial)
    assert ok and inside == 1
    assert torch.get_num_threads() == before  # this thread keeps its count
    assert _in_thread(torch.get_num_threads) == before  # and a new thread starts with torch's


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_serial_kernels_releases_a_team_the_thread_started():
    """A thread that ran parallel ops keeps its OpenMP team parked; serial_kernels ends that team's threads, so the
    model's thread is the only one whose team counts against the CPUs (a team parked elsewhere made GNU OpenMP
    sleep between every parallel op of the model's step)."""
    x = torch.randn(1024, 1024)

    def run() -> tuple[int, int, int]:
        before = _os_threads()
        for _ in range(3):
            x @ x  # a parallel op: this thread's team starts
        started = _os_threads()
        assert serial_kernels()
        return before, started, _os_threads()

    before, started, after = _in_thread(run)
    assert started == before + torch.get_num_threads() - 1  # the team's threads beside the calling one
    assert after == before  # all of them ended


@pytest.mark.parametrize("serial", [False, True])
def test_a_workers_threads_are_serial_when_asked(serial):
    before = torch.get_num_threads()
    worker = Worker(4, threads=2, serial_kernels=serial)
    try:
        counts = [worker.submit(lambda job: torch.get_num_threads(), 30).future.result(timeout=30) for _ in range(4)]
    finally:
        worker.close()
    assert counts == [1] * 4 if serial else counts == [before] * 4
    assert torch.get_num_threads() == before
