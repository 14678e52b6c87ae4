"""A rank's slot for hang detection: its layout, reading it, and the launcher's file of slots.

Each rank writes into a fixed-size **slot**: counters, its state (running, in a collective,
returned), its main thread's id, and a ring of its last :data:`HISTORY` collectives (name,
tensor shape and dtype, the user's file:line and function, sequence number). Under
``launch`` the slots are one shared file that the launcher reads without the ranks'
cooperation (a rank stuck in C code holding the GIL cannot answer, but its slot still says
where it was); under ``watchdog()`` the slot is this process's own memory.

The writer is :class:`~trainperf.ddp._progress_tracker.Tracker`; what counts as progress is
in :mod:`~trainperf.ddp._progress`.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUSY_CAP",
    "HISTORY",
    "SLOT_SIZE",
    "Collective",
    "ProgressSpec",
    "SlotState",
    "State",
    "attach",
    "busy_counts",
    "open_slots",
    "read_slot",
]

HISTORY = 8
# progress, entered, steps, last, thread, state, armed, busy since (0: not in busy())
_HEADER = struct.Struct("<QQQdQIId")
_HEADER_SIZE = 64
_ENTRY = struct.Struct("<QH")  # sequence number, text length
_ENTRY_SIZE = 256
_TEXT_MAX = _ENTRY_SIZE - _ENTRY.size
_FULL_ENTRY = struct.Struct(f"<QH{_TEXT_MAX}s")  # written in one call
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
    """Whether a rank inside ``busy()`` still counts as making progress: for up to
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
