"""Writing a Checkpointer file: now, or in the background, and the handle that reports it.

Two background writers, chosen by where the tensors live:

- ``"process"`` (CPU tensors, Linux): the process forks; the child's memory is a
  copy-on-write snapshot of the state at the moment of ``save`` (the kernel copies a page
  only when the training process writes to it), so nothing is copied up front and the
  training process returns from ``save`` after the fork (tens of milliseconds for a few GB).
  The child runs in a session of its own at a lower CPU and I/O priority
  (:func:`lower_priority`), writes with
  ``torch.save`` under its own GIL, drops the durable file from the page cache, deletes
  what ``keep`` retires, reports through a pipe and exits; it ignores SIGINT and
  SIGTERM (the training process decides when to stop) and is SIGKILLed if the training
  process dies, so a killed job leaves no writer behind.
- ``"thread"`` (accelerator tensors, or no ``fork``): every tensor is copied into reused
  host buffers (pinned for GPU tensors, so the copies are DMA transfers), then a thread
  writes them. ``torch.save`` holds the GIL while it writes, so this thread slows the
  training loop's Python while it runs; measured in ``benchmarks/checkpoint_bench.py``.

Staging needs host memory (up to one copy of the state): :func:`staging_fits` checks it
against :func:`trainperf.host_limits` first.
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
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainperf._utils.fds import readable
from trainperf._utils.lifetime import die_with_parent
from trainperf.checkpoint._formats import weights_only_refusal
from trainperf.checkpoint._keys import _same_type
from trainperf.checkpoint._write import write_checkpoint_file
from trainperf.errors import CheckpointError

__all__ = [
    "SaveHandle",
    "pending_handles",
    "unreported_failures",
    "Staging",
    "drop_cached",
    "fork_writes",
    "lower_priority",
    "staging_fits",
    "start_process",
    "start_thread",
    "tensor_bytes",
    "refuse_unloadable",
    "write_now",
]

# A lower priority than the training process, not the lowest: at 19 a busy host (other
# jobs at 0) would starve the writer, and the next save waits for it.
_NICE = 10
# The writer's I/O priority: the best-effort class (the training process's), its lowest
# level. Not the idle class, which a disk kept busy by others (a data loader) would starve.
_IOPRIO_CLASS_BE, _IOPRIO_LEVEL = 2, 7
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}  # syscall numbers
_QUIET = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"))
# Headroom kept free when deciding whether staging fits: the larger of these.
_MARGIN_MIN = 512 << 20
_MARGIN_FRACTION = 0.05

# Background writes still running, held strongly: the exit hook waits for them even when
# their Checkpointer is gone. Failed writes nobody has been told of yet, for the same hook.
# No lock (set.add, set.discard, list.append and list.pop are atomic under the GIL): a lock
# held by a reaper thread at a fork would stay held in the child forever.
_PENDING: set[SaveHandle] = set()
_FAILED: list[SaveHandle] = []


def _forget_parents_writes() -> None:
    """In a forked child: the parent's writes are not this process's to wait for."""
    _PENDING.clear()
    _FAILED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_writes)


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


def staging_fits(needed: int, available: int, total: int) -> bool:
    """Whether ``needed`` more bytes of host memory fit while keeping a margin free.

    The margin is the larger of 512 MiB and 5 % of ``total``: page cache, the writer's own
    buffers and the training loop's allocations need room too.

    Example:
        >>> staging_fits(1 << 30, 8 << 30, 16 << 30)
        True
        >>> staging_fits(1 << 30, (1 << 30) + (100 << 20), 16 << 30)
        False
    """
    margin = max(_MARGIN_MIN, int(total * _MARGIN_FRACTION))
    return needed + margin <= available


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    return _leaves(obj, torch.Tensor, out)


def _leaves(obj: Any, kind: Any, out: list[Any]) -> list[Any]:
    """The leaves of type ``kind`` in ``obj``'s mappings, lists and tuples, in order."""
    if isinstance(obj, kind):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _leaves(v, kind, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, kind, out)
    return out


def _shared_ranges() -> list[tuple[int, int]] | None:
    """The address ranges of this process's shared mappings (``MAP_SHARED``: shared
    memory, a file mapped for writing), which a fork shares instead of copying on write;
    None where ``/proc/self/maps`` cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(None, 2)
        if len(fields) >= 2 and len(fields[1]) >= 4 and fields[1][3] == "s":
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _in_shared(ptr: int, ranges: list[tuple[int, int]] | None) -> bool:
    """``ptr`` lies in a shared mapping (True where the mappings are unknown)."""
    return ranges is None or any(start <= ptr < end for start, end in ranges)


def _numpy_owned(a: np.ndarray[Any, Any]) -> bool:
    """NumPy allocated this array's memory itself, or it views such an array: private to
    this process (malloc'd or an anonymous private mapping)."""
    base: Any = a
    while isinstance(base, np.ndarray) and not base.flags.owndata:
        base = base.base
    return isinstance(base, np.ndarray)


def _foreign(t: torch.Tensor) -> bool:
    """The tensor's memory is not torch's own (``torch.from_numpy``, DLPack, a file): its
    storage cannot be resized."""
    try:
        return not t.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError):
        return True


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        ptr = id(t)
    return (str(t.device), ptr)


def tensor_bytes(payload: Any) -> tuple[int, bool]:
    """``(bytes, all on the CPU)`` of the tensors in ``payload``, each storage counted once.

    Example:
        >>> w = torch.zeros(256)
        >>> tensor_bytes({"a": w, "b": [w, torch.zeros(2, dtype=torch.int8)]})
        (1026, True)
    """
    seen: dict[tuple[Any, ...], int] = {}
    cpu = True
    for t in _tensors(payload, []):
        cpu = cpu and t.device.type == "cpu"
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes() if key[1] != id(t) else t.numel() * t.element_size()
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values()), cpu


def fork_writes() -> bool:
    """Whether background writes can use a forked process here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def snapshot_safe(payload: Any) -> bool:
    """Whether a fork's copy-on-write snapshot holds ``payload``'s tensors and arrays as
    they are now.

    Not for memory the fork shares, so that the training process's next writes would reach
    the writer: a tensor in shared memory (``share_memory_()``), a tensor or NumPy array
    over a shared mapping (``multiprocessing.shared_memory``, ``np.memmap`` in ``r+``
    mode, ``torch.from_numpy`` of either), nor, once CUDA is initialised, a pinned tensor:
    those go through staging, which copies them.

    Example:
        >>> shared = torch.zeros(2).share_memory_()
        >>> snapshot_safe({"w": torch.zeros(2)}), snapshot_safe({"w": shared})
        (True, False)
        >>> snapshot_safe({"rng": np.zeros(3), "w": torch.from_numpy(np.zeros(3))})
        True
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    pointers: list[int] = []  # memory torch or NumPy did not allocate: is it shared?
    for t in _tensors(payload, []):
        if t.layout != torch.strided:
            continue
        if t.is_shared() or (cuda and t.is_pinned()):  # type: ignore[no-untyped-call]
            return False
        if _foreign(t):
            pointers.append(t.data_ptr())
    arrays = _leaves(payload, np.ndarray, [])
    pointers += [a.__array_interface__["data"][0] for a in arrays if not _numpy_owned(a)]
    if not pointers:
        return True
    ranges = _shared_ranges()
    return not any(_in_shared(ptr, ranges) for ptr in pointers)


class Staging:
    """Host buffers that background saves copy tensors into, reused from save to save."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        # Whether each buffer is pinned, kept here: is_pinned() on a CPU tensor can start
        # CUDA where it was never used.
        self._pinned: list[bool] = []

    def _fits(self, i: int, t: torch.Tensor) -> bool:
        if i >= len(self._buffers):
            return False
        buf = self._buffers[i]
        pinned = t.device.type == "cuda"
        return buf.shape == t.shape and buf.dtype == t.dtype and self._pinned[i] == pinned

    def needed_bytes(self, payload: Any) -> int:
        """Bytes of new buffers that staging ``payload`` would allocate."""
        return sum(
            t.numel() * t.element_size()
            for i, t in enumerate(_staged_tensors(payload))
            if not self._fits(i, t)
        )

    def _buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if self._fits(i, t):
            return self._buffers[i]
        pin = t.device.type == "cuda"
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i], self._pinned[i] = buf, pin
        else:
            self._buffers.append(buf)
            self._pinned.append(pin)
        return buf

    def stage(self, payload: Any) -> Any:
        """``payload`` with every tensor copied into a host buffer and every other leaf
        (NumPy arrays, user objects) deep-copied (containers rebuilt; a leaf that cannot be
        copied is shared), once every copy has landed."""
        counter = [0]
        done: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()

        def copy(t: torch.Tensor) -> torch.Tensor:
            if t.layout != torch.strided:  # sparse and such: a plain copy, no buffer
                return t.detach().to("cpu", copy=True)
            key = _view_key(t)
            if key not in done:  # the same tensor twice (tied weights): one buffer
                out = self._buffer(counter[0], t)
                out.copy_(t.detach(), non_blocking=t.device.type == "cuda")
                if t.device.type == "cuda":
                    devices.add(t.device)
                counter[0] += 1
                done[key] = out
            return done[key]

        staged = _rebuild(payload, copy)
        for device in devices:  # every non-blocking copy has landed, on each device
            torch.cuda.synchronize(device)
        return staged


def _copy_leaf(obj: Any) -> Any:
    """A deep copy of a non-tensor leaf, so the training loop's next change misses it;
    immutable scalars and anything that cannot be copied are shared."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj
    try:
        return deepcopy(obj)
    except Exception:  # a lock, a generator, a socket: written as it is at write time
        return obj


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _staged_tensors(payload: Any) -> list[torch.Tensor]:
    """The tensors :meth:`Staging.stage` gives a buffer each, in its order."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for t in _tensors(payload, []):
        if t.layout == torch.strided:
            seen.setdefault(_view_key(t), t)
    return list(seen.values())


def _rebuild(obj: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    if isinstance(obj, Mapping):
        out = _same_type(obj, ((k, _rebuild(v, copy)) for k, v in obj.items()))
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            with contextlib.suppress(AttributeError, TypeError):
                out._metadata = meta
        return out
    if isinstance(obj, list):
        return [_rebuild(v, copy) for v in obj]
    if isinstance(obj, tuple):
        values = [_rebuild(v, copy) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return _copy_leaf(obj)


def write_now(payload: Any, path: Path, *, checked: bool = False) -> None:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, rename, fsync dir), once
    its plain values are known to load back (:func:`refuse_unloadable`; ``checked``: the
    caller did that already).

    Raises:
        CheckpointError: it could not be serialised or written (the cause chained), or a
            value in it is one that loading with ``weights_only=True`` refuses.
    """
    if not checked:
        refuse_unloadable(payload, path)
    write_checkpoint_file(path, lambda f: torch.save(payload, f))


def refuse_unloadable(payload: Any, path: Path) -> None:
    """Raise before anything is written when an entry of ``payload`` holds a plain value
    that ``Checkpointer.restore`` (``weights_only=True``) would refuse: every checkpoint
    would then be unloadable, and restore would have nothing to resume from.

    Raises:
        CheckpointError: which entry, why, and the fix.
    """
    for key, value in payload.items() if isinstance(payload, dict) else ():
        refused = weights_only_refusal(value)
        if refused is not None:
            raise CheckpointError(
                f"not saving {path}: state[{key!r}] holds a value that restore could never "
                f"load (weights_only=True refuses it: {refused}); save a plain value instead "
                "(an Enum's .value, a torch.Generator's get_state()), or allow its class "
                "with torch.serialization.add_safe_globals([...]) in every run that saves "
                "or restores",
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

    def _finish(self, failure: tuple[str, BaseException] | None, notes: list[str]) -> None:
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
        """Wait up to ``timeout`` seconds (None: as long as it takes); True if finished.

        Raises:
            CheckpointError: the background write failed (once: the next ``save`` or
                ``wait`` of the Checkpointer does not raise it again); the cause is chained
                and ``.path`` names the file.
        """
        finished = self._event.wait(timeout)
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
        _send(fd, {"ok": True, "notes": after()})
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


def _reap(pid: int, fd: int, handle: SaveHandle, pidfd: int | None = None) -> None:
    """The reaper thread: the handle finishes however this goes (a wait on it would
    otherwise never return)."""
    try:
        _reap_writer(pid, fd, handle, pidfd)
    except BaseException as e:
        if not handle.done():
            handle._finish((f"reading the writer process's report failed: {e!r}", e), [])


def _reap_writer(pid: int, fd: int, handle: SaveHandle, pidfd: int | None) -> None:
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
        handle._finish((death, OSError(errno.ECHILD, death)), [])
    elif record["ok"]:
        handle._finish(None, list(record["notes"]))
    else:
        handle._finish((record["message"], _cause(record)), [])


def _refused(payload: Any, path: Path, handle: SaveHandle) -> bool:
    """Whether :func:`refuse_unloadable` refuses ``payload``; if so ``handle`` has failed."""
    try:
        refuse_unloadable(payload, path)
    except CheckpointError as e:
        handle._finish((str(e), e), [])
        return True
    return False


def start_process(
    payload: Any, path: Path, after: Callable[[], list[str]], handle: SaveHandle
) -> None:
    """Fork a writer of ``payload`` (its copy-on-write snapshot) to ``path``; ``after`` runs
    in the writer once the file is durable and returns notes for the caller. A payload
    that :func:`refuse_unloadable` refuses fails ``handle`` without a fork (the check loads
    with torch, which a child forked from a threaded process should not).

    Raises:
        OSError: the pipe or the fork was refused (EMFILE, EAGAIN, ENOMEM); nothing was
            started and nothing is left open.
    """
    if _refused(payload, path, handle):
        return
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
    threading.Thread(
        target=_reap,
        args=(pid, read_fd, handle, _exit_watch(pid)),
        name="trainperf-checkpoint-reaper",
        daemon=True,
    ).start()


def start_thread(
    payload: Any, path: Path, after: Callable[[], list[str]], handle: SaveHandle
) -> None:
    """Write the (staged) ``payload`` to ``path`` from a thread; ``after`` as for
    :func:`start_process`. The payload is checked here, in the caller's thread: the check
    widens torch's allow-list while it loads, which another thread's load would see."""
    if _refused(payload, path, handle):
        return

    def run() -> None:
        try:
            write_now(payload, path, checked=True)
            drop_cached(path)
            handle._finish(None, after())
        except BaseException as e:
            handle._finish((str(e), e), [])

    threading.Thread(target=run, name="trainperf-checkpoint-writer", daemon=True).start()
