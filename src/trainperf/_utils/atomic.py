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

A path that is a symbolic link is written *through*, as ``open()`` and ``torch.save`` do:
the chain of links is followed to the file at its end, the temp file goes beside that file
(same directory, so the rename stays atomic) and is renamed onto it, and the links stay
links. A dangling link creates the file it points to. A parent path that is a regular file
is reported as such (``NotADirectoryError`` naming it), not as ``File exists``.

An existing file that is write-protected (no write bit, ``chmod 444``, or not writable by
this user) is refused with ``PermissionError``: the rename needs only the directory's
permission and would replace it silently, where ``open(path, "w")`` refuses. So is a named
pipe, socket or device at the path (``FileExistsError``), which ``open`` would write into.
Nothing that is not a regular file is ever opened by its temp name either (a named pipe
opened to be written waits for a reader).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = [
    "fsync_dir",
    "link_target",
    "remove_dead_temp",
    "special_kind",
    "special_kind_at",
    "temp_name",
    "write_atomically",
]

# After the slot a writer takes, slots are probed for dead writers' temp files until this
# many in a row are absent: a gap this long needs that many writers of one path at once.
_SPARE_SLOTS = 8
# Linux's own limit on links followed in one path lookup (MAXSYMLINKS).
_MAX_LINKS = 40


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
    """``mkdir -p directory``, fsyncing each new entry.

    Raises:
        NotADirectoryError: a path above the file is a regular file (named in the message).
        FileNotFoundError: a path above the file is a dangling symbolic link.
        OSError: a directory cannot be created.
    """
    created = []
    d = directory
    while not d.exists():
        if os.path.lexists(d):
            raise FileNotFoundError(
                errno.ENOENT,
                f"{d} is a dangling symbolic link (to {os.readlink(d)!r}), not a directory",
                str(d),
            )
        created.append(d)
        d = d.parent
    if not d.is_dir():
        # mkdir would say "File exists" about the directory it was asked for, hiding which
        # component is the file.
        raise NotADirectoryError(errno.ENOTDIR, f"{d} is a file, not a directory", str(d))
    directory.mkdir(parents=True, exist_ok=True)
    # A new directory's own entry must reach the disk too, or the file may vanish with it.
    for d in reversed(created):
        fsync_dir(d.parent)


def link_target(path: Path) -> Path:
    """The file that writing ``path`` replaces: ``path`` itself, or for a symbolic link the
    path at the end of its chain of links (which need not exist: a dangling link).

    Relative links are read relative to the directory that holds them, as the kernel does.

    Raises:
        OSError: ``ELOOP``: the links form a loop (or a chain longer than Linux follows).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> (d / "latest.pt").symlink_to("step100.pt")
        >>> link_target(d / "latest.pt") == d / "step100.pt"
        True
    """
    start = path
    for _ in range(_MAX_LINKS):
        if not os.path.islink(path):
            return path
        path = path.parent / os.readlink(path)  # an absolute link replaces the whole path
    raise OSError(
        errno.ELOOP,
        f"{start} is a symbolic link that leads to itself (a loop of links, or more than "
        f"{_MAX_LINKS} in a row)",
        str(start),
    )


def temp_name(path: Path, host: str, slot: int) -> Path:
    """The temp file of writer slot ``slot`` for ``path`` on ``host``.

    Example:
        >>> temp_name(Path("runs/last.pt"), "node1", 0).as_posix()
        'runs/.last.pt.tmp-node1-0'
    """
    return path.parent / f".{_short(path.name, host)}.tmp-{host}-{slot}"


_NAME_MAX = 255  # bytes in one path component on Linux filesystems
_TAIL = 40  # room kept for ".", ".tmp-", "-SLOT" or "-PID-RANDOM" (23 bytes) beside HOST


def _short(name: str, host: str) -> str:
    """``name`` as the temp file's stem: whole when the temp name fits in a path component,
    else cut and ended with a hash of the whole name (still one name per path).

    Example:
        >>> _short("last.pt", "node1")
        'last.pt'
        >>> len(_short("x" * 250 + ".pt", "node1").encode())
        210
    """
    room = max(32, _NAME_MAX - _TAIL - len(host.encode()))
    if len(name.encode()) <= room:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:12]
    cut = name.encode()[: room - len(digest) - 1].decode(errors="ignore")
    return f"{cut}~{digest}"


class _NoLocks(Exception):
    """The filesystem cannot ``flock``: live and dead writers' temp files look alike."""


def _names_it(fd: int, name: Path) -> bool:
    try:
        st, named = os.fstat(fd), os.lstat(name)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino)


def _open_existing(name: Path) -> int | None:
    """An fd on the existing regular file ``name``, or None. Anything else with a temp
    name is not ours and is never opened: a named pipe opened write-only would wait for a
    reader, a device would be written."""
    try:
        if not stat.S_ISREG(os.lstat(name).st_mode):
            return None
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


def remove_dead_temp(name: Path) -> bool:
    """Remove ``name``, a temp file of :func:`write_atomically`, if its writer is dead (nobody
    holds its lock); True if it was removed.

    A live writer's file (locked), a file that is gone, not ours to open, not a regular file
    (a named pipe, a socket, a device: never opened), or on a filesystem without ``flock``
    is left alone (False). Only call it on temp files of this host: a lock
    held on another host may not be visible here.

    Example:
        >>> import tempfile
        >>> stale = Path(tempfile.mkdtemp()) / ".c.pt.tmp-host-0"
        >>> _ = stale.write_bytes(b"half")
        >>> remove_dead_temp(stale), stale.exists()
        (True, False)
    """
    try:
        fd = _open_slot(name, create=False)
    except (OSError, _NoLocks):
        return False
    if fd is None:
        return False
    try:
        os.unlink(name)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
        stem = _short(path.name, host)
        tmp = path.parent / f".{stem}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp, False


def _refuse_write_protected(path: Path, named: Path) -> None:
    """Refuse to replace ``path``, an existing file its owner made read-only (``chmod 444``)
    or that this user may not write: ``os.replace`` needs only the directory's permission,
    so it would swap such a file silently where ``open(path, "w")`` fails. The mode bits are
    checked as well as ``os.access``, which says yes to root whatever the bits say.

    Raises:
        PermissionError: ``EACCES``, naming ``path`` (and the link ``named``) and the fix.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # nothing there yet (a new file), or a parent that is not a directory: the
        # write reports that itself
    if not stat.S_ISREG(mode):
        return  # not a regular file: left to the rename to take or refuse
    if mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) and os.access(path, os.W_OK):
        return
    via = f" (the target of the link {named})" if named != path else ""
    raise PermissionError(
        errno.EACCES,
        f"{path}{via} is write-protected (mode {stat.filemode(mode)}), so it is not replaced: "
        f"make it writable (chmod u+w {path}) if it may be overwritten, or save to another path",
        str(path),
    )


# What a path that is neither a regular file nor a directory is: never replaced.
_SPECIAL = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def special_kind(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is when it is a named pipe, socket or device
    (opening it waits on another process or reads a device); None for a regular file, a
    directory or a link.

    Example:
        >>> special_kind(stat.S_IFIFO | 0o644), special_kind(stat.S_IFREG | 0o644)
        ('a named pipe (FIFO)', None)
    """
    return _SPECIAL.get(stat.S_IFMT(mode))


def special_kind_at(path: Path) -> str | None:
    """:func:`special_kind` of the file at ``path`` (a link followed); None when ``path``
    cannot be stat'ed (nothing there yet, or a parent that is not a directory: the write
    that follows says so).

    Example:
        >>> special_kind_at(Path("/no/such/file")) is None
        True
    """
    try:
        return special_kind(os.stat(path).st_mode)
    except OSError:
        return None


def _refuse_special(path: Path, named: Path) -> None:
    """Refuse to replace ``path`` when it is a named pipe, socket or device: the rename would
    swap it for a regular file without a word (as root, ``/dev/null`` itself), where
    ``open(path, "w")`` writes into it.

    Raises:
        FileExistsError: ``EEXIST``, naming ``path`` (and the link ``named``), what it is
            and the fix.
    """
    kind = special_kind_at(path)
    if kind is not None:
        via = f" (the target of the link {named})" if named != path else ""
        raise FileExistsError(
            errno.EEXIST,
            f"{path}{via} is {kind}, not a regular file, so it is not replaced: save to a "
            "regular file's path",
            str(path),
        )


def write_atomically(
    path: Path,
    write: Callable[[IO[bytes]], None],
    *,
    sync_directory: bool = True,
    keep_write_protected: bool = True,
) -> Path:
    """Write ``path`` through ``write(f)`` so that it is either the old file or the new one.

    ``write`` gets a binary file open on a temp file beside ``path``; the temp file is
    fsynced and renamed over ``path``, then (with ``sync_directory``) the directory is
    fsynced so the rename survives a power loss. Missing parent directories are created
    (not those of a link's target).
    An existing file that is write-protected is refused, not replaced.
    On any failure, or an interrupt, the temp file is removed and ``path`` is unchanged.
    Temp files of killed writers of ``path`` on this host are reused or removed, found by
    name: the directory is never listed (see the module docstring). A symbolic link is
    written through: the file at the end of its chain is replaced, the link stays.

    Args:
        path: the final file name.
        write: writes the content into the file it is given.
        sync_directory: fsync the directory after the rename; False leaves that to the
            caller (:func:`fsync_dir`), which may want to report it differently.
        keep_write_protected: refuse to replace an existing write-protected file (what a
            user saved and protected); False for files the library alone rewrites (a
            cache, a report), which a umask without the owner's write bit makes read-only
            from their first write.

    Returns:
        The file that was replaced: ``path``, or the target of the link ``path`` is.

    Raises:
        IsADirectoryError: ``path`` is a directory (or a link to one).
        FileExistsError: ``path`` (or the file a link leads to) is a named pipe, a socket or
            a device: the rename would replace it with a regular file, so it is left as it
            is.
        PermissionError: with ``keep_write_protected``, ``path`` (or the file a link leads
            to) exists and is write-protected:
            no write bit in its mode (``chmod 444``; so also under root), or ``os.access``
            says this user may not write it. ``os.replace`` would swap it anyway; it is left
            unchanged, as ``open(path, "w")`` would leave it.
        NotADirectoryError: a path above it is a regular file (the message names it).
        FileNotFoundError: ``path`` is a symbolic link whose target's directory is missing
            (the message names the link and the target).
        OSError: creating, writing, flushing or renaming failed (``errno`` says why), or
            ``path`` is a loop of symbolic links (``ELOOP``).
        Exception: whatever ``write`` raised, unchanged.

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "sub" / "data.bin"
        >>> write_atomically(p, lambda f: f.write(b"hello")) == p
        True
        >>> p.read_bytes(), [q.name for q in p.parent.iterdir()]
        (b'hello', ['data.bin'])
    """
    link, path = path, link_target(path)
    if path != link and not path.parent.is_dir():
        # Only the link's target file is created, never its directories: a link into a
        # purged scratch directory must not quietly rebuild it.
        raise FileNotFoundError(
            errno.ENOENT,
            f"{link} is a symbolic link to {path}, whose directory {path.parent} does not "
            "exist (or is not a directory): create it, point the link elsewhere, or remove "
            "the link",
            str(link),
        )
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{path} is a directory, not a file name", str(path))
    _refuse_special(path, link)
    if keep_write_protected:
        _refuse_write_protected(path, link)
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
    return path
