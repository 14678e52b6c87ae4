"""Writing a Checkpointer file: now, or in the background, and the handle that reports it.

Two background writers, chosen by where the tensors live:

- ``"process"`` (CPU tensors, Linux): the process forks; the child's memory is a
  copy-on-write snapshot of the state at the moment of ``save`` (the kernel copies a page
  only when the training process writes to it), so nothing is copied up front and the
  training process returns from ``save`` after the fork (tens of milliseconds for a few GB).
  The child runs in a session of its own at a lower CPU and I/O priority
  (:func:`~trainperf.checkpoint._writer_fork.lower_priority`), writes with
  ``torch.save`` under its own GIL, drops the durable file from the page cache, deletes
  what ``keep`` retires, reports through a pipe and exits; it ignores SIGINT and
  SIGTERM (the training process decides when to stop) and is SIGKILLed if the training
  process dies, so a killed job leaves no writer behind
  (:mod:`trainperf.checkpoint._writer_fork`). Only a payload whose snapshot the fork
  copies rather than shares goes this way (:mod:`trainperf.checkpoint._writer_snapshot`).
- ``"thread"`` (accelerator tensors, or no ``fork``): every tensor is copied into reused
  host buffers (pinned for GPU tensors, so the copies are DMA transfers,
  :mod:`trainperf.checkpoint._writer_staging`), then a thread writes them
  (:func:`start_thread`). ``torch.save`` holds the GIL while it writes, so this thread
  slows the training loop's Python while it runs; measured in
  ``benchmarks/checkpoint_bench.py``.

Staging needs host memory (up to one copy of the state):
:func:`~trainperf.checkpoint._writer_staging.staging_fits` checks it against
:func:`trainperf.host_limits` first.

This module holds what both writers share: the atomic write itself (:func:`write_now`,
after :func:`refuse_unloadable`), the :class:`SaveHandle` each save returns, and the
writes still running or failed unreported, for the exit hook.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainperf.checkpoint._files import saving
from trainperf.checkpoint._refusal import save_refusal
from trainperf.checkpoint._wait_notice import wait_telling
from trainperf.checkpoint._write import FLUSH_FAILED_PREFIX, _os_error, write_checkpoint_file
from trainperf.errors import CheckpointError

__all__ = [
    "SaveHandle",
    "background_saves",
    "count_background_save",
    "pending_handles",
    "unreported_failures",
    "drop_cached",
    "start_thread",
    "refuse_unloadable",
    "write_now",
]

# Background writes still running, held strongly: the exit hook waits for them even when
# their Checkpointer is gone. Failed writes nobody has been told of yet, for the same hook.
# No lock (set.add, set.discard, list.append and list.pop are atomic under the GIL): a lock
# held by a reaper thread at a fork would stay held in the child forever.
_PENDING: set[SaveHandle] = set()
_FAILED: list[SaveHandle] = []
_STARTED = [0]  # background writes started in this process (trainperf.watch reads it)


def _forget_parents_writes() -> None:
    """In a forked child: the parent's writes are not this process's to wait for."""
    _PENDING.clear()
    _FAILED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_writes)


def count_background_save() -> None:
    """A background writer was started (its payload accepted, the fork or thread made)."""
    _STARTED[0] += 1


def background_saves() -> int:
    """How many background writes this process has started (``trainperf.watch`` tells a
    loop that already saves in the background from one whose saves block)."""
    return _STARTED[0]


def pending_handles() -> list[SaveHandle]:
    """The background writes of this process not finished yet."""
    return list(_PENDING.copy())


def unreported_failures() -> list[SaveHandle]:
    """Failed background writes whose failure was never raised; each is marked reported."""
    failed = []
    while _FAILED:
        handle = _FAILED.pop(0)
        if not handle._reported:
            handle._reported = True
            failed.append(handle)
    return failed


def write_now(payload: Any, path: Path, *, checked: bool = False) -> None:
    """Write ``payload`` to the Checkpointer step file ``path`` atomically (temp file,
    fsync, rename, fsync dir), once its plain values are known to load back
    (:func:`refuse_unloadable`; ``checked``: the caller did that already).

    Raises:
        CheckpointError: it could not be serialised or written (the cause chained), or a
            value in it is one that loading with ``weights_only=True`` refuses.
    """
    if not checked:
        refuse_unloadable(payload, path)
    write_checkpoint_file(path, lambda f: torch.save(payload, f), step_file=True)


def refuse_unloadable(payload: Any, path: Path) -> None:
    """Raise before anything is written when an entry of ``payload`` holds a plain value
    that cannot be pickled, or that ``Checkpointer.restore`` (``weights_only=True``) would
    refuse: every checkpoint would then fail or be unloadable, and restore would have
    nothing to resume from.

    Raises:
        CheckpointError: which entry, why, and the fix.
    """
    for key, value in payload.items() if isinstance(payload, dict) else ():
        refused = save_refusal(value)
        if refused is not None and refused.unpicklable:
            raise CheckpointError(
                f"not saving {path}: state[{key!r}] holds a value that cannot be pickled "
                f"({refused.reason}); save what rebuilds it instead (numbers, strings, "
                "tensors, its state_dict()) and build it again after restore",
                path,
            )
        if refused is not None:
            raise CheckpointError(
                f"not saving {path}: state[{key!r}] holds a value that restore could never "
                f"load (weights_only=True refuses it: {refused.reason}); save a plain value "
                "instead (an Enum's .value, a torch.Generator's get_state()), or allow its "
                "class with torch.serialization.add_safe_globals([...]) in every run that "
                "saves or restores",
                path,
            )


class SaveHandle:
    """One :meth:`Checkpointer.save`: where it goes and whether it has finished.

    Attributes:
        step: the step saved.
        path: the step's file (on ranks other than 0 under a process group, the file rank 0
            writes); None for a save that ``every`` skipped.
        writer: how it was written: ``"blocking"``, ``"process"`` (a forked writer),
            ``"thread"`` (staged buffers written by a thread), ``"other rank"`` (rank 0
            writes it) or ``"skipped"``.
    """

    def __init__(self, step: int, path: Path | None, writer: str) -> None:
        self.step = step
        self.path = path
        self.writer = writer
        self.notes: list[str] = []
        self._event = threading.Event()
        self._failure: tuple[str, BaseException] | None = None
        self._reported = False
        # Who writes it, for a wait that goes on long to name (_wait_notice): a forked
        # writer's pid, a writer thread's native id; None before it starts or for a foreign one.
        self._pid: int | None = None
        self._thread_id: int | None = None
        self._began = time.monotonic()
        # Taken once (list.pop is atomic under the GIL): by the writer thread as it begins,
        # or by an interrupted save cancelling a writer that has not begun (_take).
        self._turn = [True]
        # True while save() starts its writer: a signal handler run then (in the main thread,
        # inside that save) must not wait for this write, whose writer thread or reaper
        # starts only once the handler returns (_checkpointer_wait).
        self._starting = False

    @classmethod
    def finished(cls, step: int, path: Path | None, writer: str) -> SaveHandle:
        handle = cls(step, path, writer)
        handle._event.set()
        return handle

    def __repr__(self) -> str:
        state = "failed" if self._failure else "done" if self.done() else "writing"
        return f"SaveHandle(step={self.step}, path={str(self.path)!r}, {self.writer}, {state})"

    def _track(self) -> None:
        """Count this write as running until :meth:`_finish` (for the exit hook)."""
        _PENDING.add(self)

    def _untrack(self) -> None:
        _PENDING.discard(self)

    def _take(self) -> bool:
        """Take this write's one turn: True for the first caller (the writer thread, which
        then writes; or a save interrupted while starting it, which so cancels a writer
        that has not begun), False once it was taken."""
        try:
            self._turn.pop()
        except IndexError:
            return False
        return True

    def _finish(self, failure: tuple[str, BaseException] | None, notes: list[str]) -> None:
        if failure is not None and self.path is not None:
            failure = _directory_gone(self.step, self.path, failure)
        self._failure = failure
        self.notes = notes
        if failure is not None:
            _FAILED.append(self)
        _PENDING.discard(self)
        self._event.set()

    def done(self) -> bool:
        """True once the file is durable (or the write failed)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes; 0, negative or NaN: not
        at all, as ``threading.Event.wait``); True if finished.
        A wait that goes on says so on stderr, after a minute and every 5 minutes after, as
        the Checkpointer's own waits do (a stuck writer, a hung filesystem).

        Raises:
            CheckpointError: the background write failed (once: the next ``save`` or
                ``wait`` of the Checkpointer does not raise it again); the cause is chained
                and ``.path`` names the file.
        """
        with saving(self.path):  # known slow work for hang detection, as the Checkpointer's
            finished = wait_telling(self, timeout)
        if finished:
            self.raise_failure()
        return finished

    def raise_failure(self) -> None:
        """Raise the background write's failure if there was one not raised yet."""
        if self._failure is None or self._reported:
            return
        self._reported = True
        message, cause = self._failure
        raise CheckpointError(
            f"the background save of step {self.step} failed: {message}; no older "
            "checkpoint was deleted",
            self.path,
        ) from cause


def _directory_gone(
    step: int, path: Path, failure: tuple[str, BaseException]
) -> tuple[str, BaseException]:
    """``failure``, said of the directory when it is gone (removed or renamed while the save
    ran): the write's own "No such file or directory; any previous file there is unchanged"
    speaks of a file that went with it. Checked now, as the write fails.

    Kept as it is: a failure to flush the directory after the file was renamed into place
    (the file is saved, in the directory under its new name), and a dangling link at or
    above the directory (the write's message names the link and the fix; ``isdir`` is False
    through it too)."""
    message, cause = failure
    os_err = _os_error(cause)
    if (
        os_err is None
        or os_err.errno != errno.ENOENT
        or os.path.isdir(path.parent)
        or message.startswith(FLUSH_FAILED_PREFIX)  # write_checkpoint_file's flush stage
        or "dangling symbolic link" in message
        or _dangling_link_at_or_above(path.parent)
    ):
        return failure
    return (
        f"the checkpoint directory {path.parent} no longer exists (removed or renamed while "
        f"the save ran); nothing was saved for step {step}",
        cause,
    )


def _dangling_link_at_or_above(directory: Path) -> bool:
    """Whether ``directory`` or a path above it is a symbolic link to nothing."""
    return any(os.path.islink(p) and not os.path.exists(p) for p in (directory, *directory.parents))


def drop_cached(path: Path) -> None:
    """Best effort: evict ``path``'s pages (written and fsynced: clean) from the page cache,
    so a checkpoint does not push the training data's cached files out of memory."""
    if not hasattr(os, "posix_fadvise"):
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _refused(payload: Any, path: Path, handle: SaveHandle) -> bool:
    """Whether :func:`refuse_unloadable` refuses ``payload``; if so ``handle`` has failed."""
    try:
        refuse_unloadable(payload, path)
    except CheckpointError as e:
        handle._finish((str(e), e), [])
        return True
    return False


def start_thread(
    payload: Any, path: Path, after: Callable[[], list[str]], handle: SaveHandle
) -> bool:
    """Write the (staged) ``payload`` to ``path`` from a thread; ``after`` as for
    :func:`start_process`. The payload is checked here, in the caller's thread: the check
    widens torch's allow-list while it loads, which another thread's load would see.
    Returns whether a writer started (False: the payload was refused; ``handle`` failed)."""
    if _refused(payload, path, handle):
        return False

    def run() -> None:
        if not handle._take():  # the save was interrupted before this began: cancelled
            return
        try:
            write_now(payload, path, checked=True)
            drop_cached(path)
            handle._finish(None, after())
        except BaseException as e:
            handle._finish((str(e), e), [])

    writer = threading.Thread(target=run, name="trainperf-checkpoint-writer", daemon=True)
    writer.start()
    handle._thread_id = writer.native_id
    return True
