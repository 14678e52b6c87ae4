"""Atomic checkpoint writes: :func:`write_checkpoint_file` runs
:func:`trainperf._utils.atomic.write_atomically` and translates its failures into
:class:`~trainperf.errors.CheckpointError` messages that name the fix.

A crash, kill or full disk never leaves a partial file under the final name; temp files left by
killed writers on this host are removed on the next write to the same path.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from trainperf._utils.atomic import fsync_dir, special_kind_at, write_atomically
from trainperf.errors import CheckpointError

__all__ = ["FLUSH_FAILED_PREFIX", "write_checkpoint_file"]

FLUSH_FAILED_PREFIX = "saved checkpoint "
"""How :func:`write_checkpoint_file`'s error begins when only flushing the directory failed
(the file is in place): the background writer tells that failure from the others by it."""


def _os_error(e: BaseException) -> OSError | None:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# Failures where nothing can be at the path, so "the previous file is unchanged" says nothing.
_NO_PREVIOUS = (errno.ENOTDIR, errno.ELOOP)


def _reason(e: Exception) -> str:
    """Why a write failed, the fix, and what happened to the file that was there."""
    os_err = _os_error(e)
    if os_err is None:
        return (
            f"the object could not be serialised: {type(e).__name__}: {e}; any previous "
            "file there is unchanged"
        )
    reason = os_err.strerror or str(os_err)
    hint = {
        errno.ENOSPC: "the disk is full: free space or save to another disk",
        errno.EDQUOT: "the disk quota is exhausted: free space or save elsewhere",
        errno.EACCES: "no permission to write there: pick a writable directory",
        errno.EROFS: "the filesystem is read-only: save to a writable disk",
        errno.ENOTDIR: "every path above the checkpoint must be a directory: rename or "
        "remove that file, or save somewhere else",
        errno.ELOOP: "point the link at a file, or save to a plain path",
        errno.EMFILE: "too many files are open in this process: close some, or raise the "
        "limit (ulimit -n)",
        errno.ENFILE: "the system's open-file table is full: close files, or raise fs.file-max",
    }.get(os_err.errno or 0, "")
    if "dangling symbolic link" in reason:
        hint = "fix or remove the link, or save somewhere else"
    elif "write-protected" in reason:
        hint = ""  # the reason names the file and the fix already
    reason += f" ({hint})" if hint else ""
    if os_err.errno not in _NO_PREVIOUS and not hint.startswith("fix or remove the link"):
        reason += "; any previous file there is unchanged"
    return reason


def _is_dir(path: Path, step_file: bool) -> str:
    """Why ``path``, a directory (or a link to one), cannot be written, and the fix."""
    if step_file:
        return (
            "it is a directory, and a Checkpointer names its step files itself: remove that "
            "directory, or rename it (nothing was written)"
        )
    return f"it is a directory; give a file path such as {path / 'checkpoint.pt'}"


def _refuse_special_step_file(path: Path) -> None:
    """Refuse a named pipe, socket or device at the step file ``path`` (or at its link's
    target) with a Checkpointer's fix: its user cannot pick another path, as
    ``write_atomically``'s refusal of it says to.

    Raises:
        CheckpointError: it is one; it is left as it is.
    """
    kind = special_kind_at(path)  # None also when nothing is there: the write says so
    if kind is not None:
        raise CheckpointError(
            f"cannot save checkpoint to {path}: it is {kind}, not a regular file, and a "
            "Checkpointer names its step files itself: remove that file, or rename it "
            "(nothing was written, and it is left as it is)",
            path,
        )


def write_checkpoint_file(
    path: Path, write: Callable[[IO[bytes]], None], *, step_file: bool = False
) -> None:
    """Write ``path`` atomically through ``write(f)``, then flush its directory.

    A symbolic link is written through (its target is replaced; the link stays).

    Args:
        path: the checkpoint file.
        write: writes the serialised checkpoint into the binary file it is given.
        step_file: ``path`` is a Checkpointer's step file, named by the Checkpointer, not
            by the user: a directory, named pipe, socket or device in its place is to be
            moved, not the path changed.

    Raises:
        CheckpointError: ``path`` is a directory, the write failed (disk full, no permission,
            read-only filesystem, an existing file at ``path`` that is write-protected, or a
            named pipe, socket or device there, left as it is: the message says which, and
            that any earlier file is unchanged), a parent path is
            a file or a dangling link, ``path`` is a loop of links, ``write`` raised (the
            object could not be serialised), or the directory could not be flushed; the
            cause is chained.
    """
    # Not path.is_dir(): it raises a bare PermissionError where a directory above cannot be
    # searched, which the write below reports with the fix.
    if os.path.isdir(path):
        raise CheckpointError(f"cannot save checkpoint to {path}: {_is_dir(path, step_file)}", path)
    if step_file:
        _refuse_special_step_file(path)
    try:
        written = write_atomically(path, write, sync_directory=False)
    except Exception as e:
        raise CheckpointError(f"could not save checkpoint {path}: {_reason(e)}", path) from e
    try:
        fsync_dir(written.parent)
    except OSError as e:
        raise CheckpointError(
            f"{FLUSH_FAILED_PREFIX}{path}, but could not flush its directory to disk "
            f"({e.strerror or e}): after a power loss the old file may reappear",
            path,
        ) from e
