"""DieWithParent: workers tied to whichever process started them."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from trainperf import DieWithParent
from trainperf._utils.lifetime import die_with_parent


def record(worker_id: int) -> None:
    """A caller's worker_init_fn (module level: picklable)."""


def test_wrapping_keeps_the_callers_function_once_and_pickles() -> None:
    twice = DieWithParent(DieWithParent(record))
    assert twice.user_fn is record
    assert pickle.loads(pickle.dumps(twice)).user_fn is record
    assert DieWithParent(None).user_fn is None


def _iterate(loader: DataLoader[int], queue: multiprocessing.Queue[list[int]]) -> None:
    queue.put(sorted(int(x) for batch in loader for x in batch))


@pytest.mark.slow  # about 1 s: a child process starts two workers
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_a_loader_built_here_and_iterated_in_a_child_keeps_its_workers() -> None:
    # The workers' parent is the child, not this process: they must not think it died.
    loader = DataLoader(range(8), batch_size=2, num_workers=2, worker_init_fn=DieWithParent(None))
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[list[int]] = ctx.Queue()
    child = ctx.Process(target=_iterate, args=(loader, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == list(range(8))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def _iterated_in_a_thread_that_ends(init: DieWithParent) -> int:
    loader = DataLoader(range(64), batch_size=1, num_workers=2, worker_init_fn=init,
                        persistent_workers=True)  # fmt: skip
    holder: dict[str, Iterator[Any]] = {}

    def start() -> None:
        holder["it"] = iter(loader)
        next(holder["it"])

    t = threading.Thread(target=start)
    t.start()
    t.join()
    time.sleep(1.0)  # the thread that forked the workers is gone
    return sum(1 for _ in holder["it"])


@pytest.mark.slow  # about 2 s: two workers start
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_workers_forked_by_a_thread_that_ends_live_on() -> None:
    # Linux's parent-death signal fires when the forking *thread* ends: it killed them.
    assert _iterated_in_a_thread_that_ends(DieWithParent(None)) == 63


_FORK_SERVER = """
from torch.utils.data import DataLoader
from trainperf import DieWithParent
if __name__ == "__main__":
    loader = DataLoader(range(8), batch_size=2, num_workers=2,
                        worker_init_fn=DieWithParent(None), multiprocessing_context="forkserver")
    print(sorted(int(x) for batch in loader for x in batch))
"""


@pytest.mark.slow  # about 5 s: a Python process, its fork server, then two workers
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_workers_started_by_a_fork_server_live_on(tmp_path: Path) -> None:
    # Their parent is the fork server, not the process that started them (Python 3.14's
    # default start method on Linux): they took the fork server for a dead parent. In a
    # process of its own: the fork server lives as long as the process that started it.
    script = tmp_path / "forkserver_loader.py"
    script.write_text(_FORK_SERVER)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(list(range(8)))


def _orphan_maker(pid_file: str) -> None:
    """A child that forks a grandchild tied to it, then waits to be killed."""
    pid = os.fork()
    if pid == 0:
        die_with_parent(os.getppid())
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(60)
        os._exit(0)
    time.sleep(60)


@pytest.mark.slow  # about 1 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_a_child_whose_parent_is_killed_exits_within_a_second(tmp_path: Path) -> None:
    # Started from a thread, so that the grandchild has no parent-death signal: the
    # watcher alone must end it.
    pid_file = tmp_path / "grandchild"
    ctx = multiprocessing.get_context("fork")
    holder: list[BaseProcess] = []
    starter = threading.Thread(target=lambda: holder.append(_start(ctx, str(pid_file))))
    starter.start()
    starter.join()
    (child,) = holder
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(timeout=10)
        gone = time.monotonic() + 10
        while _running(grandchild) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not _running(grandchild)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        if pid_file.exists():
            with contextlib.suppress(OSError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _start(ctx: Any, pid_file: str) -> BaseProcess:
    p = ctx.Process(target=_orphan_maker, args=(pid_file,), daemon=True)
    p.start()
    return p


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init or a subreaper, maybe not soon)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
