"""Processes that die with their parent: the parent-death signal, as a ``worker_init_fn`` too.

A DataLoader worker whose parent is SIGKILLed (an OOM kill, ``kill -9`` of a launcher, a
scheduler's hard stop) would otherwise live on with ppid 1, holding memory and shared-memory
segments. Every DataLoader trainperf builds wraps its ``worker_init_fn`` in
:class:`DieWithParent`; a DataLoader you build yourself can pass
``worker_init_fn=trainperf.DieWithParent(your_fn)`` (Linux only; elsewhere it only calls
``your_fn``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["DieWithParent", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit if it already has.

    The parent can die between ``fork`` and ``prctl``; the signal is then never sent, so
    the parent pid is checked afterwards. Elsewhere (macOS) this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
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
