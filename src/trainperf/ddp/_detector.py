"""The launcher's hang detector: watches every rank's progress, and on a hang names the cause.

The launcher creates one directory (under ``/dev/shm`` where it exists) holding the shared
progress slots and one stack file per rank. Each poll of the launcher's watch loop reads the
slots; once every rank has finished its set-up, ``hang_timeout`` seconds without a change in
any rank's progress (nor a rank returning) is a hang. The launcher then signals each rank
with :data:`~trainperf.ddp._stacks.DUMP_SIGNAL`, on which ``faulthandler`` writes all its
threads' stacks from the C signal handler, reads them with the slots, and runs the rules of
:mod:`~trainperf.ddp._hang`; the group stops every rank and raises ``HangError``.

The verdict comes from one snapshot: the slots read before the dump, checked again after it
(a rank that moved meanwhile is progress, not a hang), and every thread of every rank for
``torch.compile``'s compiler at work. A rank inside :func:`~trainperf.ddp._progress.busy`
(a blocking checkpoint save), or compiling, counts as making progress for up to
``BUSY_CAP`` times ``hang_timeout``; the stall a report gives is measured from the last
change in any rank's progress, which those do not reset.
Run directories that dead launchers left behind are removed by the rules of
:mod:`~trainperf.ddp._rundir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from trainperf.ddp import _hang, _hang_report, _hang_view, _rundir
from trainperf.ddp._progress_slots import (
    ProgressSpec,
    SlotState,
    State,
    busy_counts,
    open_slots,
    read_slot,
)
from trainperf.ddp._stacks import (
    DUMP_SIGNAL,
    ThreadStack,
    classify,
    compiling_threads,
    parse_dump,
    source_line,
    user_frame,
)
from trainperf.errors import HangError

__all__ = ["HangDetector", "rank_view"]

_DUMP_WAIT_S = 3.0
# A rank that has not loaded main while others wait for it to join the process group is
# named after hang_timeout, but not before this: spawning a rank (importing torch and the
# script again) can take tens of seconds more on one rank than another on a loaded host.
STARTUP_FLOOR_S = 30.0
# Paired with an unlike op on the peer (a send with its recv): no mismatch between them.
_POINT_TO_POINT = frozenset(
    ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
)
# In a traceback: the failure was raised inside one of torch.distributed's calls.
_TORCH_DISTRIBUTED = os.path.join("torch", "distributed", "")


_WATCHER_FILE = os.path.join("_utils", "lifetime.py")


def _is_watcher(thread: ThreadStack) -> bool:
    """die_with_parent's watcher thread: in every rank, and nothing the hang is about."""
    return any(f.file.endswith(_WATCHER_FILE) and f.function == "_watch" for f in thread.frames)


def _base_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def rank_view(
    rank: int,
    status: _hang_view.Status,
    slot: SlotState,
    threads: list[ThreadStack] | None,
    now: float | None = None,
) -> _hang_view.RankView:
    """One rank's view for the rules, from its slot and its parsed stack dump (``now``:
    ``time.time()``, for how long it has been inside ``busy()``)."""
    main = next((t for t in threads or [] if t.ident == slot.thread), None)
    frames = main.frames if main else ()
    last = slot.history[-1] if slot.history else None
    waits_async = bool(last and last.async_op and slot.state == State.RUNNING)
    activity = classify(
        frames, in_collective=slot.state == State.IN_COLLECTIVE, waits_async=waits_async
    )
    where = user_frame(frames)
    # Still inside busy() when the hang is declared: past the cap, stuck in that work.
    stuck_s = max(0.0, (time.time() if now is None else now) - slot.busy_since)
    others = tuple(
        (t.ident, user_frame(t.frames), source_line(user_frame(t.frames)))
        for t in threads or []
        if t is not main and t.frames and not _is_watcher(t)
    )
    return _hang_view.RankView(
        rank=rank,
        status=status,
        activity=activity,
        collective=slot.current or (last if activity == "collective" else None),
        history=slot.history,
        steps=slot.steps,
        where=where,
        line=source_line(where),
        stack=frames,
        threads=others,
        answered=threads is not None,
        compiling=compiling_threads(threads or []),
        stuck_in=slot.busy if slot.busy_since else "",
        stuck_s=stuck_s if slot.busy_since else 0.0,
    )


class HangDetector:
    """Progress slots and stack files for one launch, and the hang check the group polls."""

    def __init__(self, nprocs: int, hang_timeout: float) -> None:
        base = _base_dir()
        _rundir.remove_stale(base)
        self.dir = _rundir.create(base)
        self.n = nprocs
        self.timeout = hang_timeout
        self.poll_s = min(1.0, max(0.1, hang_timeout / 4))
        self.slots = open_slots(self.dir / "progress", nprocs)
        self.spec = ProgressSpec(str(self.dir / "progress"), str(self.dir))
        self.pids: dict[int, int] = {}
        # The ranks whose main called sys.exit(0) (or sys.exit()), and the call: the report
        # names it, as the LaunchError does (their slots say returned, as for a return).
        self.exit_calls: dict[int, str] = {}
        self._signature: Any = None
        self._since = time.monotonic()  # when the clock for hang_timeout last started
        self._moved = self._since  # the last change in any rank's progress
        # Before every rank joined: which ranks have not loaded main and which wait, since when.
        self._start_signature: Any = None
        self._start_since = self._since

    def reset(self) -> None:
        """A new attempt: zero every slot, forget the pids and the clock."""
        self.slots[:] = bytes(len(self.slots))
        for path in self.dir.glob("rank*.stacks"):
            path.unlink(missing_ok=True)
        self.pids.clear()
        self.exit_calls.clear()
        self._signature = self._start_signature = None
        self._since = self._moved = self._start_since = time.monotonic()

    def started(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid

    def returned(self, rank: int, exit_call: str | None = None) -> None:
        """A rank returned from main, or ended it with ``exit_call`` (``"sys.exit(0)"``):
        progress (the signature counts results too)."""
        if exit_call is not None:
            self.exit_calls[rank] = exit_call

    def _states(self) -> list[SlotState]:
        return [read_slot(self.slots, r) for r in range(self.n)]

    def check(
        self,
        running: dict[int, BaseProcess],
        results: dict[int, Any],
        loaded: set[int] | frozenset[int] = frozenset(),
    ) -> Any:
        """A :class:`~trainperf.ddp._hang_report.HangReport` once the job has hung, else None.
        ``loaded``: the ranks that have loaded main (the rest have not reached it yet)."""
        now = time.monotonic()
        states = self._states()
        ready = all(s.state != State.STARTING or r in results for r, s in enumerate(states))
        signature = (tuple(s.progress for s in states), len(results), len(running))
        if not ready or signature != self._signature:
            self._signature, self._since, self._moved = signature, now, now
            return None if ready else self._check_startup(states, running, loaded, now)
        if self._busy(states, running):
            self._since = now  # progress for the clock, not for how long the job stalls
            return None
        if now - self._since < self.timeout:
            return None
        stalled_s = now - self._moved
        report = self.report(states, running, results, stalled_s)
        moved = tuple(s.progress for s in self._states()) != signature[0]
        if moved or not _hang.is_hang(
            list(report.ranks), stalled_s=stalled_s, timeout=self.timeout
        ):
            # A rank moved while the stacks were taken, torch.compile is at work, or every
            # rank is busy in its own code (no rank waits for another): slow work, not a
            # hang. Look again in hang_timeout.
            self._since = time.monotonic()
            return None
        return report

    def _check_startup(
        self,
        states: list[SlotState],
        running: dict[int, BaseProcess],
        loaded: set[int] | frozenset[int],
        now: float,
    ) -> Any:
        """Before every rank has joined: ranks that never loaded main while others wait for
        them to join, unchanged for ``hang_timeout`` (:data:`STARTUP_FLOOR_S` at least)."""
        starting = tuple(r for r in sorted(running) if r not in loaded)
        joining = tuple(r for r in sorted(running) if r in loaded)
        if not starting or not joining or (starting, joining) != self._start_signature:
            self._start_signature, self._start_since = (starting, joining), now
            return None
        stalled_s = now - self._start_since
        if stalled_s < max(self.timeout, STARTUP_FLOOR_S):
            return None
        # Only a rank whose worker code installed the stack-dump handler (its slot written
        # over a second ago) is signalled: before that the signal would kill it.
        wall = time.time()
        handled = [r for r in starting if 0 < states[r].last < wall - 1.0]
        stacks = self._dump(handled) if handled else {}
        views = []
        for rank, slot in enumerate(states):
            if rank in joining:
                views.append(_hang_view.RankView(rank, "running", "joining"))
            elif rank in starting:
                view = rank_view(rank, "running", slot, stacks.get(rank))
                views.append(dataclasses.replace(view, activity="starting"))
            else:
                views.append(rank_view(rank, "gone", slot, None))
        verdict = _hang.diagnose(views)
        return _hang_report.HangReport(self.timeout, stalled_s, self.n, verdict, tuple(views))

    def _busy(self, states: list[SlotState], running: dict[int, BaseProcess]) -> bool:
        """A running rank is inside busy() (a blocking checkpoint save), below the cap."""
        now = time.time()
        return any(r in running and busy_counts(s, now, self.timeout) for r, s in enumerate(states))

    def _dump(self, ranks: list[int]) -> dict[int, list[ThreadStack]]:
        """Ask each rank for its stacks; return what arrived within a few seconds."""
        if DUMP_SIGNAL is None:
            return {}
        before = {r: self._size(r) for r in ranks}
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pids[rank], DUMP_SIGNAL)
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + _DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = {r: self._size(r) for r in ranks}
            # Each file grew (the new dump, appended) and stopped growing (it is complete).
            if all(now[r] > before[r] and now[r] == sizes.get(r) for r in ranks):
                break
            sizes = now
        found = {}
        for rank in ranks:
            path = self.dir / f"rank{rank}.stacks"
            with contextlib.suppress(OSError):
                threads = parse_dump(path.read_text(errors="replace"))
                if threads:
                    found[rank] = threads
        return found

    def _size(self, rank: int) -> int:
        try:
            return (self.dir / f"rank{rank}.stacks").stat().st_size
        except OSError:
            return 0

    def report(
        self,
        states: list[SlotState],
        running: dict[int, BaseProcess],
        results: dict[int, Any],
        stalled_s: float,
    ) -> _hang_report.HangReport:
        alive = [r for r in sorted(running) if r in self.pids and states[r].armed]
        stacks = self._dump(alive)
        views = []
        for rank, slot in enumerate(states):
            status: _hang_view.Status = (
                "returned" if rank in results else "running" if rank in running else "gone"
            )
            view = rank_view(rank, status, slot, stacks.get(rank))
            if status == "returned" and rank in self.exit_calls:
                view = dataclasses.replace(view, exit_call=self.exit_calls[rank])
            views.append(view)
        verdict = _hang.diagnose(views)
        return _hang_report.HangReport(self.timeout, stalled_s, self.n, verdict, tuple(views))

    def error(
        self,
        report: _hang_report.HangReport,
        endings: list[tuple[int, int | None, str, bool]] | None = None,
        attempt: str = "",
    ) -> HangError:
        """The HangError for ``report``, with how each stopped rank ended (the group's
        ``(rank, exit code, how, expected)``): a crash or an error code meanwhile is named.
        ``attempt`` labels the attempt as the group's other errors do (" (attempt 2 of 3)")."""
        ended = tuple(_hang_report.Ending(*e) for e in endings or [])
        report = dataclasses.replace(report, endings=ended, attempt=attempt)
        stopped = "Every rank was stopped (SIGTERM, then SIGKILL after 3 s)."
        return HangError(f"{report}\n\n{stopped}", report=report)

    def mismatch_note(self, failure: str = "") -> list[str]:
        """For a LaunchError: each rank's last collective, when they were the same call
        (same count) but disagree on what it is, and the failure came from there: a rank
        still inside its last collective (gloo aborts on a size mismatch: "Received data
        size doesn't match expected size"), or ``failure`` (the first failure's summary and
        traceback) raised inside torch.distributed. Calls that all returned before a rank's
        own error matched, whatever they were; a send and its recv are no mismatch."""
        states = self._states()
        last = {r: s.history[-1] for r, s in enumerate(states) if s.history}
        if len(last) < 2 or len({c.seq for c in last.values()}) != 1:
            return []
        if len({(c.op, c.detail, c.site) for c in last.values()}) < 2:
            return []
        if all(c.op in _POINT_TO_POINT for c in last.values()):
            return []  # a send pairs with a recv: unlike ops, one exchange
        inside = any(states[r].current is not None for r in last)
        if not inside and _TORCH_DISTRIBUTED not in failure:
            return []
        lines = ["", "The ranks called different collectives (a collective mismatch):"]
        lines += [f"  rank {r}: {c.describe()}" for r, c in sorted(last.items())]
        lines.append(
            "Every rank must call the same collectives in the same order, with the same "
            "shapes and dtypes."
        )
        return lines

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.slots.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        _rundir.release(self.dir)
