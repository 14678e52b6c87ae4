"""The worker processes of DataLoader iterators: found, watched, measured and stopped.

:class:`WorkerProcesses` finds a pool's workers (never multiprocessing's helpers, nor another
process this program starts meanwhile) and reads their CPU demand and memory;
:func:`sigkilled_workers` names those the kernel killed; :func:`child_signals_held` and
:func:`close_iterator` stop a failed pool without torch's SIGCHLD handler raising at any line,
and without the multi-second joins a hung worker would otherwise cost; :func:`pool_start_held`
holds it while a pool starts and :func:`worker_failures` asks later what it would have
raised. Also the CPU demand of the calling thread (:func:`thread_busy_seconds`) and the
private memory of this process (:func:`main_private_bytes`). What a worker's failure means is
:mod:`._faults`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from torch.utils.data._utils import signal_handling

__all__ = [
    "WorkerProcesses",
    "child_signals_held",
    "close_iterator",
    "iterator_worker_pids",
    "main_private_bytes",
    "pool_start_held",
    "sigkilled_workers",
    "thread_busy_seconds",
    "worker_failures",
]

_HELPER_MARKERS = ("resource_tracker", "forkserver", "semaphore_tracker")
USS_READ_LIMIT = 8
"""Workers whose private memory is read: reading one costs a walk of its page tables
(milliseconds for a process holding torch), and the workers of one pool are alike."""


class WorkerProcesses:
    """The worker processes of the DataLoader iterators it is shown (:meth:`scan`):
    multiprocessing helpers excluded, and never another process this program starts
    meanwhile (a subprocess a thread launches while a pool is measured is not killed)."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._before = {p.pid for p in self._me.children()}
        self._procs: dict[int, psutil.Process] = {}
        self._helpers: set[int] = set()
        self.peak_rss = 0

    def scan(self, it: Any = None) -> list[psutil.Process]:
        """Track the workers of the DataLoader iterator ``it`` (from its own list of worker
        processes); without one that lists them, this process's children started since
        construction, less multiprocessing's helpers."""
        pids = iterator_worker_pids(it)
        if pids is not None:
            for pid in pids:
                if pid not in self._procs:
                    with contextlib.suppress(psutil.Error):
                        self._procs[pid] = psutil.Process(pid)
            return list(self._procs.values())
        for p in self._me.children():
            if p.pid in self._before or p.pid in self._procs or p.pid in self._helpers:
                continue
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if any(m in cmd for m in _HELPER_MARKERS):
                self._helpers.add(p.pid)
            else:
                self._procs[p.pid] = p
        return list(self._procs.values())

    def alive(self) -> list[psutil.Process]:
        out = []
        for p in self._procs.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def busy_seconds(self) -> float:
        """CPU demand of all workers' threads so far (see :func:`thread_busy_seconds`)."""
        total = 0.0
        for p in self._procs.values():
            busy = _schedstat_seconds(f"/proc/{p.pid}/task")
            if busy is None:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    busy = t.user + t.system
            total += busy or 0.0
        return total

    def sample_rss(self) -> None:
        total = 0
        for p in self._procs.values():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        self.peak_rss = max(self.peak_rss, total)

    def uss_by_pid(self, limit: int = USS_READ_LIMIT) -> dict[int, int]:
        """Private (unshared) memory of up to ``limit`` workers, in bytes, by pid."""
        out: dict[int, int] = {}
        for p in list(self._procs.values())[:limit]:
            with contextlib.suppress(psutil.Error, AttributeError):
                out[p.pid] = int(p.memory_full_info().uss)
        return out

    def kill(self) -> None:
        for p in self.alive():
            with contextlib.suppress(psutil.Error):
                p.kill()

    def wait_exited(self, timeout: float) -> list[psutil.Process]:
        """Wait (without reaping: multiprocessing does that) until the workers have exited."""
        end = time.monotonic() + timeout
        alive = self.alive()
        while alive and time.monotonic() < end:
            time.sleep(0.02)
            alive = self.alive()
        return alive


def _read_schedstat(path: str) -> float | None:
    try:
        with open(path) as f:
            run_ns, wait_ns, _ = f.read().split()
        return (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return None


def _schedstat_seconds(task_dir: str) -> float | None:
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    found = [_read_schedstat(f"{task_dir}/{tid}/schedstat") for tid in tids]
    values = [v for v in found if v is not None]
    return sum(values) if values else None


def thread_busy_seconds() -> float:
    """CPU demand of the calling thread so far: seconds running plus seconds runnable but
    waiting for a CPU (Linux ``schedstat``; CPU time elsewhere).

    Counting the wait keeps the estimate honest on a busy host: a compute-bound loop that
    other processes crowd off the CPU still demands a whole core, while a loop that sleeps
    on I/O does not.

    Example:
        >>> thread_busy_seconds() >= 0
        True
    """
    busy = _read_schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    return time.thread_time() if busy is None else busy


def main_private_bytes() -> int:
    """Private anonymous memory of this process, in bytes: the most a forked worker can
    copy from it (``RssAnon`` on Linux, else the unique set size, else the RSS).

    Example:
        >>> main_private_bytes() > 0
        True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    me = psutil.Process()
    try:
        return int(me.memory_full_info().uss)
    except (psutil.Error, AttributeError):
        return int(me.memory_info().rss)


_DEATH_SYMPTOMS = (ConnectionError, EOFError)
"""What the main process may see first when a worker dies while sending a batch (the
socket that passes the batch's shared memory closes), before the worker can be waited
for."""


def sigkilled_workers(it: Any, error: BaseException | None = None) -> list[int]:
    """Pids of the DataLoader iterator's workers that ended with SIGKILL (exit code -9).

    When ``error`` is what a worker's death looks like from the main process (a
    connection reset, an end of file: see :data:`_DEATH_SYMPTOMS`), the worker may still
    be dying, so this waits for its exit code for up to a second. Reading ``exitcode``
    reaps a dead worker, which torch's shutdown handles.
    """
    workers = list(getattr(it, "_workers", None) or ())
    end = time.monotonic() + (1.0 if isinstance(error, _DEATH_SYMPTOMS) else 0.0)
    while True:
        out, running = [], 0
        for w in workers:
            with contextlib.suppress(Exception):
                code = w.exitcode
                running += code is None
                if code == -signal.SIGKILL:
                    out.append(int(w.pid))
        if out or not running or time.monotonic() >= end:
            return out
        time.sleep(0.02)


@contextlib.contextmanager
def child_signals_held() -> Iterator[None]:
    """Keep torch's SIGCHLD handler quiet while a failed pool is looked at and stopped.

    That handler raises ``RuntimeError`` in the main thread, at any line, for every worker
    that dies with a failure; after the first (already caught) more follow: the
    out-of-memory killer takes workers one by one, and stopping the pool kills the rest.
    Blocking the signal would not do (another thread of this process takes it, and the
    handler still runs in the main thread), so a handler that does nothing stands in until
    the iterator is shut down; torch's, put back, then finds no worker registered and
    raises nothing. Only the main thread has signal handlers; elsewhere this does nothing.
    """
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, _ignore_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def pool_start_held() -> Iterator[None]:
    """:func:`child_signals_held` while a pool starts (the adaptive loader's on trial, whose
    dead workers it asks about later: :func:`worker_failures`). Torch's handler is set
    first: torch sets it once, as its first pool starts, and one set in the hold would
    replace the quiet handler, then not come back after it."""
    if threading.current_thread() is threading.main_thread():
        signal_handling._set_SIGCHLD_handler()
    with child_signals_held():
        yield


def worker_failures() -> None:
    """Raise torch's "DataLoader worker ... exited unexpectedly" ``RuntimeError`` now for a
    worker that died with a failure, as torch's SIGCHLD handler would have (one held by
    :func:`child_signals_held` did not); nothing where none did, or where torch has no such
    check (Windows).

    Example:
        >>> worker_failures()  # no DataLoader workers at all
    """
    check = getattr(torch._C, "_error_if_any_worker_fails", None)
    if check is not None and hasattr(signal, "SIGCHLD"):
        check()


def _ignore_signal(signum: int, frame: Any) -> None:
    """A Python-level handler that does nothing (not SIG_IGN: that would reap children)."""


def iterator_worker_pids(it: Any) -> list[int] | None:
    """The pids of a multi-process DataLoader iterator's workers (torch keeps them in
    ``_workers``), or None where ``it`` does not list them.

    Example:
        >>> iterator_worker_pids(iter([1, 2])) is None
        True
    """
    procs = getattr(it, "_workers", None)
    if not isinstance(procs, list):
        return None
    pids = [getattr(p, "pid", None) for p in procs]
    return [pid for pid in pids if isinstance(pid, int)]


def close_iterator(it: Any, workers: WorkerProcesses, *, kill_first: bool) -> None:
    """Shut the iterator's workers down; kill hung ones first so the join does not wait."""
    workers.scan(it)
    for _ in range(3):
        try:
            if kill_first:
                workers.kill()
                workers.wait_exited(2.0)
                # torch's SIGCHLD handler raises RuntimeError for the killed workers; let it
                # fire here, inside the try, rather than later in the caller's code.
                time.sleep(0.02)
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            break
        except RuntimeError:
            continue
    # Workers normally exit within milliseconds of the shutdown; anything left is killed
    # (its pids are no longer watched by torch, so this raises nothing).
    if workers.wait_exited(3.0):
        workers.kill()
        workers.wait_exited(2.0)
