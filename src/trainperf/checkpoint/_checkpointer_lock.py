"""One writer per :class:`~trainperf.checkpoint.Checkpointer` directory.

Two writers in one directory (a job started again while the first still runs, two configs of a
sweep given the same ``output_dir``, a notebook cell run twice) overwrite each other's step
files, and each one's ``keep=`` deletes the other's. Rank 0 therefore claims the directory at
its first save: an exclusive ``flock`` on the directory itself (no file is added to it), held
while the Checkpointer lives or until its ``with`` block ends (the kernel drops it when the
process dies, however it dies). A writer in another process warns once, naming the holder's
pid where ``/proc/locks`` tells it. In one process the newest Checkpointer takes the claim
over (a notebook cell run again, a resume through a new object); the earlier one warns if it
saves again.

Forked children (the background writer, DataLoader workers) close their copy of the
directory's descriptor, so a claim ends with the Checkpointer that made it, not with the last
child. Where ``flock`` is missing or refused (some network filesystems), nothing is claimed.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from pathlib import Path

from trainperf._utils.stack import user_stacklevel

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["DirectoryClaim"]

# Every claim holding a descriptor, for the fork hook (weak: a dropped Checkpointer's goes).
_OPEN: weakref.WeakSet[DirectoryClaim] = weakref.WeakSet()


class DirectoryClaim:
    """A Checkpointer's claim on its directory, made at its first save (:meth:`claim`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None
        self._pid = os.getpid()  # the process whose descriptor _fd is
        self._told = False
        self._superseded = False  # a newer Checkpointer in this process took the claim over

    def __reduce__(self) -> tuple[type[DirectoryClaim], tuple[Path]]:
        # A copy (deepcopy, pickle into another process) claims nothing yet: the descriptor
        # is this object's, and two owners would close it twice (the second time, whatever
        # file had reused its number).
        return DirectoryClaim, (self.directory,)

    def __del__(self) -> None:
        # At interpreter exit the modules it uses may be gone already.
        with contextlib.suppress(Exception):
            self.release()

    def claim(self) -> None:
        """Hold the directory's lock, or warn (once) naming who holds it."""
        if self._fd is not None or self._told or fcntl is None:
            return
        holder = self._try()
        if holder is None:
            return
        self._told = True
        warnings.warn(
            f"Checkpointer({str(self.directory)!r}): another Checkpointer is saving to "
            f"this directory ({holder}). Two writers in one directory overwrite each "
            "other's step files, and each one's keep= deletes the other's: give each run "
            "its own directory, or save through one Checkpointer",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def _try(self) -> str | None:
        """Take the lock (None), or say who holds it; None too where locks do not work."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None  # the save itself reports an unwritable directory
        try:
            if not self._superseded:
                _take_over(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            return holder
        except OSError:
            os.close(fd)
            return None
        self._fd, self._pid = fd, os.getpid()
        _OPEN.add(self)
        return None

    def release(self) -> None:
        """Give the directory up (closing the descriptor drops the lock)."""
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(fd)


def _take_over(fd: int) -> None:
    """Release an earlier claim in this process on ``fd``'s directory (a notebook cell run
    again, a run resumed through a new Checkpointer): the newest Checkpointer writes; the
    earlier one warns if it saves again (its claim then finds this one's)."""
    st = os.fstat(fd)
    for claim in list(_OPEN):
        if claim._fd is None:
            continue
        with contextlib.suppress(OSError):
            held = os.fstat(claim._fd)
            if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                claim.release()
                claim._superseded = True


def _holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s directory, from ``/proc/locks`` (Linux)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            pid = fields[4]
            if pid == str(os.getpid()):
                return "a newer Checkpointer in this process took the directory over"
            return f"process {pid}" if pid.isdigit() and pid != "-1" else "another process"
    return "another process"


def _close_in_child() -> None:
    """In a forked child: close the inherited descriptors (the parent keeps its claim)."""
    for claim in list(_OPEN):
        fd, claim._fd = claim._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # this process's copy only: the parent's still holds the lock
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
