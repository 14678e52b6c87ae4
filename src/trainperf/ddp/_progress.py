"""What each rank records for hang detection: its progress and the collective it is in.

**Progress** is any of: a ``torch.distributed`` collective called from Python returned
(``all_reduce``, ``broadcast``, ``barrier``, ``all_gather``, the ``*_object`` ones, ...), an
optimizer stepped (``torch.optim`` global step hook: this covers DDP, whose gradient
all-reduce runs in C++ inside ``backward()``), a DataLoader returned a batch (so an
evaluation loop with no optimizer step and no collective is progress too), the rank finished
its set-up, or returned from ``main``. A job makes progress while any rank does; a hang is
``hang_timeout`` seconds with none on any rank.

**Known slow work**: trainperf's own long operations (a blocking checkpoint save) run inside
:func:`busy`, which marks the rank's slot "busy in <what> since <time>". A rank in such a
block counts as making progress for up to :data:`BUSY_CAP` times the timeout (one rank alone
in a long save while the others wait in a barrier is not a hang); past that it is named as
stuck in that work. A rank in a collective inside such a block (a sharded ``state_dict()`` during
a save) does not count: there it waits for the others like any rank in a collective.

Each rank writes into a fixed-size **slot**: counters, its state (running, in a collective,
returned), its main thread's id, and a ring of its last :data:`HISTORY` collectives (name,
tensor shape and dtype, the user's file:line and function, sequence number). Under
``launch`` the slots are one shared file that the launcher reads without the ranks'
cooperation (a rank stuck in C code holding the GIL cannot answer, but its slot still says
where it was); under ``watchdog()`` the slot is this process's own memory.

The wrappers replace the functions on ``torch.distributed`` and
``torch.distributed.distributed_c10d`` when the rank starts, so ``dist.all_reduce(...)`` is
seen; a name imported before that (``from torch.distributed import all_reduce`` in a module
the launcher had already imported) still calls the original, unseen. Each call costs about
a few microseconds (measured by ``benchmarks/launch_bench.py``).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "BUSY_CAP",
    "HISTORY",
    "SLOT_SIZE",
    "Collective",
    "ProgressSpec",
    "SlotState",
    "State",
    "Tracker",
    "attach",
    "busy",
    "busy_counts",
    "install",
    "open_slots",
    "read_slot",
    "under_launcher",
    "uninstall",
]

HISTORY = 8
# progress, entered, steps, last, thread, state, armed, busy since (0: not in busy())
_HEADER = struct.Struct("<QQQdQIId")
_HEADER_SIZE = 64
_ENTRY = struct.Struct("<QH")  # sequence number, text length
_ENTRY_SIZE = 256
_TEXT_MAX = _ENTRY_SIZE - _ENTRY.size
_FULL_ENTRY = struct.Struct(f"<QH{_TEXT_MAX}s")  # written in one call
_CACHE_MAX = 4096  # distinct (call site, op, shape) descriptions kept per rank
_BUSY_OFFSET = _HEADER_SIZE + HISTORY * _ENTRY_SIZE
_BUSY_SIZE = 256
_BUSY = struct.Struct(f"<H{_BUSY_SIZE - 2}s")  # text length, what busy() said
SLOT_SIZE = _BUSY_OFFSET + _BUSY_SIZE
# A rank inside busy() counts as making progress for up to this many times the timeout.
BUSY_CAP = 10.0


class State:
    """A rank's state in its slot."""

    STARTING = 0
    RUNNING = 1
    IN_COLLECTIVE = 2
    RETURNED = 3


# What the wrappers watch: every Python-level collective of torch.distributed that exists.
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
)  # fmt: skip
_ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")


@dataclass(frozen=True)
class ProgressSpec:
    """Where a launched rank's slot is: the shared file and the rank's index in it."""

    path: str
    stacks_dir: str


@dataclass(frozen=True)
class Collective:
    """One collective a rank called: what, on what, from where (the user's frame)."""

    seq: int
    op: str
    detail: str  # dtype and shape of its first tensor ("float32[4, 8]"), or "objects"
    file: str
    line: int
    function: str
    async_op: bool = False

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"

    def describe(self) -> str:
        what = f"{self.op} {self.detail}".strip()
        return f"{what} (collective #{self.seq}) at {self.site} in {self.function}"

    def encode(self) -> bytes:
        fields = (self.op, self.detail, self.file, str(self.line), self.function)
        text = "\t".join((*fields, "1" if self.async_op else "0")).encode(errors="replace")
        if len(text) > _TEXT_MAX:  # keep the end of a long path: the file name matters
            cut = len(text) - _TEXT_MAX
            file = self.file.encode(errors="replace")[cut + 3 :].decode(errors="ignore")
            fields = (self.op, self.detail[:40], "..." + file, str(self.line), self.function[:40])
            text = "\t".join((*fields, "1" if self.async_op else "0")).encode(errors="replace")
        return text[:_TEXT_MAX]

    @staticmethod
    def decode(seq: int, text: bytes) -> Collective | None:
        parts = text.decode(errors="replace").split("\t")
        if len(parts) != 6 or not parts[3].isdigit():
            return None
        op, detail, file, line, function, async_op = parts
        return Collective(seq, op, detail, file, int(line), function, async_op == "1")


@dataclass(frozen=True)
class SlotState:
    """What a slot says about its rank."""

    progress: int
    entered: int
    steps: int
    last: float
    thread: int
    state: int
    armed: bool
    history: tuple[Collective, ...]  # oldest first; the last is the current one when in it
    busy_since: float = 0.0  # time.time() when the rank entered busy(); 0 when not inside
    busy: str = ""  # what busy() said it does ("saving checkpoint /ckpt/step-100.pt")

    @property
    def current(self) -> Collective | None:
        """The collective the rank is inside now, if any."""
        if self.state != State.IN_COLLECTIVE or not self.history:
            return None
        return self.history[-1]


def read_slot(buf: Any, index: int = 0) -> SlotState:
    """Parse slot ``index`` of ``buf`` (a shared mmap, or a watchdog's own bytearray)."""
    base = index * SLOT_SIZE
    header = _HEADER.unpack_from(buf, base)
    progress, entered, steps, last, thread, state, armed, busy_since = header
    busy_text = ""
    if busy_since:
        n, text = _BUSY.unpack_from(buf, base + _BUSY_OFFSET)
        busy_text = text[: min(n, _BUSY_SIZE - 2)].decode(errors="replace")
    history = []
    for i in range(HISTORY):
        offset = base + _HEADER_SIZE + i * _ENTRY_SIZE
        seq, n = _ENTRY.unpack_from(buf, offset)
        if seq == 0 or n > _TEXT_MAX:
            continue
        text = bytes(buf[offset + _ENTRY.size : offset + _ENTRY.size + n])
        entry = Collective.decode(seq, text)
        if entry is not None:
            history.append(entry)
    history.sort(key=lambda c: c.seq)
    return SlotState(
        progress,
        entered,
        steps,
        last,
        thread,
        state,
        bool(armed),
        tuple(history),
        busy_since,
        busy_text,
    )


def busy_counts(slot: SlotState, now: float, timeout: float) -> bool:
    """Whether a rank inside :func:`busy` still counts as making progress: for up to
    :data:`BUSY_CAP` times the timeout (``now`` is ``time.time()``), and not while it is in a
    collective (a sharded ``state_dict()`` inside a save: it waits for the other ranks).

    Example:
        >>> inside = SlotState(5, 0, 0, 0.0, 0, State.RUNNING, True, (), 100.0, "saving")
        >>> busy_counts(inside, 120.0, 3.0), busy_counts(inside, 131.0, 3.0)
        (True, False)
        >>> waits = SlotState(5, 1, 0, 0.0, 0, State.IN_COLLECTIVE, True, (), 100.0, "saving")
        >>> busy_counts(waits, 120.0, 3.0)
        False
    """
    if slot.state == State.IN_COLLECTIVE:
        return False
    return slot.busy_since > 0 and now - slot.busy_since < BUSY_CAP * timeout


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep


class Tracker:
    """Writes one rank's progress into its slot; the wrappers and hooks call it.

    Only the process that made it writes: a forked child (an evaluation process, a
    DataLoader worker) inherits the tracker and the shared slot, and its progress or busy
    marks are not the rank's. One lock orders the threads' updates of the header.
    """

    def __init__(self, buf: Any, index: int = 0) -> None:
        import torch

        import trainperf

        self.buf = buf
        self.base = index * SLOT_SIZE
        self.progress = 0
        self.entered = 0
        self.steps = 0
        self.state = State.STARTING
        self.armed = False
        self.depth = 0
        self.busy_since = 0.0
        self.busy_depth = 0
        self.thread = threading.main_thread().ident or 0
        self.pid = os.getpid()  # a forked child (a background checkpoint writer) is not it
        self._skip = (_package_dir(torch), _package_dir(trainperf), "<")
        self._texts: dict[tuple[Any, ...], bytes] = {}
        # Held across updating the fields and packing them: without it a thread's write
        # can pack another's stale busy_since or counters. A forked child never takes it
        # (it writes nothing), so a lock held at fork time cannot block it.
        self.lock = threading.Lock()
        self._write()

    def _mine(self) -> bool:
        return os.getpid() == self.pid

    def _write(self) -> None:
        """Pack the fields into the header (callers hold :attr:`lock`, or own the tracker
        alone, as in ``__init__``)."""
        if not self._mine():
            return
        _HEADER.pack_into(
            self.buf,
            self.base,
            self.progress,
            self.entered,
            self.steps,
            time.time(),
            self.thread,
            self.state,
            self.armed,
            self.busy_since,
        )

    def ready(self, *, armed: bool) -> None:
        """Set-up is done (the process group exists): progress, and the clock starts."""
        if not self._mine():
            return
        with self.lock:
            self.armed = armed
            self.state = State.RUNNING
            self.progress += 1
            self._write()

    def returned(self) -> None:
        if not self._mine():
            return
        with self.lock:
            self.state = State.RETURNED
            self.progress += 1
            self._write()

    def step(self) -> None:
        """An optimizer step (all of DDP's gradient all-reduces for it are done)."""
        if not self._mine():
            return
        with self.lock:
            self.steps += 1
            self.progress += 1
            self._write()

    def batch(self) -> None:
        """A DataLoader returned a batch (evaluation loops have no optimizer step)."""
        if not self._mine():
            return
        with self.lock:
            self.progress += 1
            self._write()

    def busy_enter(self, what: str) -> None:
        """Known slow work starts (the outermost of nested blocks names it)."""
        if not self._mine():
            return
        with self.lock:
            self.busy_depth += 1
            if self.busy_depth > 1:
                return
            text = what.encode(errors="replace")[: _BUSY_SIZE - 2]
            # The text first, then the time that says it is valid: a reader never sees a
            # busy_since with the previous block's text.
            _BUSY.pack_into(self.buf, self.base + _BUSY_OFFSET, len(text), text)
            self.busy_since = time.time()
            self.progress += 1
            self._write()

    def busy_exit(self) -> None:
        if not self._mine():
            return
        with self.lock:
            self.busy_depth -= 1
            if self.busy_depth > 0:
                return
            self.busy_since = 0.0
            self.progress += 1
            self._write()

    def _caller(self) -> FrameType | None:
        """The innermost frame outside torch and trainperf: the user's call site."""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self._skip):
            frame = frame.f_back
        return frame

    def enter(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._mine():
            return
        frame = self._caller()
        first = args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list"))
        count = -1
        if isinstance(first, (list, tuple)):
            count, first = len(first), (first[0] if first else None)
        # The description of a call is the same every time one site calls with one shape:
        # build it once (the per-call cost is what the benchmark measures).
        key = (
            op,
            frame.f_code if frame else None,
            frame.f_lineno if frame else 0,
            getattr(first, "shape", None),
            getattr(first, "dtype", None),
            type(first),
            count,
            bool(kwargs.get("async_op")),
        )
        text = self._texts.get(key)
        if text is None:
            text = self._describe(op, _detail(first, count), kwargs, frame)
            if len(self._texts) >= _CACHE_MAX:
                self._texts.clear()
            self._texts[key] = text
        with self.lock:
            self.entered += 1
            offset = self.base + _HEADER_SIZE + (self.entered % HISTORY) * _ENTRY_SIZE
            _FULL_ENTRY.pack_into(self.buf, offset, self.entered, len(text), text)
            self.state = State.IN_COLLECTIVE
            self._write()

    def _describe(
        self, op: str, detail: str, kwargs: dict[str, Any], frame: FrameType | None
    ) -> bytes:
        file, line, function = "?", 0, "?"
        if frame is not None:
            file, line, function = frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        async_op = op in _ALWAYS_ASYNC or bool(kwargs.get("async_op"))
        return Collective(0, op, detail, file, line, function, async_op).encode()

    def exit(self) -> None:
        if not self._mine():
            return
        with self.lock:
            self.state = State.RUNNING
            self.progress += 1
            self._write()


def _detail(first: Any, count: int) -> str:
    """``float32[4, 8]`` for a tensor, ``float32[4] x3`` for a list of 3, else "objects"."""
    import torch

    if isinstance(first, torch.Tensor):
        return _tensor_text(first) + (f" x{count}" if count >= 0 else "")
    return "objects" if first is not None else ""


def _tensor_text(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"


_installed: list[Tracker] = []
_launched: list[bool] = []  # set in ranks that launch() started with hang detection


def under_launcher() -> bool:
    """Whether ``launch(hang_timeout=...)`` already watches this process."""
    return bool(_launched)


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        tracker = _installed[0] if _installed else None
        if tracker is None or tracker.depth:
            return fn(*args, **kwargs)  # nested (all_gather_object calls all_gather): outer counts
        tracker.depth += 1
        tracker.enter(name, args, kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.depth -= 1
            tracker.exit()

    watched.__trainperf_watched__ = fn  # type: ignore[attr-defined]
    return watched


_originals: list[tuple[Any, str, Callable[..., Any]]] = []
_hooks: list[Any] = []


def install(tracker: Tracker) -> None:
    """Route this process's collectives and optimizer steps to ``tracker``.

    A second call only swaps the tracker. The wrappers stay until :func:`uninstall` (a
    launched rank keeps them for its life; ``watchdog`` removes them when it stops).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim.optimizer import register_optimizer_step_post_hook

    first = not _installed
    _installed[:] = [tracker]
    if not first:
        return
    for name in _COLLECTIVES:
        found = getattr(c10d, name, None)
        if found is None or hasattr(found, "__trainperf_watched__"):
            continue
        fn: Callable[..., Any] = found
        watched = _wrap(name, fn)
        _originals.append((c10d, name, fn))
        setattr(c10d, name, watched)
        if getattr(dist, name, None) is fn:
            _originals.append((dist, name, fn))
            setattr(dist, name, watched)
    _hooks.append(register_optimizer_step_post_hook(_on_step))
    _watch_batches()


def _watch_batches() -> None:
    """Count every batch a DataLoader returns (one wrapper on the iterators' base class)."""
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    fn = base.__next__
    if hasattr(fn, "__trainperf_watched__"):
        return

    @functools.wraps(fn)
    def watched_next(self: Any) -> Any:
        out = fn(self)
        if _installed:
            _installed[0].batch()
        return out

    watched_next.__trainperf_watched__ = fn  # type: ignore[attr-defined]
    _originals.append((base, "__next__", fn))
    base.__next__ = watched_next  # type: ignore[method-assign]


def uninstall() -> None:
    """Put back the original collectives and drop the optimizer hook."""
    for module, name, fn in reversed(_originals):
        setattr(module, name, fn)
    _originals.clear()
    for hook in _hooks:
        hook.remove()
    _hooks.clear()
    _installed.clear()


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark this rank as busy in known slow work (``"saving checkpoint /ckpt/step-9.pt"``).

    For trainperf's own long operations: while the block runs, the hang detection
    (``launch(hang_timeout=...)`` or ``watchdog()``) counts this rank as making progress, for
    up to :data:`BUSY_CAP` times the timeout; past that the report names it as stuck in
    ``what``. Cheap, and nothing at all when no detection watches this process. Only the
    main thread's blocks count: a background thread's work, or a forked child's (a
    background checkpoint writer inherits the tracker), does not hold the job up.

    Example:
        >>> with busy("saving checkpoint /tmp/step-1.pt"):  # no detection here: no effect
        ...     pass
    """
    tracker = _installed[0] if _installed else None
    if tracker is None or threading.get_ident() != tracker.thread or os.getpid() != tracker.pid:
        yield
        return
    tracker.busy_enter(what)
    try:
        yield
    finally:
        tracker.busy_exit()


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _installed:
        _installed[0].step()


def open_slots(path: Path, nprocs: int) -> mmap.mmap:
    """Create the launcher's shared slots file (zeros) and map it."""
    with open(path, "wb") as f:
        f.truncate(nprocs * SLOT_SIZE)
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), nprocs * SLOT_SIZE)


def attach(path: str) -> mmap.mmap:
    """A rank's view of the shared slots file (the whole file; each rank writes its own)."""
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size)
