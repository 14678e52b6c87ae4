"""Processes that die with their parent, as a ``worker_init_fn`` too.

A DataLoader worker whose parent is SIGKILLed (an OOM kill, ``kill -9`` of a launcher, a
scheduler's hard stop) would otherwise live on with ppid 1, holding memory and shared-memory
segments. Every DataLoader trainperf builds wraps its ``worker_init_fn`` in
:class:`DieWithParent`; a DataLoader you build yourself can pass
``worker_init_fn=trainperf.DieWithParent(your_fn)`` (Linux only; elsewhere it only calls
``your_fn``).

How (:func:`die_with_parent`): Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG,
SIGKILL)``) kills the child at once, even while its main thread is stuck in C code; but the
kernel sends it when the *thread* that started the child ends, so it is set only where that
thread is its parent's main thread (a DataLoader iterated from a short-lived thread, or a
checkpoint written from one, would otherwise lose its workers as that thread returns).
Where it is not set, a daemon thread in the child checks every :data:`WATCH_INTERVAL_S`
whether the parent is still there (it cannot run while the child's main thread holds the
GIL in C code). Which thread started the child is recorded in the parent: by an at-fork
hook under ``fork``, by :class:`DieWithParent` when it is pickled for a ``spawn`` or
``forkserver`` worker, and by ``ddp.launch`` for its ranks. Under ``forkserver`` (Linux's
default from Python 3.14) the parent is the fork server, a child of the process that
started the worker, which ends with that process.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from trainperf._utils.procfs import stat_fields

__all__ = [
    "WATCHER_NAME",
    "WATCH_INTERVAL_S",
    "DieWithParent",
    "die_with_parent",
    "preemption_signals",
    "started_from_main",
]

_PR_SET_PDEATHSIG = 1

WATCH_INTERVAL_S = 0.25
"""How often a child without the parent-death signal checks that its parent is alive."""

# The main thread's id, read just before each fork; in the child, whether the thread that
# forked it was that one (it goes on as the child's only thread, with the same id). None:
# not forked from a process that had imported this module.
_main_ident: int | None = None
_forked_from_main: bool | None = None


def _before_fork() -> None:
    global _main_ident
    _main_ident = threading.main_thread().ident


def _after_fork_in_child() -> None:
    global _forked_from_main
    _forked_from_main = threading.get_ident() == _main_ident


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def started_from_main() -> bool:
    """Whether the calling thread is this process's main thread (call it where a child is
    started, and hand the answer to :func:`die_with_parent` in the child)."""
    return threading.current_thread() is threading.main_thread()


def die_with_parent(parent_pid: int, from_main: bool | None = None) -> None:
    """End this process (``os._exit(1)``) when its parent ``parent_pid`` dies; at once if it
    has died already.

    Linux only; elsewhere (macOS) this does nothing.

    Args:
        parent_pid: the process that started this one. Under ``forkserver`` the real
            parent is the fork server, a child of ``parent_pid``: that one is watched.
        from_main: whether the parent's main thread started this process (None: as the
            at-fork hook recorded it, for a forked child; unknown otherwise, which counts
            as not).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if parent != parent_pid and _ppid_of(parent) != parent_pid:
        os._exit(1)  # reparented: the parent died before this process got here
    # A fork's own record is exact (a forkserver's child's too, when the fork server had
    # imported this module: it forks from its main thread); else what the starter said.
    decided = _forked_from_main if _forked_from_main is not None else from_main
    if decided:
        _set_death_signal()
        if os.getppid() != parent:
            os._exit(1)  # it died between the check and prctl: the signal never comes
        return
    try:
        threading.Thread(target=_watch, args=(parent,), name=WATCHER_NAME, daemon=True).start()
    except RuntimeError:  # no thread to be had (a pids limit): the signal, at least
        _set_death_signal()


WATCHER_NAME = "trainperf-die-with-parent"
"""The watcher thread's name (hang reports leave it out)."""


def _ppid_of(pid: int) -> int | None:
    """``pid``'s parent, from ``/proc`` (None if unknown or a zombie)."""
    fields = stat_fields(pid)
    return None if not fields or fields[0] == "Z" else int(fields[1])


def _set_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def _watch(parent: int) -> None:
    """End the process once its parent is no longer ``parent`` (it was reparented)."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)


def preemption_signals() -> tuple[int, ...]:
    """The signals an active ``Checkpointer.preemption()`` in this process waits for (read
    from ``sys.modules``: none where trainperf.checkpoint was never imported)."""
    preempt = sys.modules.get("trainperf.checkpoint._preempt")
    active = getattr(preempt, "active_signals", None)
    return tuple(active()) if callable(active) else ()


_NOT_A_WORKER = (
    "DieWithParent was called outside a DataLoader worker (torch.utils.data.get_worker_info() "
    "is None, as in a main process or a rank): it is a worker_init_fn that ties each worker a "
    "DataLoader starts to the process that started it, and here it would end this process "
    "with its own parent (a shell or launcher) and ignore the signals an active preemption "
    "waits for. It only called the function it wraps; pass it as "
    "DataLoader(..., worker_init_fn=DieWithParent(fn)) instead of calling it."
)


def _in_a_dataloader_worker() -> bool:
    """Whether this process is a DataLoader worker: torch sets the worker's info before it
    calls ``worker_init_fn``. ``multiprocessing.parent_process()`` cannot tell: a rank
    started by ``mp.spawn`` or ``ddp.launch`` has a parent too. A worker has torch loaded."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


class DieWithParent:
    """A DataLoader ``worker_init_fn`` that ties the worker's life to the process that built it.

    It then calls the ``worker_init_fn`` it wraps (if any). Wrapping twice is harmless.
    Called outside a DataLoader worker (a main process, or a rank that ``mp.spawn`` or
    ``ddp.launch`` started: ``torch.utils.data.get_worker_info()`` is None), it only calls
    the function it wraps, with a warning: tying that process to its own parent (a shell or
    launcher) and ignoring its preemption signals would end or deafen the training run.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from trainperf import DieWithParent, worker_init_fn
        >>> init = DieWithParent(worker_init_fn)  # seeds the worker, and it dies with us
        >>> loader = DataLoader(range(4), num_workers=2, worker_init_fn=init)
        >>> init.user_fn is worker_init_fn
        True
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        inner = user_fn.user_fn if isinstance(user_fn, DieWithParent) else user_fn
        self.user_fn: Callable[[int], None] | None = inner
        self.from_main: bool | None = None  # set when pickled for a spawned worker

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (spawn, forkserver) by the thread that starts the worker: record which,
        # and in which process, so that a copy made elsewhere (a loader pickled into a
        # rank, a deepcopy) does not pass the record on to workers started later.
        return {
            **self.__dict__,
            "from_main": started_from_main(),
            "_pid": os.getpid(),
            "_preempt_signals": preemption_signals(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _preemption_signals(self) -> tuple[int, ...]:
        """What the starting process's active preemptions wait for: recorded when this
        copy was pickled for a spawned worker by that process, else (a forked worker)
        read from the copy of its memory."""
        parent = multiprocessing.parent_process()
        if parent is not None and parent.pid == self.__dict__.get("_pid"):
            return tuple(self.__dict__.get("_preempt_signals", ()))
        return preemption_signals()

    def _starter_said(self) -> bool | None:
        """``from_main`` if this copy was pickled by the process that started this one."""
        parent = multiprocessing.parent_process()
        pid = self.__dict__.get("_pid")
        return self.from_main if parent is not None and parent.pid == pid else None

    def __call__(self, worker_id: int) -> None:
        # The parent is whichever process started this worker (the loader may have been built
        # in another one), as multiprocessing recorded it before the parent could die.
        if not _in_a_dataloader_worker():
            warnings.warn(_NOT_A_WORKER, RuntimeWarning, stacklevel=2)
            if self.user_fn is not None:
                self.user_fn(worker_id)
            return
        parent = multiprocessing.parent_process()
        die_with_parent(
            os.getppid() if parent is None or parent.pid is None else parent.pid,
            self._starter_said(),
        )
        # The signals the rank's Checkpointer.preemption() waits for: torchrun and SLURM
        # send them to every process, and a torch worker dies of SIGTERM (failing the
        # rank's next batch before its final save). The rank decides; the worker dies with it.
        for sig in self._preemption_signals():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_IGN)
        if self.user_fn is not None:
            self.user_fn(worker_id)
