"""trainperf.loader._workers: a pool's workers told from other processes, their private
memory, a worker still dying waited for, and torch's SIGCHLD handler quiet while a failed
pool is stopped."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainperf.loader._workers import child_signals_held, main_private_bytes, sigkilled_workers

MiB = 1 << 20


def test_main_private_bytes_counts_this_processes_memory() -> None:
    before = main_private_bytes()
    block = torch.ones(64 * MiB // 4)  # 64 MiB, every page written
    assert main_private_bytes() >= before + 48 * MiB
    del block


class DyingWorker:
    """A worker process as DataLoader holds it, that is SIGKILLed ``after_s`` from now."""

    def __init__(self, pid: int, after_s: float) -> None:
        self.pid = pid
        self.dies_at = time.monotonic() + after_s

    @property
    def exitcode(self) -> int | None:
        return -signal.SIGKILL if time.monotonic() >= self.dies_at else None


def test_a_worker_still_dying_when_its_socket_resets_is_waited_for() -> None:
    # The main process may see the connection reset before the worker can be waited for.
    it = SimpleNamespace(_workers=[DyingWorker(11, 0.0), DyingWorker(12, 0.2)])
    assert sigkilled_workers(it) == [11]
    it = SimpleNamespace(_workers=[DyingWorker(12, 0.2), DyingWorker(13, 60.0)])
    assert sigkilled_workers(it) == []  # no symptom of a death: no wait
    assert sigkilled_workers(it, ConnectionResetError(104, "reset")) == [12]
    assert sigkilled_workers(SimpleNamespace(), EOFError()) == []  # no workers to wait for


def test_child_signals_are_quiet_while_a_failed_pool_is_stopped() -> None:
    # torch's SIGCHLD handler raises for each worker that dies; while a failed pool is
    # looked at and stopped, more die, and none of that may escape from measure().
    def raising(signum: int, frame: Any) -> None:
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    previous = signal.signal(signal.SIGCHLD, raising)
    try:
        with child_signals_held():
            os.kill(os.getpid(), signal.SIGCHLD)
            time.sleep(0.05)  # the handler would run here
        assert signal.getsignal(signal.SIGCHLD) is raising  # put back
        with pytest.raises(RuntimeError, match="killed by signal"):
            os.kill(os.getpid(), signal.SIGCHLD)
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_process_the_program_starts_while_a_pool_runs_is_not_a_worker() -> None:
    # Before: every new descendant counted as a worker, so closing the pool waited for a
    # subprocess a thread had started meanwhile, then SIGKILLed it.
    import subprocess

    from torch.utils.data import DataLoader

    from trainperf.loader._workers import WorkerProcesses, close_iterator

    workers = WorkerProcesses()
    other = subprocess.Popen(["sleep", "60"])
    try:
        it = iter(DataLoader(list(range(8)), batch_size=2, num_workers=1))
        next(it)
        tracked = {p.pid for p in workers.scan(it)}
        assert tracked == {p.pid for p in it._workers}  # type: ignore[attr-defined]
        close_iterator(it, workers, kill_first=True)
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait()
