"""Atomic file writes: temp file in the same directory, fsync, ``os.replace``, fsync the directory.

A crash, kill or full disk never leaves a partial file under the final name. Shared by the
checkpoint writer (which translates failures into ``CheckpointError``) and the DataLoader
tuner's cache.

Temp files are named ``.NAME.tmp-HOST-N``: the same few names for every write of ``NAME``
from this host (``N`` is 0 unless several writers of that path run at once), and a writer
holds an exclusive ``flock`` on its temp file until it has been renamed. So a temp file
whose lock nobody holds was left by a killed writer, and the next write of the same path
from this host finds it by name (a few ``open`` calls, never a directory listing: saving
into a directory of 200,000 files costs what saving into an empty one does) and reuses or
removes it; a live writer's (another rank's) keeps its lock and is left alone, and so are
other hosts'. Where the filesystem has no ``flock`` the temp name is unique
(``.NAME.tmp-HOST-PID-RANDOM``) and a killed writer's temp file stays until removed by hand.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["fsync_dir", "temp_name", "write_atomically"]

# After the slot a writer takes, slots are probed for dead writers' temp files until this
# many in a row are absent: a gap this long needs that many writers of one path at once.
_SPARE_SLOTS = 8


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename or a new file in it) to disk.

    Filesystems that cannot fsync a directory are tolerated: the rename is atomic there
    anyway.

    Raises:
        OSError: the directory cannot be opened or flushed.

    Example:
        >>> import tempfile
        >>> fsync_dir(Path(tempfile.mkdtemp()))
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EISDIR):
            raise
    finally:
        os.close(fd)


def _make_parents(directory: Path) -> None:
    created = []
    d = directory
    while not d.exists():
        created.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    # A new directory's own entry must reach the disk too, or the file may vanish with it.
    for d in reversed(created):
        fsync_dir(d.parent)


def temp_name(path: Path, host: str, slot: int) -> Path:
    """The temp file of writer slot ``slot`` for ``path`` on ``host``.

    Example:
        >>> temp_name(Path("runs/last.pt"), "node1", 0).as_posix()
        'runs/.last.pt.tmp-node1-0'
    """
    return path.parent / f".{path.name}.tmp-{host}-{slot}"


class _NoLocks(Exception):
    """The filesystem cannot ``flock``: live and dead writers' temp files look alike."""


def _names_it(fd: int, name: Path) -> bool:
    try:
        st, named = os.fstat(fd), os.lstat(name)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino)


def _open_existing(name: Path) -> int | None:
    try:
        return os.open(name, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:  # gone, another user's, or a planted symlink (ELOOP): not ours
        return None


def _open_slot(name: Path, *, create: bool) -> int | None:
    """An fd on ``name`` holding its exclusive lock, or None: held by a live writer, not
    ours to open, or (``create=False``) absent.

    Every rename or unlink of a slot name is made by the holder of the lock on the file it
    names, so once locked, a name that still names our file stays ours until we close it.

    Raises:
        _NoLocks: the filesystem refuses ``flock`` (a slot file this call made is removed).
        OSError: the slot file cannot be created (a read-only or full filesystem, ...).
    """
    while True:
        made = False
        if not create:
            fd = _open_existing(name)
        else:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
                made = True
            except FileExistsError:
                fd = _open_existing(name)
                if fd is None and not os.path.lexists(name):
                    continue  # renamed or removed between the two opens: free again
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            if made:
                os.unlink(name)
            os.close(fd)
            raise _NoLocks from e
        if _names_it(fd, name):
            return fd
        os.close(fd)  # renamed over its final name, or removed, after we opened it
        if not create:
            return None


def _remove_dead_slots(path: Path, host: str, first: int) -> None:
    """Remove the unlocked (dead writers') temp files of ``path`` from slot ``first`` on,
    until ``_SPARE_SLOTS`` slots in a row are absent. Best effort: a failure is no reason
    to fail the save."""
    absent, slot = 0, first
    with contextlib.suppress(OSError, _NoLocks):
        while absent < _SPARE_SLOTS:
            name = temp_name(path, host, slot)
            if not os.path.lexists(name):
                absent += 1
            else:
                absent = 0
                stale = _open_slot(name, create=False)
                if stale is not None:  # nobody holds it: its writer is dead
                    try:
                        os.unlink(name)
                    finally:
                        os.close(stale)
            slot += 1


def _claim_temp(path: Path, host: str) -> tuple[int, Path]:
    """The lowest free slot's temp file for ``path``, open and locked (it may hold a dead
    writer's partial file: truncate it), after removing dead writers' temp files above it."""
    slot = 0
    while (fd := _open_slot(temp_name(path, host, slot), create=True)) is None:
        slot += 1
    _remove_dead_slots(path, host, slot + 1)
    return fd, temp_name(path, host, slot)


def _open_temp(path: Path, host: str) -> tuple[int, Path, bool]:
    """``(fd, temp path, locked)``: a locked slot, or a unique name where locks fail."""
    try:
        fd, tmp = _claim_temp(path, host)
        return fd, tmp, True
    except _NoLocks:
        tmp = path.parent / f".{path.name}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp, False


def write_atomically(
    path: Path, write: Callable[[IO[bytes]], None], *, sync_directory: bool = True
) -> None:
    """Write ``path`` through ``write(f)`` so that it is either the old file or the new one.

    ``write`` gets a binary file open on a temp file beside ``path``; the temp file is
    fsynced and renamed over ``path``, then (with ``sync_directory``) the directory is
    fsynced so the rename survives a power loss. Missing parent directories are created.
    On any failure, or an interrupt, the temp file is removed and ``path`` is unchanged.
    Temp files of killed writers of ``path`` on this host are reused or removed, found by
    name: the directory is never listed (see the module docstring).

    Args:
        path: the final file name.
        write: writes the content into the file it is given.
        sync_directory: fsync the directory after the rename; False leaves that to the
            caller (:func:`fsync_dir`), which may want to report it differently.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: creating, writing, flushing or renaming failed (``errno`` says why).
        Exception: whatever ``write`` raised, unchanged.

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "sub" / "data.bin"
        >>> write_atomically(p, lambda f: f.write(b"hello"))
        >>> p.read_bytes(), [q.name for q in p.parent.iterdir()]
        (b'hello', ['data.bin'])
    """
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{path} is a directory, not a file name", str(path))
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    _make_parents(path.parent)
    fd, tmp, locked = _open_temp(path, host)
    # The file stays open (so locked) until after the rename: a writer that found the lock
    # free could otherwise take this file while it is being renamed into place.
    with os.fdopen(fd, "wb") as f:
        try:
            os.ftruncate(f.fileno(), 0)  # a reused slot may hold a dead writer's partial file
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if not locked or _names_it(f.fileno(), tmp):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
    if sync_directory:
        fsync_dir(path.parent)
