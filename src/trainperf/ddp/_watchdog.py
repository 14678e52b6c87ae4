"""``watchdog()``: hang detection for scripts that torchrun or srun starts, one call per rank.

Without a trainperf launcher, the ranks watch each other through the process group's own
store (the ``TCPStore`` that ``init_process_group`` rendezvoused on; under torchrun the
agent hosts it). Each rank runs one daemon thread that, every ``timeout / 20`` seconds
(0.1 s to 5 s):

1. adds its new progress (see :mod:`~trainperf.ddp._progress`) to one shared counter and
   reads the total back: one store round trip (a rank inside ``busy()``, a blocking
   checkpoint save, adds one beat each time, in the counter's high bits: it is making
   progress, but the stall the report gives is measured from the last real progress, the
   low bits; a rank in a collective inside ``busy()`` sends no beat: it waits for the
   others). ``timeout`` seconds without
   the total changing may be a hang: the rank decides on one snapshot of its own state
   (its slot and one dump of all its threads;
   :func:`~trainperf.ddp._watchdog_verdict.judge`), and a rank that waits for
   another sets the ``hang`` key.
2. once ``hang`` is set, writes its own stacks (``faulthandler.dump_traceback``, all
   threads) and its progress slot to the store. One rank (the first to claim the
   ``collector`` key) waits for the others' reports (up to :data:`COLLECT_S`), reads each
   once, and posts the verdict; every rank reads that one key, and the lowest rank still in
   the job prints it to stderr (and writes ``report_path``). Collecting is O(ranks) store
   reads in all, not O(ranks²). If the collector goes silent, each rank collects and prints
   for itself. Then every rank exits with status :data:`EXIT_CODE`, so torchrun's restart
   policy acts.

A rank that returned (left the ``with`` block, or its interpreter exited) posts that first,
with how (``sys.exit(0)`` inside the block is a clean exit, named; an exception leaving it
is not; at the interpreter's exit, after a single call, only an uncaught exception other
than ``SystemExit`` can be told, and the exit status is said to be unknown), and counts
itself in one ``ended`` counter, so the others can say so. A rank whose thread
cannot run (stuck in C code that holds the GIL) sends nothing and is named as not
answering. If the store itself is gone (srun, rank 0 hosted it and exited), the rank judges
from its own state alone.

A rank that crashes instead (gloo aborts with SIGABRT when the ranks call a collective with
different sizes: "Received data size doesn't match expected size") has nothing to say to
the store; the watchdog turns ``faulthandler`` on, so that rank prints its Python stack,
with the call site, before torchrun reports it as the failed rank.

Nesting: a ``watchdog()`` while another is active in the process (a script's own call inside
``launch()`` under torchrun, which already runs ``main`` under one) does nothing; the outer
one keeps watching, with its own timeout, after the inner one exits.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from trainperf._utils.atomic import write_atomically
from trainperf.ddp import _hang, _hang_report, _hang_view, _progress
from trainperf.ddp._launch_checks import hang_timeout_s
from trainperf.ddp._progress_slots import SLOT_SIZE, SlotState, busy_counts, read_slot
from trainperf.ddp._progress_tracker import Tracker
from trainperf.ddp._rank_exit import enable_faulthandler as _enable_faulthandler
from trainperf.ddp._rank_exit import flush_std_streams
from trainperf.ddp._rank_exit import kill_children as _kill_children
from trainperf.ddp._rank_exit import say as _say
from trainperf.ddp._stacks import parse_dump
from trainperf.ddp._watchdog_verdict import Decision, judge
from trainperf.ddp._watchdog_verdict import verdict_record as _verdict_record
from trainperf.ddp._watchdog_verdict import view as _view
from trainperf.ddp._worker import called, clean_exit_call

__all__ = ["COLLECT_S", "EXIT_CODE", "Watchdog", "judge", "watchdog"]

# How long a rank waits for the others' stacks once a hang is declared.
COLLECT_S = 10.0
# The exit status of every rank after a hang (as coreutils' `timeout` uses).
EXIT_CODE = 124
# A beat (busy() below the cap, torch.compile at work) adds this to the shared progress
# counter: the low bits count real progress, the high bits beats.
_BEAT = 1 << 32


# The watchdog active in this process (at most one: a nested call does nothing), and how
# many were started here, which keys each one's store entries (every rank starts as many).
_active: list[Watchdog] = []
_started = [0]


def _store(rank_prefix: str) -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(  # type: ignore[attr-defined]
        f"trainperf/watchdog/{restart}/{rank_prefix}", c10d._get_default_store()
    )


class Watchdog:
    """One rank's watchdog; ``with watchdog():`` or a single ``watchdog()`` call."""

    def __init__(
        self,
        timeout: float | None,
        report_path: str | os.PathLike[str] | None,
        option: str = "timeout",
        on_hang: Callable[[str], None] | None = None,
        scope: str = "the watchdog() block",
    ) -> None:
        self.timeout = timeout
        self.option = option  # how the user named the timeout, for the report
        # What the rank runs under it, for the others' report: "main" under launch in a job.
        self.scope = scope
        # Called with the verdict's first line just before this rank exits on a hang
        # (launch_all under torchrun/SLURM: a rank that returned waits for this one's value).
        self.on_hang = on_hang
        self.report_path = None if report_path is None else Path(report_path)
        self.active = False
        self.limit = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._moved = time.monotonic()  # the last real progress _watch saw
        self._error_at_start: object = None  # sys.last_value when it started

    def start(self) -> Watchdog:
        import torch.distributed as dist

        if self.timeout is None or _progress.under_launcher() or _active:
            # Off, launch(hang_timeout=...) already watches this rank, or another watchdog
            # is active here (nested): it keeps watching; this one does nothing.
            return self
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "watchdog() needs the default process group: call it after "
                "torch.distributed.init_process_group() (or use trainperf.ddp.launch, "
                "whose hang_timeout= does the same)"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # An error already handled (pytest, code.interact keep it): not how this rank ends.
        self._error_at_start = getattr(sys, "last_value", None)
        _started[0] += 1
        self.store = _store(f"{dist.get_world_size()}/{_started[0]}/")
        self.buf = bytearray(SLOT_SIZE)
        self.tracker = Tracker(self.buf)
        _progress.install(self.tracker)
        self.tracker.ready(armed=True)
        self.limit = self.timeout
        self.poll_s = min(5.0, max(0.1, self.timeout / 20))
        self.active = True
        _active.append(self)
        # A rank that crashes (gloo aborts on a collective whose sizes differ between ranks:
        # a crash, not a hang) prints its Python stack, with the call site, on its way out.
        self._faulthandler = not faulthandler.is_enabled() and _enable_faulthandler()
        self._thread = threading.Thread(target=self._run, name="trainperf-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        return self

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.stop()
        elif (call := clean_exit_call(exc)) is not None:  # sys.exit(0): a clean exit, as a return
            self.stop("returned", f"called {call} in {self.scope}")
        else:
            self.stop("gone", f"{_raised(exc)} in {self.scope}")

    def _at_exit(self) -> None:
        """The interpreter exits with this watchdog still on (a single ``watchdog()`` call).
        After an exception left uncaught since :meth:`start` the rank is gone; otherwise it
        ended its script, at its end or through ``sys.exit`` with a status that atexit cannot
        read (an uncaught ``SystemExit`` leaves no trace): counted as ended, not blamed as a
        crash, and the report says that the status is unknown."""
        uncaught = _uncaught_since(self._error_at_start)
        if uncaught is not None:
            self.stop("gone", f"{_raised(uncaught)} (uncaught) and exited")
        else:
            self.stop("returned", _ENDED)

    def stop(self, status: str = "returned", how: str = "") -> None:
        """This rank is done: say so to the others (``how``: how it finished, in words; by
        default by leaving :attr:`scope`), and stop the thread."""
        if not self.active:
            return
        self.active = False
        atexit.unregister(self._at_exit)  # else it keeps every ended watchdog alive
        with contextlib.suppress(ValueError):
            _active.remove(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.tracker.returned()
        _progress.uninstall()
        if getattr(self, "_faulthandler", False):
            faulthandler.disable()
        with contextlib.suppress(Exception):
            self._post(status, "", how or self._left())
            self.store.add("ended", 1)
            self.store.add("progress", 1)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        record: dict[str, Any] | None = None
        try:
            record = self._watch()
        except Exception:  # the store is gone: judge from this rank alone
            if self._stop.is_set():
                return
            report = self._alone()
            record = None if report is None else _verdict_record(report, self.rank)
        if record is not None:
            self._finish(record)

    def _watch(self) -> dict[str, Any] | None:
        sent = 0
        total, real, since = -1, -1, time.monotonic()
        self._moved = since  # the last real progress of any rank (not a beat)
        while not self._stop.wait(self.poll_s):
            progress = self.tracker.progress
            # Inside busy() (a blocking checkpoint save) below the cap: a beat of progress,
            # so that the ranks waiting for this one do not call it a hang.
            beat = _BEAT if busy_counts(self._slot(), time.time(), self.limit) else 0
            now_total = int(self.store.add("progress", progress - sent + beat))
            sent = progress
            now = time.monotonic()
            if now_total % _BEAT != real:
                real, self._moved = now_total % _BEAT, now
            if now_total != total:
                total, since = now_total, now
            elif now - since > self.limit:
                decision = self._decide(sent)
                if decision == "hang":
                    self.store.set("hang", str(self.rank))
                else:  # progress, or busy in its own code: a waiting rank judges
                    since = now
                    if decision == "progress":
                        self.store.add("progress", _BEAT)
            if self.store.check(["hang"]):
                return self._collect(now - self._moved)
        return None

    def _slot(self) -> SlotState:
        return read_slot(bytes(self.buf))

    def _decide(self, seen_progress: int) -> Decision:
        """One snapshot (the slot, then one dump of every thread), one decision."""
        slot = self._slot()
        threads = parse_dump(self._own_dump())
        ended = int(self.store.add("ended", 0)) > 0
        return judge(
            slot,
            threads,
            seen_progress=seen_progress,
            ended=ended,
            now=time.time(),
            timeout=self.limit,
            stalled_s=time.monotonic() - self._moved,
        )

    def _left(self) -> str:
        """How a rank that left :attr:`scope` normally finished, in words."""
        return "returned from main" if self.scope == "main" else f"left {self.scope}"

    def _post(self, status: str, dump: str, how: str = "") -> None:
        record = {"status": status, "slot": bytes(self.buf).hex(), "dump": dump, "how": how}
        self.store.set(f"report/{self.rank}", json.dumps(record))

    def _own_dump(self) -> str:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read()
        # The "current thread" is this watchdog thread: leave it out of the rank's threads.
        blocks = text.split("\n\n")
        return "\n\n".join(b for b in blocks if b.strip() and not b.startswith("Current"))

    def _collect(self, stalled_s: float) -> dict[str, Any]:
        """Post this rank's report; one rank reads them all, the others read its verdict."""
        self._post("running", self._own_dump())
        claimed = self.store.compare_set("collector", "", str(self.rank))
        if claimed == str(self.rank).encode():
            record = _verdict_record(self._read_reports(stalled_s), self.rank)
            self.store.set("verdict", json.dumps(record))
            return record
        heard = self._heard("verdict", 2 * COLLECT_S)
        if heard is not None:
            found: dict[str, Any] = json.loads(heard)
            return found
        # The collector went silent: judge alone, and print it too.
        return {**_verdict_record(self._read_reports(stalled_s), self.rank), "speaker": self.rank}

    def _read_reports(self, stalled_s: float) -> _hang_report.HangReport:
        """Wait for every rank's report (one check of all keys per poll), read each once."""
        keys = [f"report/{r}" for r in range(self.world)]
        deadline = time.monotonic() + COLLECT_S
        complete = bool(self.store.check(keys))
        while time.monotonic() < deadline and not complete:
            time.sleep(0.1)
            complete = bool(self.store.check(keys))
        # Past the deadline, find who is missing (this rank only, once).
        present = keys if complete else [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        views = []
        for rank, key in enumerate(keys):
            if key not in values:
                views.append(_hang_view.RankView(rank, "running", "running", answered=False))
                continue
            views.append(_view(rank, json.loads(values[key])))
        verdict = _hang.diagnose(views)
        return _hang_report.HangReport(
            self.limit, stalled_s, self.world, verdict, tuple(views), option=self.option
        )

    def _heard(self, key: str, wait_s: float) -> bytes | None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    return bytes(self.store.get(key))
            time.sleep(0.1)
        return None

    def _alone(self) -> _hang_report.HangReport | None:
        """The store failed: watch this rank's own progress; the others cannot be asked."""
        progress, since = self.tracker.progress, time.monotonic()
        last = since  # the last real progress (busy() beats reset only the clock)
        while not self._stop.wait(self.poll_s):
            if self.tracker.progress != progress:
                progress, since = self.tracker.progress, time.monotonic()
                last = since
            elif busy_counts(self._slot(), time.time(), self.limit):
                since = time.monotonic()
            elif time.monotonic() - since > self.limit:
                record = {"status": "running", "slot": bytes(self.buf).hex()}
                record["dump"] = self._own_dump()
                views = [
                    _view(r, record)
                    if r == self.rank
                    else _hang_view.RankView(r, "unknown", "running")
                    for r in range(self.world)
                ]
                stalled = time.monotonic() - last
                verdict = _hang.diagnose(views)
                return _hang_report.HangReport(
                    self.limit, stalled, self.world, verdict, tuple(views), option=self.option
                )
        return None

    def _finish(self, record: dict[str, Any]) -> None:
        """Print the verdict (the speaker), then exit with :data:`EXIT_CODE`, whatever fails
        on the way: a rank left in its collective would hang the job after the verdict."""
        try:
            if record["speaker"] == self.rank:
                self._publish(record)
            # Every answering rank counts itself out, and waits (briefly) for the others, so
            # that no process (perhaps the store's host) exits while another still reads it.
            with contextlib.suppress(Exception):
                self.store.add("finished", 1)
                deadline = time.monotonic() + 3.0
                while (
                    int(self.store.add("finished", 0)) < record["answering"]
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.1)
            if self.on_hang is not None:
                with contextlib.suppress(Exception):
                    self.on_hang(record["message"].splitlines()[0])
            flush_std_streams()
            _kill_children()
        finally:
            os._exit(EXIT_CODE)

    def _publish(self, record: dict[str, Any]) -> None:
        text = (
            f"trainperf.ddp.watchdog: {record['message']}\n\n"
            f"Every rank exits with status {EXIT_CODE}."
        )
        _say(text)
        if self.report_path is None:
            return
        text = json.dumps({**record["report"], "message": record["message"]}, indent=2)
        payload = text.encode()
        try:
            write_atomically(
                self.report_path, lambda f: _write(f, payload), keep_write_protected=False
            )
        except OSError as e:  # the verdict above stands; say where the file did not go
            _say(
                f"trainperf.ddp.watchdog: could not write the report to {self.report_path}: "
                f"{e.strerror or e}; pass a report_path in a writable directory"
            )


# How a rank that ended with a single watchdog() still on finished, as far as it can tell.
_ENDED = (
    "ended its script (exit status unknown to the watchdog; use `with watchdog():` to tell "
    "a clean end from sys.exit(n))"
)


def _uncaught_since(before: object) -> BaseException | None:
    """The exception that ended the script, if Python kept one (``sys.last_value``, set for
    an uncaught exception other than ``SystemExit``) since ``before`` was its value; None in
    an interactive session, where every error shown at the prompt sets it.

    Example:
        >>> _uncaught_since(getattr(sys, "last_value", None)) is None
        True
    """
    value = getattr(sys, "last_value", None)
    if not isinstance(value, BaseException) or value is before:
        return None
    return None if sys.flags.interactive or hasattr(sys, "ps1") else value


def _raised(exc: BaseException) -> str:
    """``"raised ValueError"``, or ``"called sys.exit(1)"`` for a ``SystemExit``.

    Example:
        >>> _raised(ValueError("bad")), _raised(SystemExit(1))
        ('raised ValueError', 'called sys.exit(1)')
    """
    return called(exc) or f"raised {type(exc).__name__}"


def _write(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def watchdog(
    timeout: float | None = 300.0, *, report_path: str | os.PathLike[str] | None = None
) -> Watchdog:
    """Name a hang's root-cause rank in a torchrun or srun job: call once per rank.

    Call it after ``init_process_group`` (``with trainperf.ddp.watchdog():`` around the
    training, or a single call that lasts until the process exits). When no rank has made
    progress for ``timeout`` seconds (collectives, optimizer steps; see ``docs/ddp.md``),
    every rank sends its stacks, the lowest live rank prints the verdict to stderr (and
    writes it to ``report_path`` as JSON), and every rank exits with status 124 so that the
    launcher's restart policy can act. Under :func:`launch` it does nothing: ``launch``'s
    ``hang_timeout`` already watches the ranks. Nor does it while another ``watchdog()`` is
    active in this process (nested calls): the outer one keeps watching, with its own
    timeout, after the inner one exits.

    Args:
        timeout: seconds without progress on any rank that count as a hang, at least 1;
            None turns it off.
        report_path: also write the report here (JSON: ``HangReport.to_dict()`` plus the
            message).

    Returns:
        The running :class:`Watchdog` (a context manager; leaving it tells the other ranks
        how this one finished: it left the block, called ``sys.exit(0)`` there, a clean
        exit, or raised. After a single call, only an uncaught exception is told apart at
        the interpreter's exit: ``sys.exit(n)`` reads as the script's end, status unknown).

    Raises:
        ValueError: ``timeout`` is not None or a finite number >= 1 (seconds).
        RuntimeError: no process group is initialised yet.

    Example:
        >>> with watchdog(None):  # off: nothing starts
        ...     pass
    """
    if timeout is not None:
        timeout = hang_timeout_s("timeout", timeout)
    return Watchdog(timeout, report_path).start()
