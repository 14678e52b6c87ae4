"""``watchdog()``: hang detection for scripts that torchrun or srun starts, one call per rank.

Without a trainperf launcher, the ranks watch each other through the process group's own
store (the ``TCPStore`` that ``init_process_group`` rendezvoused on; under torchrun the
agent hosts it). Each rank runs one daemon thread that, every ``timeout / 20`` seconds
(0.1 s to 5 s):

1. adds its new progress (see :mod:`~trainperf.ddp._progress`) to one shared counter and
   reads the total back: one store round trip. ``timeout`` seconds without the total
   changing is a hang; the first rank to see it sets the ``hang`` key.
2. once ``hang`` is set, writes its own stacks (``faulthandler.dump_traceback``, all
   threads) and its progress slot to the store, waits for the other ranks' (up to
   :data:`COLLECT_S`), and the lowest rank still in the job prints the verdict to stderr
   (and writes ``report_path``); the others print it too if that rank stays silent. Then
   every rank exits with status :data:`EXIT_CODE`, so torchrun's restart policy acts.

A rank that returned (left the ``with`` block, or its interpreter exited) posts that first,
so the others can say so. A rank whose thread cannot run (stuck in C code that holds the
GIL) sends nothing and is named as not answering. If the store itself is gone (srun, rank
0 hosted it and exited), the rank judges from its own state alone.
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
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from trainperf._utils.atomic import write_atomically
from trainperf._utils.validate import positive_number
from trainperf.ddp import _hang, _progress
from trainperf.ddp._detector import rank_view
from trainperf.ddp._progress import SLOT_SIZE, State, Tracker, read_slot
from trainperf.ddp._stacks import classify, compiling, parse_dump

__all__ = ["COLLECT_S", "EXIT_CODE", "Watchdog", "watchdog"]

# How long a rank waits for the others' stacks once a hang is declared.
COLLECT_S = 10.0
# The exit status of every rank after a hang (as coreutils' `timeout` uses).
EXIT_CODE = 124


def _store(rank_prefix: str) -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(  # type: ignore[attr-defined]
        f"trainperf/watchdog/{restart}/{rank_prefix}", c10d._get_default_store()
    )


class Watchdog:
    """One rank's watchdog; ``with watchdog():`` or a single ``watchdog()`` call."""

    def __init__(self, timeout: float | None, report_path: str | os.PathLike[str] | None) -> None:
        self.timeout = timeout
        self.report_path = None if report_path is None else Path(report_path)
        self.active = False
        self.limit = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        import torch.distributed as dist

        if self.timeout is None or _progress.under_launcher():
            return self  # off, or launch(hang_timeout=...) already watches this rank
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "watchdog() needs the default process group: call it after "
                "torch.distributed.init_process_group() (or use trainperf.ddp.launch, "
                "whose hang_timeout= does the same)"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = _store(f"{dist.get_world_size()}/")
        self.buf = bytearray(SLOT_SIZE)
        self.tracker = Tracker(self.buf)
        _progress.install(self.tracker)
        self.tracker.ready(armed=True)
        self.limit = self.timeout
        self.poll_s = min(5.0, max(0.1, self.timeout / 20))
        self.active = True
        self._thread = threading.Thread(target=self._run, name="trainperf-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        return self

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop("returned" if exc_type is None else "gone")

    def stop(self, status: str = "returned") -> None:
        """This rank is done: say so to the others, and stop the thread."""
        if not self.active:
            return
        self.active = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.tracker.returned()
        _progress.uninstall()
        with contextlib.suppress(Exception):
            self._post(status, "")
            self.store.add("progress", 1)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            report = self._watch()
        except Exception:  # the store is gone: judge from this rank alone
            if self._stop.is_set():
                return
            report = self._alone()
        if report is not None:
            self._finish(report)

    def _watch(self) -> _hang.HangReport | None:
        sent = 0
        total, since = -1, time.monotonic()
        while not self._stop.wait(self.poll_s):
            progress = self.tracker.progress
            now_total = int(self.store.add("progress", progress - sent))
            sent = progress
            now = time.monotonic()
            if now_total != total:
                total, since = now_total, now
            elif now - since > self.limit:
                if self._compiling():
                    since = now  # torch.compile at work on this rank: not a hang
                    self.store.add("progress", 1)
                elif self._blocked():
                    self.store.set("hang", str(self.rank))
                else:
                    since = now  # busy in its own code and nobody gone: a waiting rank judges
            if self.store.check(["hang"]):
                return self._collect(now - since)
        return None

    def _blocked(self) -> bool:
        """This rank waits (in a collective or in DDP's ``backward()``) or another is gone.

        Ranks all busy in their own code wait for nobody: that is slow work, not a hang.
        """
        if self.tracker.state == State.IN_COLLECTIVE:
            return True
        main = [t for t in parse_dump(self._own_dump()) if t.ident == self.tracker.thread]
        if main and classify(main[0].frames, in_collective=False) == "backward":
            return True
        others = [f"report/{r}" for r in range(self.world) if r != self.rank]
        return any(self.store.check([key]) for key in others)

    def _compiling(self) -> bool:
        main = [t for t in parse_dump(self._own_dump()) if t.ident == self.tracker.thread]
        return bool(main) and compiling(main[0].frames)

    def _post(self, status: str, dump: str) -> None:
        record = {"status": status, "slot": bytes(self.buf).hex(), "dump": dump}
        self.store.set(f"report/{self.rank}", json.dumps(record))

    def _own_dump(self) -> str:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read()
        # The "current thread" is this watchdog thread: leave it out of the rank's threads.
        blocks = text.split("\n\n")
        return "\n\n".join(b for b in blocks if b.strip() and not b.startswith("Current"))

    def _collect(self, stalled_s: float) -> _hang.HangReport:
        self._post("running", self._own_dump())
        keys = [f"report/{r}" for r in range(self.world)]
        deadline = time.monotonic() + COLLECT_S
        while time.monotonic() < deadline and not all(self.store.check([k]) for k in keys):
            time.sleep(0.1)
        views = []
        for rank, key in enumerate(keys):
            if not self.store.check([key]):
                views.append(_hang.RankView(rank, "running", "running", answered=False))
                continue
            record = json.loads(self.store.get(key))
            views.append(_view(rank, record))
        verdict = _hang.diagnose(views)
        return _hang.HangReport(
            self.limit, stalled_s, self.world, verdict, tuple(views), option="timeout"
        )

    def _alone(self) -> _hang.HangReport | None:
        """The store failed: watch this rank's own progress; the others count as gone."""
        progress, since = self.tracker.progress, time.monotonic()
        while not self._stop.wait(self.poll_s):
            if self.tracker.progress != progress:
                progress, since = self.tracker.progress, time.monotonic()
            elif time.monotonic() - since > self.limit:
                record = {"status": "running", "slot": bytes(self.buf).hex()}
                record["dump"] = self._own_dump()
                views = [
                    _view(r, record) if r == self.rank else _hang.RankView(r, "gone", "running")
                    for r in range(self.world)
                ]
                stalled = time.monotonic() - since
                verdict = _hang.diagnose(views)
                return _hang.HangReport(
                    self.limit, stalled, self.world, verdict, tuple(views), option="timeout"
                )
        return None

    def _speaker(self) -> int:
        """The lowest rank still in the job: it prints, the others wait for it."""
        for rank in range(self.world):
            with contextlib.suppress(Exception):
                record = json.loads(self.store.get(f"report/{rank}"))
                if record["status"] == "running":
                    return rank
        return self.rank

    def _finish(self, report: _hang.HangReport) -> None:
        text = f"trainperf.ddp.watchdog: {report}\n\nEvery rank exits with status {EXIT_CODE}."
        speaker = self.rank
        with contextlib.suppress(Exception):
            speaker = self._speaker()
        if speaker == self.rank:
            self._publish(report, text)
            with contextlib.suppress(Exception):
                self.store.set("verdict", text)
            time.sleep(
                1.0
            )  # the others read the verdict before this process (maybe the store's host) exits
        elif not self._heard_verdict():
            self._publish(report, text)
        sys.stderr.flush()
        sys.stdout.flush()
        _kill_children()
        os._exit(EXIT_CODE)

    def _heard_verdict(self) -> bool:
        deadline = time.monotonic() + COLLECT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.store.check(["verdict"]):
                    return True
            time.sleep(0.1)
        return False

    def _publish(self, report: _hang.HangReport, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        if self.report_path is None:
            return
        payload = json.dumps({**report.to_dict(), "message": str(report)}, indent=2).encode()
        with contextlib.suppress(OSError):
            write_atomically(self.report_path, lambda f: _write(f, payload))


def _kill_children() -> None:
    """Stop this rank's own processes (DataLoader workers, perhaps the one stuck in
    ``__getitem__``): exiting does not end them, and they would hold the job's pipes."""
    import psutil

    with contextlib.suppress(psutil.Error):
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=5)


def _write(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def _view(rank: int, record: dict[str, Any]) -> _hang.RankView:
    slot = read_slot(bytes.fromhex(record["slot"]))
    threads = parse_dump(record["dump"]) if record.get("dump") else None
    status: _hang.Status = "running"
    if record["status"] == "returned":
        status = "returned"
    elif record["status"] == "gone":
        status = "gone"
    return rank_view(rank, status, slot, threads if status == "running" else [])


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
    ``hang_timeout`` already watches the ranks.

    Args:
        timeout: seconds without progress on any rank that count as a hang; None turns it
            off.
        report_path: also write the report here (JSON: ``HangReport.to_dict()`` plus the
            message).

    Returns:
        The running :class:`Watchdog` (a context manager; leaving it tells the other ranks
        this one returned).

    Raises:
        ValueError: ``timeout`` is not None or a finite number > 0.
        RuntimeError: no process group is initialised yet.

    Example:
        >>> with watchdog(None):  # off: nothing starts
        ...     pass
    """
    if timeout is not None:
        timeout = positive_number("timeout", timeout, unit="seconds (or None)")
    return Watchdog(timeout, report_path).start()
