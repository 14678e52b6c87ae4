"""Atomic file writes: temp file in the same directory, fsync, ``os.replace``, fsync the directory.

A crash, kill or full disk never leaves a partial file under the final name; temp files left by
killed writers on this host are removed on the next write to the same path.
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

from trainperf.errors import CheckpointError

_TEMP_SUFFIX = re.compile(r"(?P<host>.*)-(?P<pid>\d+)-[0-9a-f]{8}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot fsync a directory; the rename is still atomic there.
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
    for d in reversed(created):
        _fsync_dir(d.parent)


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
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    entry.unlink()


def _os_error(e: BaseException) -> OSError | None:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    if path.is_dir():
        raise CheckpointError(
            f"cannot save checkpoint to {path}: it is a directory; give a file path such as "
            f"{path / 'checkpoint.pt'}",
            path,
        )
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
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(e, Exception):
            raise
        os_err = _os_error(e)
        if os_err is not None:
            reason = os_err.strerror or str(os_err)
            hint = {
                errno.ENOSPC: "the disk is full: free space or save to another disk",
                errno.EDQUOT: "the disk quota is exhausted: free space or save elsewhere",
                errno.EACCES: "no permission to write there: pick a writable directory",
                errno.EROFS: "the filesystem is read-only: save to a writable disk",
            }.get(os_err.errno or 0, "")
            reason += f" ({hint})" if hint else ""
        else:
            reason = f"the object could not be serialised: {type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not save checkpoint {path}: {reason}; any previous file there is unchanged",
            path,
        ) from e
    try:
        _fsync_dir(path.parent)
    except OSError as e:
        raise CheckpointError(
            f"saved checkpoint {path}, but could not flush its directory to disk "
            f"({e.strerror or e}): after a power loss the old file may reappear",
            path,
        ) from e
