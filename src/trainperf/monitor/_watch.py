"""``trainperf.watch()``: watch a real training loop and say what limits it.

::

    with trainperf.watch() as w:
        for batch in w.iter(loader):   # times the wait for each batch
            loss = step(batch)
            w.step()                   # marks the end of a training step
    print(w.report())

or, with no re-indent of the loop, ``w = trainperf.watch(); w.start()`` before it and
``print(w.stop())`` after it.

Per step the loop pays two ``time.perf_counter()`` stamps, two ``time.thread_time()``
readings around each batch (the CPU the wait used), one read of the thread's ``schedstat``
every 16 steps (the time it waited for a CPU) and, once the process uses CUDA, two CUDA
events (recorded, never waited for: they are read back lazily with
``Event.query()`` and one ``Event.synchronize()`` when the report is made); the time
between them is the span of the step's GPU work, an upper bound on its busy time. A
background thread samples GPU utilisation and memory (NVML) and process and host CPU
(psutil) ten times a second. :func:`analyse` (in ``_analysis``) turns the
timeline into a verdict: input-bound, compute-bound, host-bound, GPU unused or periodic
stalls.

Memory stays bounded however long the loop runs: the watch keeps the most recent
``max_records`` steps (100,000 by default: at most 8 MB on the CPU, about 30 MB under
CUDA) and as many background samples (2.8
hours at ten a second); older ones are dropped, the report counts them
(``dropped_steps``, ``dropped_samples``) and its figures cover what was kept.

The :class:`Watch` here holds the state and the public calls; the iterator ``w.iter()``
returns is in ``_watch_iter``, the per-step log in ``_watch_steps``, how the report is made
in ``_watch_report``, and what it gathers besides the timeline in ``_watch_inputs``.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import torch

from trainperf._utils.validate import non_negative_int, positive_int, positive_number
from trainperf.device import resolve_device
from trainperf.monitor._probe import CpuClock
from trainperf.monitor._probe import background_saves as _background_saves
from trainperf.monitor._probe import rank_cpus as _rank_cpus
from trainperf.monitor._report import WatchReport
from trainperf.monitor._sampler import MAX_RECORDS, _Sampler
from trainperf.monitor._watch_iter import (
    _Pass,
    _Source,
    _Timed,
    check_iterable,
    note_source,
    refuse_own,
)
from trainperf.monitor._watch_report import build_report
from trainperf.monitor._watch_steps import cpu_reading, exclude_from_next, record_step, settle

__all__ = ["Watch", "watch"]

T = TypeVar("T")
_MAX_SAMPLES = 2**63 - 1  # the largest count the step log's int64 array holds
# Each sample costs the sampler thread ~0.1-0.2 ms of CPU (psutil, /proc, NVML), holding the
# GIL for much of it; /proc counts CPU time in 10 ms ticks, so a shorter interval samples
# noise while taking CPU (and the GIL) from the loop it watches.
_MIN_INTERVAL = 0.01
_RUN_IT = "inside `with trainperf.watch() as w:`, or between w.start() and w.stop()"


class Watch:
    """Times a training loop and samples GPU and CPU use; see :func:`watch`.

    Use it as a context manager (``with trainperf.watch() as w:``) or, to leave the loop's
    indentation alone, call :meth:`start` before the loop and :meth:`stop` after it. Either
    way a watch runs once.

    Raises:
        ValueError: ``interval`` is not a finite number of seconds from 0.01 to
            ``threading.TIMEOUT_MAX``, ``warmup_steps`` not an int >= 0,
            ``max_records`` not an int >= 1 (at most ``sys.maxsize``), or ``device`` is
            invalid (not CPU or CUDA).
        TypeError: ``device`` is not a str, int, torch.device or None.
        DeviceError: a CUDA ``device`` without CUDA, or a CUDA index beyond the visible GPUs.
    """

    def __init__(
        self,
        *,
        device: str | torch.device | None = None,
        interval: float = 0.1,
        warmup_steps: int = 2,
        max_records: int = MAX_RECORDS,
    ) -> None:
        max_records, interval = _checked_limits(max_records, interval)
        warmup_steps = non_negative_int("warmup_steps", warmup_steps)
        # None is not "the best device" here but "follow whatever the loop uses".
        self._device = (
            None if device is None else resolve_device(device, allowed=("cpu", "cuda"), auto=False)
        )
        self._interval = interval
        self._warmup = warmup_steps
        self._max = max_records
        self._state = "new"
        self._t0 = 0.0
        self._wall0 = 0.0  # time.time() at _t0: where an adaptive loader's changes fall
        # (step, TuningChange) for each change an adaptive loader in w.iter() made.
        self._retunes: list[tuple[int, Any]] = []
        # Per step, in compact arrays; once they hold 2 x max_records steps the oldest half
        # goes at once (amortised O(1) per step), so at most 2 x max_records are ever held.
        self._ends = array("d")
        self._waits = array("d")
        self._counts = array("q")
        self._wait_cpus = array("d")  # CPU the loop's thread demanded while waiting
        self._delays = array("d")  # time it waited for a CPU (NaN: not known)
        self._unsettled = 0  # steps since the last schedstat reading (see settle)
        self._first = 0  # the index of the step at self._ends[0]
        self._dropped_end = 0.0  # when the last dropped step ended
        self._pending_wait = 0.0
        self._pending_wait_cpu = 0.0
        self._pending_count = 0
        self._count_known = True
        self._items = 0  # batches w.iter() yielded
        self._iterated = False  # w.iter() was used: the data wait is measured
        self._passes: list[_Pass] = []  # w.iter() passes not exhausted (the newest few)
        self._clock = CpuClock()
        # (run, delay, generation) at the last schedstat reading: see settle().
        self._last_reading = (math.nan, math.nan, 0)
        self._reading_at = 0.0  # when it was made: seconds from _t0
        # What w.iter() was given, by id: each loader's settings, the steps it fed, and its
        # first batch's layout (the predictions use the loader that fed the most steps).
        self._sources: dict[int, _Source] = {}
        self._sampler: _Sampler | None = None
        self._cpus = 1
        # CUDA events: (step index, event at the step's first batch, event at its end).
        self._cuda = False
        self._stream: Any = None
        self._step_start: Any = None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._gpu_busy: dict[int, float] = {}
        # The step log's writer (the loop's thread, at each w.step()) and a w.report() from
        # any thread take turns; the loop's thread is the one that steps.
        # Re-entrant: a signal handler's w.report() may interrupt this thread inside either.
        self._lock = threading.RLock()
        self._writing = False  # a step is being appended (a report then reads what is whole)
        self._trimming = False  # the oldest steps are being dropped (a report reads none)
        # Threads are told apart as objects (`is`), never by get_ident(): Python gives an
        # ended thread's ident to the next one, and a thread per epoch would then look like one.
        self._loop_thread: threading.Thread | None = None  # the starting thread, then the stepper
        self._stepper: threading.Thread | None = None  # the thread that steps (claim_steps)
        self._fetcher: threading.Thread | None = None  # another that took batches before it
        # (thread iterating w.iter(), thread stepping) once they differ: see wait_elsewhere.
        self._wait_elsewhere: tuple[str, str] | None = None
        # Seconds of in-loop w.report() calls, by the step they fell in: not the step's time.
        self._excluded: dict[int, float] = {}
        # Background checkpoint writes started before the loop and by its end (None: runs).
        self._saves_before = 0
        self._saves_after: int | None = None

    def __enter__(self) -> Watch:
        if self._state == "running":
            raise RuntimeError(
                "`with w:` on a watch that w.start() already started: use either `with "
                "trainperf.watch() as w:` or w.start() before the loop and w.stop() after "
                "it, not both"
            )
        if self._state != "new":
            raise RuntimeError("a Watch can be entered once; make a new one with trainperf.watch()")
        self._begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "running":  # w.stop() inside the block already ended it
            self._end()

    def start(self) -> Watch:
        """Start watching without a ``with`` block: the loop keeps its indentation.

        Call :meth:`stop` after the loop; it stops the background thread and returns the
        report. If the loop can raise, stop in a ``finally:`` (or use ``with``): a watch
        that is never stopped samples until it is garbage-collected.

        Returns:
            This watch, so ``w = trainperf.watch().start()`` works.

        Raises:
            RuntimeError: the watch is already running, or already ran (a watch runs once).

        Example:
            >>> w = watch(device="cpu")
            >>> _ = w.start()
            >>> for batch in w.iter([torch.zeros(4, 2)] * 8):
            ...     w.step()
            >>> report = w.stop()
            >>> report.steps, report.wait_fraction is not None  # w.iter measured the wait
            (8, True)
        """
        if self._state == "running":
            raise RuntimeError(
                "w.start() on a watch that is already running: call it once, before the loop, "
                "and w.stop() once, after it"
            )
        if self._state == "done":
            raise RuntimeError(
                "w.start() on a watch that already ran: a watch runs once; make a new one "
                "with trainperf.watch()"
            )
        self._begin()
        return self

    def stop(self) -> WatchReport:
        """Stop watching (the background thread ends) and return the report on the loop.

        :meth:`report` gives the same report again afterwards.

        Returns:
            The :class:`WatchReport` on the whole loop.

        Raises:
            RuntimeError: the watch never started, or already stopped.

        Example:
            >>> w = watch(device="cpu").start()
            >>> for _ in range(3):
            ...     w.step(samples=4)
            >>> w.stop().steps, w.report().steps
            (3, 3)
        """
        if self._state == "new":
            raise RuntimeError(
                "w.stop() before w.start(): call w.start() before the loop and w.stop() after "
                "it, or use `with trainperf.watch() as w:`"
            )
        if self._state == "done":
            raise RuntimeError(
                "w.stop() on a watch that already stopped: w.report() gives its report again"
            )
        self._end()
        return self.report()

    def _begin(self) -> None:
        self._state = "running"
        try:
            self._start_sampling()
        except BaseException:
            # An error (or a Ctrl-C in NVML's start-up) must not leave the sampler running,
            # nor the watch marked running: it ran, and failed.
            self._state = "done"
            self._stop_sampling()
            raise

    def _start_sampling(self) -> None:
        self._loop_thread = threading.current_thread()  # until a step says otherwise
        self._cpus = _rank_cpus()
        self._saves_before = _background_saves()
        weakref.finalize(self, self._clock.close)
        want_gpu = self._device is None or self._device.type == "cuda"
        sampler = _Sampler(self._interval, time.perf_counter(), gpu=want_gpu, max_samples=self._max)
        self._sampler = sampler
        sampler.start()
        # A started watch that is dropped unstopped must not leave its thread sampling.
        weakref.finalize(self, sampler.request_stop)
        sampler.ready.wait(timeout=10)
        self._maybe_start_cuda()
        # The clock starts once the sampler is up (NVML start-up is not the loop's time); the
        # sampler takes its first sample an interval after it is told to go. So does the
        # schedstat count: waiting for a CPU while the sampler started is no step's delay.
        self._last_reading = cpu_reading(self)
        self._t0 = sampler.t0 = time.perf_counter()
        self._wall0 = time.time()
        sampler.go.set()

    def _end(self) -> None:
        self._state = "done"
        try:
            self._saves_after = _background_saves()  # before a report's probe saves its own
            with self._lock:
                settle(self)  # in the loop's thread, while its schedstat is still the one open
        finally:  # whatever failed above, the sampler thread ends here
            self._stop_sampling()

    def _stop_sampling(self) -> None:
        try:
            self._clock.close()
        finally:
            if self._sampler is not None:
                self._sampler.stop()

    def _maybe_start_cuda(self) -> None:
        # Never initialise CUDA ourselves: only follow a loop that already uses it.
        if self._device is not None and self._device.type == "cpu":
            return
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return
        index = self._device.index if self._device is not None else None
        if index is None:
            index = torch.cuda.current_device()
        self._stream = torch.cuda.current_stream(index)
        self._cuda = True
        if self._sampler is not None:
            self._sampler.device_index = index

    def iter(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing the wait for each item.

        Raises:
            RuntimeError: the watch is not running (use it inside ``with``, or between
                :meth:`start` and :meth:`stop`).
            TypeError: ``iterable`` is not iterable (``w.iter(5)``).
            ValueError: ``iterable`` is an iterator this watch's ``w.iter()`` returned: its
                waits and samples would count twice.

        The iterator it returns has the length of ``iterable`` where that has one (a
        DataLoader's batches per epoch: a progress bar's total). Starting the iterable
        (``iter(loader)``: its workers) is timed as a wait for data. An exception from the
        iterable passes through and the iterator goes on; once exhausted, iterating it
        again starts a new pass (an epoch). Batches taken but left without a
        :meth:`step` (a ``break``) do not count in the next pass's first step. Iterated in a
        thread other than the one that steps (a prefetch thread), its waits are not the
        loop's: the watch warns once and reports the data wait as not measured.

        Example:
            >>> with watch(device="cpu") as w:
            ...     batches = w.iter([torch.zeros(4, 2)] * 3)
            ...     for batch in batches:
            ...         w.step()
            >>> len(batches), [s.samples for s in w.report().timeline]
            (3, [4, 4, 4])
        """
        if self._state != "running":
            raise RuntimeError(f"w.iter() needs a running watch: use it {_RUN_IT}")
        check_iterable(iterable)
        refuse_own(self, iterable)
        self._iterated = True
        note_source(self, iterable)  # what the predictions need of the loader
        return _Timed(self, iterable)

    def step(self, samples: int | None = None) -> None:
        """Mark the end of a training step.

        Without :meth:`iter` the watch cannot tell the wait for data from the step: the
        report then says the data wait was not measured, and calls nothing input-bound.

        Args:
            samples: samples in this step, overriding what ``w.iter`` counted.

        The first thread to call it steps the watch (any thread may start, stop or report
        on it): one watch times one loop.

        Raises:
            RuntimeError: the watch is not running (use it inside ``with``, or between
                :meth:`start` and :meth:`stop`), or another thread, still running, stepped
                it first (give each thread its own watch).
            ValueError: ``samples`` is not an int >= 0 (and below 2**63).

        Example:
            >>> with watch(device="cpu") as w:
            ...     for _ in range(3):
            ...         w.step(samples=32)  # a loop without w.iter: say how many samples
            >>> r = w.report()
            >>> r.steps, r.timeline[0].samples
            (3, 32)
        """
        now = time.perf_counter()
        if self._state != "running":
            raise RuntimeError(f"w.step() needs a running watch: call it {_RUN_IT}")
        if samples is not None:
            samples = non_negative_int("samples", samples)
            if samples > _MAX_SAMPLES:  # the step log keeps counts as int64
                raise ValueError(
                    f"samples={samples!r} is more than a step can hold (at most 2**63 - 1): "
                    "pass the number of samples this step trained on"
                )
        record_step(self, now, samples)

    def report(self) -> WatchReport:
        """The verdict so far (while the watch runs) or on the whole loop (after it).

        Returns:
            A :class:`WatchReport`; ``print`` it, or ``.plot(path)`` for a timeline PNG.

        Raises:
            RuntimeError: the watch never ran (never entered, never started).

        Example:
            >>> with watch(device="cpu", warmup_steps=0) as w:
            ...     for batch in w.iter([torch.zeros(8, 3)] * 6):
            ...         w.step()
            ...     so_far = w.report()  # inside the loop: the verdict so far
            >>> so_far.steps, w.report().device
            (6, 'cpu')
        """
        if self._state == "new":
            raise RuntimeError(
                "w.report() needs a watch that ran: use `with trainperf.watch() as w:`, or "
                "w.start() before the loop and w.stop() after it"
            )
        began = time.perf_counter()
        try:
            return build_report(self)
        finally:
            if self._state == "running" and threading.current_thread() is self._loop_thread:
                # Made inside the loop: its time is not the step's (nor a periodic stall).
                exclude_from_next(self, time.perf_counter() - began)


def _checked_limits(max_records: int, interval: float) -> tuple[int, float]:
    """``max_records`` and ``interval`` checked: within what the sampler can keep and wait.

    Raises:
        ValueError: either is not a positive number, or is past what the sampler can do
            (``interval`` below 0.01 s or above ``threading.TIMEOUT_MAX``).
    """
    max_records = positive_int("max_records", max_records)
    if max_records > sys.maxsize:  # the sampler's deque cannot be longer
        raise ValueError(
            f"max_records={max_records!r} is more than a watch can keep (at most "
            f"sys.maxsize, {sys.maxsize}); pass a smaller count, e.g. 100_000"
        )
    interval = positive_number("interval", interval, unit="seconds")
    if interval > threading.TIMEOUT_MAX:
        # The sampler thread waits `interval` between samples; past this, the wait itself
        # raises OverflowError inside the thread.
        raise ValueError(
            f"interval={interval!r} s is longer than a timer can wait (at most "
            f"{threading.TIMEOUT_MAX:.0f} s); pass a shorter interval, e.g. 0.1"
        )
    if interval < _MIN_INTERVAL:
        raise ValueError(
            f"interval={interval!r} s is shorter than the sampler allows (at least "
            f"{_MIN_INTERVAL} s: each sample costs CPU the loop would use, and CPU time is "
            f"counted in 10 ms ticks); pass {_MIN_INTERVAL} or more, e.g. 0.1"
        )
    return max_records, interval


def watch(
    *,
    device: str | torch.device | None = None,
    interval: float = 0.1,
    warmup_steps: int = 2,
    max_records: int = MAX_RECORDS,
) -> Watch:
    """Watch a training loop and say what limits it: data, compute, the host, or stalls.

    Args:
        device: ``"cpu"`` for a CPU loop (no GPU is looked at), ``"cuda[:i]"`` for a GPU
            loop, or None to follow whatever the loop uses (CUDA once it is initialised).
            The watch never initialises CUDA itself.
        interval: seconds between background samples of GPU and CPU use (at least 0.01:
            a sample costs the sampler thread about 0.1-0.2 ms of CPU).
        warmup_steps: leading steps left out of the verdict (loader start-up, autotuning).
        max_records: the most recent steps, and background samples, kept for the report;
            older ones are dropped (and counted) so a run of any length uses bounded memory:
            a step costs 40 bytes (about 146 under CUDA; up to twice this many are held), a
            sample about 200 (250 with a GPU).

    Returns:
        A :class:`Watch`: use it as a context manager, or call ``w.start()`` before the
        loop and ``w.stop()`` (which returns the report) after it.

    Raises:
        ValueError: ``interval`` is not a finite number of seconds from 0.01 to
            ``threading.TIMEOUT_MAX``, ``warmup_steps`` not an int >= 0,
            ``max_records`` not an int >= 1 (at most ``sys.maxsize``), or ``device`` is
            invalid (not CPU or CUDA).
        TypeError: ``device`` is not a str, int, torch.device or None.
        DeviceError: a CUDA ``device`` without CUDA, or a CUDA index beyond the visible GPUs.

    Example:
        >>> import time
        >>> with watch(device="cpu") as w:
        ...     for batch in w.iter([torch.zeros(8, 3)] * 10):
        ...         time.sleep(0.002)
        ...         w.step()
        >>> r = w.report()
        >>> r.steps, r.verdict.kind in ("compute-bound", "input-bound", "periodic-stalls")
        (10, True)
    """
    return Watch(
        device=device, interval=interval, warmup_steps=warmup_steps, max_records=max_records
    )
