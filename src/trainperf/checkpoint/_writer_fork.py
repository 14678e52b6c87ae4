"""The ``"process"`` background writer: a forked child writes the copy-on-write snapshot of
the payload (:func:`start_process`), at a lower CPU and I/O priority in a session of its own
(:func:`lower_priority`), deaf to the signals that stop training and killed if the training
process dies; it reports through a pipe that a reaper thread reads (:func:`_reap`), and a
failure comes back as its message and root cause (:func:`_failure_record`), success as the
notes of retention and what it read of the step files (:mod:`._held`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainperf._utils.fds import readable
from trainperf._utils.lifetime import die_with_parent
from trainperf.checkpoint._held import known, learn
from trainperf.checkpoint._steps import remove_dead_temps
from trainperf.checkpoint._writer import SaveHandle, _refused, drop_cached, write_now

__all__ = ["fork_writes", "lower_priority", "start_process"]

# A lower priority than the training process, not the lowest: at 19 a busy host (other
# jobs at 0) would starve the writer, and the next save waits for it.
_NICE = 10
# The writer's I/O priority: the best-effort class (the training process's), its lowest
# level. Not the idle class, which a disk kept busy by others (a data loader) would starve.
_IOPRIO_CLASS_BE, _IOPRIO_LEVEL = 2, 7
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}  # syscall numbers
_QUIET = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"))


def fork_writes() -> bool:
    """Whether background writes can use a forked process here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _failure_record(e: BaseException) -> dict[str, Any]:
    """What the parent needs to rebuild the failure: the message, and the root cause (the
    OSError with its errno, or the serialisation error)."""
    chain: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    os_err = next((c for c in chain if isinstance(c, OSError)), None)
    root = os_err or chain[min(1, len(chain) - 1)]
    return {
        "ok": False,
        "message": str(e),
        "type": type(root).__name__,
        "cause": str(root),
        "errno": os_err.errno if os_err else None,
        "strerror": os_err.strerror if os_err else None,
        "filename": os_err.filename if os_err else None,
    }


def _send(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    with contextlib.suppress(OSError):  # the training process is gone: nobody to tell
        while data:
            data = data[os.write(fd, data) :]


def lower_priority() -> None:
    """Best effort: this process's CPU priority (nice, and the batch policy: its wake-ups do
    not preempt the loop) and I/O priority below the training process's, so the writer
    takes what the loop leaves.

    It also starts a session of its own: where the kernel groups processes by session for
    CPU shares (autogroup, on by default in most distributions' kernels), a writer in the
    training process's session splits that session's share with the loop whatever its nice
    value, so a host loaded by other jobs takes the writer's CPU out of the loop. In its own
    session, at the same nice value for the session, it competes with every job alike.
    Parent death still ends it (:func:`~trainperf._utils.lifetime.die_with_parent`: the
    signal survives ``setsid``, and the watcher thread checks the parent, not the session).
    """
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(_NICE))
    with contextlib.suppress(OSError):
        os.nice(_NICE)
    if hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    number = _IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # ioprio_set(IOPRIO_WHO_PROCESS, 0 = this process, class << 13 | level)
        libc.syscall(number, 1, 0, (_IOPRIO_CLASS_BE << 13) | _IOPRIO_LEVEL)
    except (OSError, AttributeError):  # no libc symbol, a seccomp filter: the default stays
        return


def _child(payload: Any, path: Path, after: Callable[[], list[str]], fd: int, parent: int) -> None:
    """The forked writer's whole life; never returns."""
    code = 1
    try:
        die_with_parent(parent)
        for sig in _QUIET:
            signal.signal(sig, signal.SIG_IGN)
        lower_priority()
        write_now(payload, path, checked=True)  # by the parent: no torch.load in a fork
        drop_cached(path)
        notes = after()
        # What retention read of the step files dies with this process: the parent keeps it.
        _send(fd, {"ok": True, "notes": notes, "held": known(path.parent)})
        code = 0
    except BaseException as e:
        _send(fd, _failure_record(e))
    finally:
        os._exit(code)


def _cause(record: Mapping[str, Any]) -> BaseException:
    if record.get("errno"):
        return OSError(record["errno"], record["strerror"], record["filename"])
    return RuntimeError(f"in the writer process: {record.get('type')}: {record.get('cause')}")


def _death(status: int | None) -> str:
    if status is None:
        return "the writer process ended without a word"
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return f"the writer process was killed by {name} (the OOM killer sends SIGKILL)"
    return f"the writer process exited with status {os.waitstatus_to_exitcode(status)}"


def _exit_watch(pid: int) -> int | None:
    """A pidfd on the writer ``pid`` (readable once it has exited), or None where Linux or
    Python has none. Opened right after the fork, before anything could reap the child."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _read_report(fd: int, pidfd: int | None) -> list[bytes]:
    """What the writer sent through the pipe ``fd``, read until it closed its end or, with
    ``pidfd``, until it exited: the pipe's end never closes while a process forked
    meanwhile by another thread (a subprocess, a DataLoader worker) still holds a copy of
    the write end, and waiting for that would wait for the other process."""
    chunks = []
    with contextlib.suppress(OSError):
        if pidfd is None:
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return chunks
        os.set_blocking(fd, False)
        while True:
            exited = pidfd in readable([fd, pidfd], None)
            while True:  # what the pipe holds now
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    return chunks
                chunks.append(chunk)
            if exited:
                return chunks
    return chunks


def _reap(pid: int, fd: int, handle: SaveHandle, directory: Path, pidfd: int | None) -> None:
    """The reaper thread: the handle finishes however this goes (a wait on it would
    otherwise never return)."""
    try:
        _reap_writer(pid, fd, handle, directory, pidfd)
    except BaseException as e:
        if not handle.done():
            handle._finish((f"reading the writer process's report failed: {e!r}", e), [])


def _reap_writer(pid: int, fd: int, handle: SaveHandle, directory: Path, pidfd: int | None) -> None:
    try:
        chunks = _read_report(fd, pidfd)
    finally:
        os.close(fd)
        if pidfd is not None:
            os.close(pidfd)
    status: int | None = None
    with contextlib.suppress(ChildProcessError):  # reaped elsewhere (a SIGCHLD handler)
        status = os.waitpid(pid, 0)[1]
    try:
        record = json.loads(b"".join(chunks)) if chunks else None
    except ValueError:
        record = None
    if record is None:
        death = _death(status)
        # Its temp file (as large as what it had written) would stay until the next
        # Checkpointer of the directory: a run whose writers the OOM killer keeps killing
        # would fill the disk with them. Only dead writers' files go (remove_dead_temps).
        with contextlib.suppress(OSError):
            remove_dead_temps(directory)
        handle._finish((death, OSError(errno.ECHILD, death)), [])
    elif record["ok"]:
        learn(directory, record.get("held", []))
        handle._finish(None, list(record["notes"]))
    else:
        handle._finish((record["message"], _cause(record)), [])


def start_process(
    payload: Any, path: Path, after: Callable[[], list[str]], handle: SaveHandle
) -> bool:
    """Fork a writer of ``payload`` (its copy-on-write snapshot) to ``path``; ``after`` runs
    in the writer once the file is durable and returns notes for the caller. A payload
    that :func:`refuse_unloadable` refuses fails ``handle`` without a fork (the check loads
    with torch, which a child forked from a threaded process should not). Returns whether
    a writer started.

    Raises:
        OSError: the pipe or the fork was refused (EMFILE, EAGAIN, ENOMEM); nothing was
            started and nothing is left open.
    """
    if _refused(payload, path, handle):
        return False
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:  # EAGAIN, ENOMEM: the caller saves another way; the pipe must not leak
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(read_fd)
        _child(payload, path, after, write_fd, parent)
    os.close(write_fd)
    handle._pid = pid
    threading.Thread(
        target=_reap,
        args=(pid, read_fd, handle, path.parent, _exit_watch(pid)),
        name="trainperf-checkpoint-reaper",
        daemon=True,
    ).start()
    return True
