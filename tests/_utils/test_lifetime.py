"""DieWithParent: workers tied to whichever process started them."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from trainperf import DieWithParent
from trainperf._utils.lifetime import WATCHER_NAME, die_with_parent


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
@pytest.mark.parametrize("pickled", [False, True])
def test_workers_forked_by_a_thread_that_ends_live_on(pickled: bool) -> None:
    # Linux's parent-death signal fires when the forking *thread* ends: it killed them.
    # A copy pickled elsewhere (a loader handed to launch's ranks) must not pass on the
    # thread that started the workers of that other pickling.
    init = DieWithParent(None)
    if pickled:
        init = pickle.loads(pickle.dumps(init))
    assert _iterated_in_a_thread_that_ends(init) == 63


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


_PR_GET_PDEATHSIG = 2


def _death_signal() -> int:
    """This process's parent-death signal (0: none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def _grandchild(report: str) -> None:
    """Tie this (just forked) process to its parent, say how, and wait to be ended."""
    die_with_parent(os.getppid())
    watching = any(t.name == WATCHER_NAME for t in threading.enumerate())
    Path(report + ".tmp").write_text(f"{os.getpid()} {_death_signal()} {int(watching)}")
    os.replace(report + ".tmp", report)
    time.sleep(60)
    os._exit(0)


def _fork_grandchild(report: str) -> None:
    if os.fork() == 0:
        _grandchild(report)


def _orphan_maker(report: str, from_thread: bool) -> None:
    """A child that forks a grandchild tied to it (from its main thread, or from another
    thread that stays alive), then waits to be killed."""
    if from_thread:
        threading.Thread(target=lambda: (_fork_grandchild(report), time.sleep(60))).start()
    else:
        _fork_grandchild(report)
    time.sleep(60)


@pytest.mark.slow  # about 1 s each
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
@pytest.mark.parametrize("from_thread", [False, True])
def test_a_child_whose_parent_is_killed_ends_at_once(tmp_path: Path, from_thread: bool) -> None:
    # Forked from the main thread: the parent-death signal. From another thread: no signal
    # (it would fire when that thread ends), and the watcher thread alone must end it.
    report = tmp_path / "grandchild"
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_orphan_maker, args=(str(report), from_thread), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, sig, watching = map(int, report.read_text().split())
        assert (sig, watching) == ((0, 1) if from_thread else (signal.SIGKILL, 0))
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(timeout=10)
        gone = time.monotonic() + 2.0  # the watcher looks every 0.25 s
        while _running(pid) and time.monotonic() < gone:
            time.sleep(0.02)
        assert not _running(pid)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        if report.exists():
            with contextlib.suppress(OSError):
                os.kill(int(report.read_text().split()[0]), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_a_child_whose_parent_died_before_it_looked_exits_at_once() -> None:
    pid = os.fork()
    if pid == 0:
        die_with_parent(2**22 + 12345)  # not its parent, nor its parent's parent
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1


def test_pickling_for_a_spawned_worker_records_the_starting_thread() -> None:
    assert pickle.loads(pickle.dumps(DieWithParent(record))).from_main is True
    got: list[DieWithParent] = []
    t = threading.Thread(target=lambda: got.append(pickle.loads(pickle.dumps(DieWithParent(None)))))
    t.start()
    t.join()
    assert got[0].from_main is False
    assert DieWithParent(None).from_main is None  # not pickled: forked, the hook knows


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init or a subreaper, maybe not soon)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class _Slow:
    """A map dataset of 24 items, 20 ms each: the worker is still at work when signalled."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return i


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("preempting", [True, False])
def test_workers_ignore_the_signal_a_preemption_waits_for(tmp_path: Path, preempting: bool) -> None:
    # torchrun and SLURM send SIGTERM to every process: a torch worker died of it, and the
    # rank's next batch failed before the final save the preemption was waiting to make.
    from trainperf import Checkpointer

    ctx = multiprocessing.get_context("fork")
    loader = DataLoader(
        _Slow(), batch_size=2, num_workers=1, multiprocessing_context=ctx,
        worker_init_fn=DieWithParent(None),
    )  # fmt: skip
    stop = Checkpointer(tmp_path).preemption(signals=("SIGTERM",))
    with stop if preempting else contextlib.nullcontext():
        it = iter(loader)
        got = [next(it)]
        worker = it._workers[0]  # type: ignore[attr-defined]
        os.kill(worker.pid, signal.SIGTERM)
        if preempting:
            got += list(it)
            assert sum(len(b) for b in got) == 24 and not stop.requested  # the rank decides
        else:
            died = r"DataLoader worker .*(killed by signal|exited unexpectedly)"
            with pytest.raises(RuntimeError, match=died):
                got += list(it)


def test_called_in_the_main_process_it_only_calls_the_function_it_wraps(tmp_path: Path) -> None:
    # Before: it started a watcher that ended this process when the shell died, and with a
    # preemption active set SIGTERM to ignored in the training process itself.
    from trainperf import Checkpointer

    assert multiprocessing.parent_process() is None
    called: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path).preemption(signals=("SIGTERM",)):
        inside = signal.getsignal(signal.SIGTERM)
        with pytest.warns(RuntimeWarning, match="called outside a DataLoader worker"):
            DieWithParent(called.append)(3)
        assert signal.getsignal(signal.SIGTERM) == inside != signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == before
    assert called == [3]
    assert not any(t.name == WATCHER_NAME for t in threading.enumerate())


def _call_in_a_rank(tmp_path: Path, queue: multiprocessing.Queue[tuple[Any, ...]]) -> None:
    """A training process started by multiprocessing (as mp.spawn or ddp.launch start ranks)
    that calls DieWithParent itself, with a preemption active; reports what it did."""
    import warnings

    from trainperf import Checkpointer

    called: list[int] = []
    with Checkpointer(tmp_path).preemption(signals=("SIGTERM",)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DieWithParent(called.append)(3)
        ignored = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    watching = any(t.name == WATCHER_NAME for t in threading.enumerate())
    tied = watching or _death_signal() != 0
    queue.put((called, ignored, tied, [str(w.message)[:45] for w in caught]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl are Linux's")
def test_called_in_a_multiprocessing_child_that_is_no_worker_only_calls_its_function(
    tmp_path: Path,
) -> None:
    # Before: a process started by multiprocessing (parent_process() is not None) was taken
    # for a DataLoader worker: a rank calling it tied itself to its launcher and set its
    # preemption's SIGTERM to ignored.
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[Any, ...]] = ctx.Queue()
    child = ctx.Process(target=_call_in_a_rank, args=(tmp_path, queue))
    child.start()
    try:
        called, ignored, tied, warned = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert (called, ignored, tied) == ([3], False, False)
    assert warned == ["DieWithParent was called outside a DataLoader"]
