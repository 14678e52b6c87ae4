"""The hang detector's run directory (under ``/dev/shm``), and removing those left by
launchers that died without cleaning up (SIGKILL, the out-of-memory killer).

``/dev/shm`` may be shared with other containers on the host (``--ipc=host``) or, for the
``tempfile`` fallback, with other machines; a process id says nothing across pid
namespaces and may have been reused. So each directory holds an owner record
(:data:`OWNER_FILE`: the launcher's pid, its start time from field 22 of
``/proc/<pid>/stat``, the boot id, the pid namespace, the host name and the creation time),
and :func:`stale` removes a directory only when its launcher is certainly gone:

- the directory belongs to this user (and is a real directory, not a link);
- it was made on this host and either in an earlier boot (made before this boot began), or
  in this pid namespace by a process that no longer exists or whose pid now belongs to a
  process with another start time (a reused pid);
- a directory from another host, another boot id made after this boot began (another
  machine), or another pid namespace (another container) is left alone: its launcher's
  liveness cannot be seen from here.

A directory without an owner record (a launcher killed within microseconds of creating it,
or an older trainperf) is removed once it is :data:`ORPHAN_AGE_S` old.

The launcher also holds an exclusive ``flock`` on its owner record for its whole life (the
kernel drops it when the process dies, however it dies), and :func:`remove_stale` first
tries that lock without waiting: a directory whose lock is held is never removed. Locks
work across pid namespaces on one kernel, so a record that says it is locked (``locked``)
and whose lock is free, made in this boot (same boot id: the same kernel, whatever the
container or its host name), is stale even from another container.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from trainperf._utils.procfs import stat_fields

__all__ = [
    "ORPHAN_AGE_S",
    "OWNER_FILE",
    "PREFIX",
    "Owner",
    "create",
    "process_start",
    "release",
    "remove_stale",
    "stale",
    "this_process",
]

PREFIX = "trainperf-hang-"
OWNER_FILE = "owner.json"
# A directory with no owner record is removed once it is this old (seconds).
ORPHAN_AGE_S = 24 * 3600.0


@dataclass(frozen=True)
class Owner:
    """Who made a run directory, and enough to tell later whether it is still alive."""

    pid: int
    start: int  # the process's start time: /proc/<pid>/stat field 22 (ticks after boot)
    boot_id: str  # /proc/sys/kernel/random/boot_id
    pid_ns: str  # readlink /proc/self/ns/pid ("pid:[4026531836]")
    host: str
    created: float  # time.time()
    locked: bool = False  # its launcher holds a flock on the record (older records: no)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def process_start(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (the start time), or None if no such process.

    Example:
        >>> process_start(os.getpid()) == process_start(os.getpid()) is not None
        True
        >>> process_start(2**22 + 1) is None  # above Linux's pid_max
        True
    """
    fields = stat_fields(pid, proc)
    try:
        return None if fields is None else int(fields[19])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _boot_time(proc: str = "/proc") -> float:
    match = re.search(r"^btime (\d+)$", _read(f"{proc}/stat"), re.MULTILINE)
    return float(match[1]) if match else 0.0


def this_process() -> Owner:
    """The owner record for this process (empty fields where ``/proc`` says nothing)."""
    pid_ns = ""
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    return Owner(
        pid=os.getpid(),
        start=process_start(os.getpid()) or 0,
        boot_id=_read("/proc/sys/kernel/random/boot_id").strip(),
        pid_ns=pid_ns,
        host=socket.gethostname(),
        created=time.time(),
        locked=True,
    )


def stale(
    owner: Owner | None,
    me: Owner,
    start_of: Callable[[int], int | None],
    *,
    boot_time: float,
    age_s: float,
    unlocked: bool = True,
) -> bool:
    """Whether a run directory's launcher is certainly gone (the rules in the module doc).

    Args:
        owner: the directory's owner record; None when it has none (or it is unreadable).
        me: this process's record (:func:`this_process`).
        start_of: a pid's start time now (:func:`process_start`), None if it does not exist.
        boot_time: when this boot began (``time.time()`` scale).
        age_s: the directory's age, from its modification time.
        unlocked: whether the record's flock could be taken now (a held lock: alive).

    Example:
        >>> me = Owner(10, 500, "boot-a", "pid:[1]", "node1", 2000.0)
        >>> dead = Owner(42, 300, "boot-a", "pid:[1]", "node1", 1900.0)
        >>> stale(dead, me, lambda pid: None, boot_time=1000.0, age_s=100.0)  # pid gone
        True
        >>> stale(dead, me, lambda pid: 300, boot_time=1000.0, age_s=100.0)  # still alive
        False
        >>> stale(dead, me, lambda pid: 777, boot_time=1000.0, age_s=100.0)  # pid reused
        True
        >>> other = Owner(42, 300, "boot-a", "pid:[2]", "box2", 1900.0, locked=True)
        >>> stale(other, me, lambda pid: 300, boot_time=1000.0, age_s=100.0)  # lock free
        True
        >>> stale(other, me, lambda pid: None, boot_time=1000.0, age_s=100.0, unlocked=False)
        False
    """
    if not unlocked:
        return False  # its launcher (or a rank it forked) holds the lock: alive
    if owner is None:
        return age_s > ORPHAN_AGE_S
    if owner.locked and owner.boot_id and owner.boot_id == me.boot_id:
        return True  # this kernel's lock is free: its holder is gone, in any container
    if not owner.boot_id or not me.boot_id or owner.host != me.host:
        return False  # another machine's, or nothing to judge by
    if owner.boot_id != me.boot_id:
        # Made before this boot began: a launcher of an earlier boot. Made since: another
        # machine that shares this directory and this host name.
        return 0 < owner.created < boot_time
    if owner.pid_ns != me.pid_ns or not owner.start:
        return False  # another container: its pids are not visible here
    return start_of(owner.pid) != owner.start


def _owner(path: Path) -> Owner | None:
    try:
        data = json.loads((path / OWNER_FILE).read_text())
        return Owner(**data)
    except (OSError, ValueError, TypeError):
        return None


def _ours(path: Path) -> bool:
    """A real directory (not a link to one) that belongs to this user."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _unlocked(path: Path) -> bool:
    """Whether the owner record's flock is free now (or there is no record to lock)."""
    try:
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the lock if it was taken
    return True


def remove_stale(base: str | None) -> list[Path]:
    """Remove the run directories under ``base`` whose launcher is certainly gone."""
    root = Path(base or tempfile.gettempdir())
    me = this_process()
    boot = _boot_time()
    removed = []
    for path in root.glob(f"{PREFIX}*"):
        if not _ours(path):
            continue
        with contextlib.suppress(OSError):
            age = time.time() - path.lstat().st_mtime
            free = _unlocked(path)
            if stale(_owner(path), me, process_start, boot_time=boot, age_s=age, unlocked=free):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# The open owner records whose flock this process holds, by run directory.
_held: dict[Path, int] = {}


def create(base: str | None) -> Path:
    """A new run directory under ``base`` (``tempfile``'s default if None), with this
    process's owner record in it, locked until :func:`release` (or this process's end)."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
    record = path / f".{OWNER_FILE}.tmp"
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Locked before it has its name: no one ever sees the record with its lock free.
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(asdict(this_process())).encode())
        record.replace(path / OWNER_FILE)
    except BaseException:
        os.close(fd)
        raise
    _held[path] = fd
    return path


def release(path: Path) -> None:
    """Drop the lock :func:`create` took on ``path``'s owner record (its directory is gone,
    or about to be)."""
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)
