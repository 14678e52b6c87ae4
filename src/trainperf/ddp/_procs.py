"""Stopping process trees, naming how a process died, and turning SIGINT/SIGTERM into cleanup.

Each worker leads its own process group, so one ``killpg`` reaches the DataLoader workers
below it even after the worker itself is gone and they were re-parented; a
``psutil`` walk of the descendants covers anything that left the group.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from types import FrameType, TracebackType
from typing import Any

import psutil

__all__ = ["Interrupted", "SignalGuard", "death_summary", "signal_tree", "stop_ending"]

_CRASH_SIGNALS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE"}


def death_summary(exitcode: int) -> str:
    """Say how a process that sent no report ended, from its multiprocessing exit code.

    Example:
        >>> death_summary(-9).split(" (")[0]
        'died from signal SIGKILL without reporting an error'
        >>> death_summary(3)
        'exited with code 3 without reporting an error (os._exit(), or a crash in native code)'
    """
    if exitcode >= 0:
        return (
            f"exited with code {exitcode} without reporting an error "
            "(os._exit(), or a crash in native code)"
        )
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    text = f"died from signal {name} without reporting an error"
    if name == "SIGKILL":
        text += (
            " (SIGKILL is what the out-of-memory killer sends: check `dmesg` and the job's "
            "memory limit; going over host memory kills at once, there is no swap)"
        )
    elif name in _CRASH_SIGNALS:
        text += " (a crash in native code: a C++/CUDA extension, or a library bug)"
    return text


def stop_ending(
    exitcode: int | None, *, killed: bool, reported: str = "", term_grace_s: float = 3.0
) -> tuple[str, bool]:
    """How a rank that was being stopped (SIGTERM, then SIGKILL) ended, and whether that is
    the ending the stop itself causes; a crash or an error code during the grace period is
    not, and is named.

    Args:
        exitcode: its multiprocessing exit code (-N: signal N; None: never reaped).
        killed: it was still running when the grace ran out and was sent SIGKILL.
        reported: the failure it reported while being stopped (its summary), if any.
        term_grace_s: the grace between SIGTERM and SIGKILL, for the text.

    Example:
        >>> stop_ending(-15, killed=False)
        ('stopped by SIGTERM', True)
        >>> stop_ending(3, killed=False)[1], stop_ending(-11, killed=False)[0][:31]
        (False, 'died from signal SIGSEGV (a cra')
    """
    if exitcode is None:
        return "could not be reaped (its exit status is unknown)", False
    if reported:
        return f"{reported} (exit code {exitcode})", False
    if exitcode == -signal.SIGTERM:
        return "stopped by SIGTERM", True
    if exitcode == -signal.SIGKILL and killed:
        return f"killed with SIGKILL (still running {term_grace_s:g} s after SIGTERM)", True
    if exitcode == 0:
        return "exited with code 0 on SIGTERM", True
    return death_summary(exitcode).replace(" without reporting an error", ""), False


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def signal_tree(pid: int, sig: int, *, alive: bool) -> None:
    """Send ``sig`` to a worker, its process group and every descendant still attached.

    Args:
        pid: the worker's pid (also its process group id).
        sig: the signal.
        alive: whether the worker itself has not been reaped yet; a reaped pid may
            already belong to someone else, so only its group (which pins the id) is hit.
    """
    children = _descendants(pid) if alive else []
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    for target in ([pid] if alive else []) + children:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher while workers were running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """While active, SIGINT/SIGTERM raise :class:`Interrupted` (or wait, during cleanup).

    Handlers can only be installed from the main thread; elsewhere the guard does
    nothing and the signal's usual behaviour applies. A signal the program ignores
    (``SIG_IGN``) stays ignored.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self._deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            # A signal between installing the two handlers waits for raise_pending(): raised
            # here, it would skip __exit__ and leave the first handler installed.
            with self.deferred():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    if signal.getsignal(sig) is signal.SIG_IGN:
                        continue
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold signals back while cleanup runs; a second Ctrl-C must not cut it short."""
        previous, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = previous

    def raise_pending(self) -> None:
        """Raise :class:`Interrupted` for a signal that arrived while deferred."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)
