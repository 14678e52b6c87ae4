"""Processes that die with their parent, as a ``worker_init_fn`` too.

A DataLoader worker whose parent is SIGKILLed (an OOM kill, ``kill -9`` of a launcher, a
scheduler's hard stop) would otherwise live on with ppid 1, holding memory and shared-memory
segments. Every DataLoader trainperf builds wraps its ``worker_init_fn`` in
:class:`DieWithParent`; a DataLoader you build yourself can pass
``worker_init_fn=trainperf.DieWithParent(your_fn)`` (Linux only; elsewhere it only calls
``your_fn``).

How (:func:`die_with_parent`): a daemon thread in the child checks every
:data:`WATCH_INTERVAL_S` whether its parent is still the process it started under, and
exits when it is not. Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) is set as
well, but only in a child forked from its parent's main thread: the kernel sends it when
the *thread* that forked the child ends, so a DataLoader iterated from a short-lived thread
(or a checkpoint written from one) would lose its workers as that thread returns. Under the
``forkserver`` start method (Linux's default from Python 3.14) the parent is the fork
server, not the process that started the worker; the fork server ends with that process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["WATCH_INTERVAL_S", "DieWithParent", "die_with_parent"]

_PR_SET_PDEATHSIG = 1

WATCH_INTERVAL_S = 0.25
"""How often a child checks that its parent is alive."""

# Set in the parent just before each fork, inherited by the child: whether the thread that
# forked it is its parent's main thread (None: not forked by this module's process).
_forked_from_main: bool | None = None


def _before_fork() -> None:
    global _forked_from_main
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_parent() -> None:
    global _forked_from_main
    _forked_from_main = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)


def die_with_parent(parent_pid: int) -> None:
    """Exit (``os._exit(1)``) when the parent ``parent_pid`` dies; at once if it has.

    Linux only; elsewhere (macOS) this does nothing. ``parent_pid`` is the process that
    started this one; under ``forkserver`` the real parent is the fork server, which is
    watched instead (it ends with the process that started this one).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if parent != parent_pid and not _alive(parent_pid):
        os._exit(1)  # the parent died before this process got here
    if _forked_from_main:
        _set_death_signal()
    threading.Thread(
        target=_watch, args=(parent,), name="trainperf-die-with-parent", daemon=True
    ).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _set_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def _watch(parent: int) -> None:
    """Exit the process once its parent is no longer ``parent`` (it was reparented)."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)


class DieWithParent:
    """A DataLoader ``worker_init_fn`` that ties the worker's life to the process that built it.

    It then calls the ``worker_init_fn`` it wraps (if any). Wrapping twice is harmless.

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

    def __call__(self, worker_id: int) -> None:
        # The parent is whichever process started this worker (the loader may have been built
        # in another one), as multiprocessing recorded it before the parent could die.
        parent = multiprocessing.parent_process()
        die_with_parent(os.getppid() if parent is None or parent.pid is None else parent.pid)
        if self.user_fn is not None:
            self.user_fn(worker_id)
