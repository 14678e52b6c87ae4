"""The writer of one rank's slot (see :mod:`~trainperf.ddp._progress_slots`): the
collective it is in, with the user's call site, and its progress.

The wrappers and hooks of :mod:`~trainperf.ddp._progress` call it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import FrameType
from typing import Any

from trainperf.ddp._progress_slots import (
    _BUSY,
    _BUSY_OFFSET,
    _BUSY_SIZE,
    _ENTRY_SIZE,
    _FULL_ENTRY,
    _HEADER,
    _HEADER_SIZE,
    HISTORY,
    SLOT_SIZE,
    Collective,
    State,
)

__all__ = ["Tracker"]

_CACHE_MAX = 4096  # distinct (call site, op, shape) descriptions kept per rank
_ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")


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
        named = (kwargs.get(k) for k in ("tensor", "tensor_list", "tensors"))
        first = args[0] if args else next((v for v in named if v is not None), None)
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
