"""Atomic file writes: temp file in the same directory, fsync, ``os.replace``, fsync the directory.

A crash, kill or full disk never leaves a partial file under the final name; temp files left
by killed writers on this host are removed on the next write to the same path. Shared by the
checkpoint writer (which translates failures into ``CheckpointError``) and the DataLoader
tuner's cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["fsync_dir", "write_atomically"]

_TEMP_SUFFIX = re.compile(r"(?P<host>.*)-(?P<pid>\d+)-[0-9a-f]{8}")


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(path: Path, host: str) -> None:
    lead = f".{path.name}.tmp-"
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            m = _TEMP_SUFFIX.fullmatch(entry.name[len(lead) :])
            if not entry.name.startswith(lead) or m is None or m["host"] != host:
                continue
            pid = int(m["pid"])
            # Only a dead writer's temp is stale; a live one (another rank) is mid-write.
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    entry.unlink()


def write_atomically(
    path: Path, write: Callable[[IO[bytes]], None], *, sync_directory: bool = True
) -> None:
    """Write ``path`` through ``write(f)`` so that it is either the old file or the new one.

    ``write`` gets a binary file open on a temp file beside ``path``; the temp file is
    fsynced and renamed over ``path``, then (with ``sync_directory``) the directory is
    fsynced so the rename survives a power loss. Missing parent directories are created.
    On any failure, or an interrupt, the temp file is removed and ``path`` is unchanged.

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
    tmp = path.parent / f".{path.name}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _make_parents(path.parent)
        _remove_stale_temps(path, host)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_directory:
        fsync_dir(path.parent)
