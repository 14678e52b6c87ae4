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
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import torch

from trainperf._utils.validate import non_negative_int, positive_int, positive_number
from trainperf.device import resolve_device
from trainperf.monitor._analysis import analyse
from trainperf.monitor._cpu_bf16 import with_cpu_bf16
from trainperf.monitor._crowding import with_crowding
from trainperf.monitor._figures import SAWTOOTH_WAIT, Figures
from trainperf.monitor._handover import batch_layout, measure_handover
from trainperf.monitor._probe import CpuClock, batch_size, loader_facts, loop_setup
from trainperf.monitor._probe import precision_in_use as _precision_in_use
from trainperf.monitor._probe import rank_cpus as _rank_cpus
from trainperf.monitor._report import LoaderChange, Sample, StepRecord, WatchReport
from trainperf.monitor._rules import MIN_STEPS
from trainperf.monitor._sampler import MAX_RECORDS, _Sampler
from trainperf.monitor._save_cost import with_save_cost
from trainperf.monitor._setup import LoopSetup

__all__ = ["Watch", "watch"]

T = TypeVar("T")
_OPEN_PASSES = 64  # open w.iter() passes remembered (peeks that never finish are dropped)
_RESOLVE_EVERY = 32  # steps between non-blocking reads of finished CUDA events
_SETTLE_EVERY = 16  # steps between reads of the loop thread's schedstat (see _settle)
_RUN_IT = "inside `with trainperf.watch() as w:`, or between w.start() and w.stop()"


@dataclass
class _Pass:
    """One pass of a :meth:`Watch.iter` iterator over its iterable: which iterable, and the
    samples it handed out since ``step`` (the watch's count of ``w.step()`` calls then)."""

    iterable_id: int
    step: int = 0
    taken: int = 0


class _Timed(Iterator[T]):
    """What :meth:`Watch.iter` returns: the iterable's items, with the time spent getting
    each one (``iter()`` of the iterable included: starting a DataLoader's workers is a wait
    for data) added to the watch's pending data wait, and the iterable's ``len()``.

    The iterator holds no item between calls (a batch on the GPU is not kept alive while
    the next one loads). An exception from the iterable passes through and the iterator
    goes on (a loop that skips a bad batch keeps its epoch). Iterating it again once it is
    exhausted starts a new pass over the iterable, as a DataLoader does each epoch (before
    that, iterating it again goes on with the pass it is in, as any iterator does).
    """

    def __init__(self, watch: Watch, iterable: Iterable[T]) -> None:
        self._watch, self._iterable = watch, iterable
        self._it: Iterator[T] | None = None  # iter(iterable), made (and timed) at first next()
        self._done = False
        self._pass = watch._new_pass(iterable)
        history = getattr(iterable, "tuning_history", None)
        # An AdaptiveDataLoader's changes (at iter(), or mid-epoch in next()) are read as
        # its history grows: each is marked at the step that took its first batch.
        self._history = history if isinstance(history, list) else None
        self._seen = len(self._history) if self._history is not None else 0

    def __iter__(self) -> _Timed[T]:
        if self._done:  # a new pass, like a DataLoader's next epoch
            self._pass = self._watch._new_pass(self._iterable)
            self._it, self._done = None, False
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        clock, cpu = time.perf_counter, time.thread_time
        t, c = clock(), cpu()
        try:
            if self._it is None:
                self._it = iter(self._iterable)
            item = next(self._it)
        except StopIteration:
            self._done = True
            self._watch._pass_ended(self._pass)
            raise
        finally:
            self._watch._add_wait(clock() - t, cpu() - c)
        if self._history is not None and len(self._history) > self._seen:
            self._watch._retuned(self._history[self._seen :])
            self._seen = len(self._history)
        self._watch._took(item, self._pass)
        return item

    @property
    def done(self) -> bool:
        """True once the iterable is exhausted (until a new pass starts)."""
        return self._done

    def __bool__(self) -> bool:  # an iterator is true, whatever its len() says
        return True

    def __len__(self) -> int:
        if not hasattr(self._iterable, "__len__"):
            name = type(self._iterable).__name__
            raise TypeError(f"the {name} given to w.iter() has no len()")
        return len(self._iterable)  # type: ignore[arg-type]


class Watch:
    """Times a training loop and samples GPU and CPU use; see :func:`watch`.

    Use it as a context manager (``with trainperf.watch() as w:``) or, to leave the loop's
    indentation alone, call :meth:`start` before the loop and :meth:`stop` after it. Either
    way a watch runs once.

    Raises:
        ValueError: ``interval`` is not a finite number > 0 (at most
            ``threading.TIMEOUT_MAX``), ``warmup_steps`` not an int >= 0,
            ``max_records`` not an int >= 1, or ``device`` is invalid (not CPU or CUDA).
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
        positive_int("max_records", max_records)
        interval = positive_number("interval", interval, unit="seconds")
        if interval > threading.TIMEOUT_MAX:
            # The sampler thread waits `interval` between samples; past this, the wait itself
            # raises OverflowError inside the thread.
            raise ValueError(
                f"interval={interval!r} s is longer than a timer can wait (at most "
                f"{threading.TIMEOUT_MAX:.0f} s); pass a shorter interval, e.g. 0.1"
            )
        non_negative_int("warmup_steps", warmup_steps)
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
        self._unsettled = 0  # steps since the last schedstat reading (see _settle)
        self._first = 0  # the index of the step at self._ends[0]
        self._dropped_end = 0.0  # when the last dropped step ended
        self._pending_wait = 0.0
        self._pending_wait_cpu = 0.0
        self._pending_count = 0
        self._count_known = True
        self._items = 0  # batches w.iter() yielded
        self._layout: tuple[int, ...] | None = None  # the first batch's tensor sizes
        self._layout_batch: int | None = None  # and its samples
        self._iterated = False  # w.iter() was used: the data wait is measured
        self._passes: list[_Pass] = []  # w.iter() passes not exhausted (the newest few)
        self._clock = CpuClock()
        # (run, delay, generation) at the last schedstat reading: see _settle().
        self._last_reading = (math.nan, math.nan, 0)
        self._loader: dict[str, Any] = {}  # the loader's settings at w.iter()
        self._loader_ref: Callable[[], object | None] = lambda: None
        self._sampler: _Sampler | None = None
        self._cpus = 1
        # CUDA events: (step index, event at the step's first batch, event at its end).
        self._cuda = False
        self._stream: Any = None
        self._step_start: Any = None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._gpu_busy: dict[int, float] = {}

    def __enter__(self) -> Watch:
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
        self._cpus = _rank_cpus()
        weakref.finalize(self, self._clock.close)
        self._last_reading = self._reading()
        want_gpu = self._device is None or self._device.type == "cuda"
        sampler = _Sampler(self._interval, time.perf_counter(), gpu=want_gpu, max_samples=self._max)
        self._sampler = sampler
        sampler.start()
        # A started watch that is dropped unstopped must not leave its thread sampling.
        weakref.finalize(self, sampler.request_stop)
        sampler.ready.wait(timeout=10)
        self._maybe_start_cuda()
        # The clock starts once the sampler is up (NVML start-up is not the loop's time); the
        # sampler takes its first sample an interval after it is told to go.
        self._t0 = sampler.t0 = time.perf_counter()
        self._wall0 = time.time()
        sampler.go.set()

    def _end(self) -> None:
        self._state = "done"
        self._settle()  # in the loop's thread, while its schedstat is still the one open
        self._clock.close()
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

        The iterator it returns has the length of ``iterable`` where that has one (a
        DataLoader's batches per epoch: a progress bar's total). Starting the iterable
        (``iter(loader)``: its workers) is timed as a wait for data. An exception from the
        iterable passes through and the iterator goes on; once exhausted, iterating it
        again starts a new pass (an epoch). Batches taken but left without a
        :meth:`step` (a ``break``) do not count in the next pass's first step.

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
        self._iterated = True
        self._loader = loader_facts(iterable)  # what the predictions need of the loader
        try:  # read again for the report: an adaptive loader changes its settings meanwhile
            self._loader_ref = weakref.ref(iterable)
        except TypeError:
            self._loader_ref = lambda: None
        return _Timed(self, iterable)

    def _new_pass(self, iterable: object) -> _Pass:
        """A pass over ``iterable`` starts. A pass over the same iterable left open (a
        ``break``) is over: the samples it handed out since the last ``w.step()`` were not
        trained on, so they leave the next step's count. Passes over other iterables (a
        validation loader inside the loop) are left alone."""
        steps = self._first + len(self._ends)
        for old in [p for p in self._passes if p.iterable_id == id(iterable)]:
            if old.step == steps and self._count_known:
                self._pending_count = max(0, self._pending_count - old.taken)
            self._passes.remove(old)
        new = _Pass(id(iterable), steps)
        self._passes.append(new)
        del self._passes[:-_OPEN_PASSES]
        return new

    def _pass_ended(self, done: _Pass) -> None:
        if done in self._passes:
            self._passes.remove(done)

    def _add_wait(self, wall: float, cpu: float) -> None:
        if self._state != "running":
            return
        self._pending_wait += wall
        self._pending_wait_cpu += cpu

    def _retuned(self, changes: list[Any]) -> None:
        step = self._first + len(self._ends)  # the step taking this batch
        self._retunes.extend((step, change) for change in changes)

    def _took(self, item: Any, now: _Pass) -> None:
        """Count a batch ``w.iter`` handed out (and, on CUDA, start its step's span)."""
        if self._state != "running":
            return  # iterated after stop(): the report stays as it was
        n = batch_size(item)
        steps = self._first + len(self._ends)
        if now.step != steps:
            now.step, now.taken = steps, 0
        now.taken += n or 0
        self._items += 1
        if self._layout is None:
            self._layout, self._layout_batch = batch_layout(item), n
        if n is None:
            self._count_known = False
        else:
            self._pending_count += n
        if self._cuda and self._step_start is None:
            # With the stream idle this event completes at once, so the step's span is
            # then host time; analyse() bounds it with NVML's utilisation.
            self._step_start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._step_start.record(self._stream)

    def step(self, samples: int | None = None) -> None:
        """Mark the end of a training step.

        Without :meth:`iter` the watch cannot tell the wait for data from the step: the
        report then says the data wait was not measured, and calls nothing input-bound.

        Args:
            samples: samples in this step, overriding what ``w.iter`` counted.

        Raises:
            RuntimeError: the watch is not running (use it inside ``with``, or between
                :meth:`start` and :meth:`stop`).
            ValueError: ``samples`` is not an int >= 0.

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
            non_negative_int("samples", samples)
        self._ends.append(now - self._t0)
        self._waits.append(self._pending_wait)
        self._wait_cpus.append(self._pending_wait_cpu)
        self._delays.append(math.nan)
        if samples is not None:
            self._counts.append(samples)
        else:
            self._counts.append(self._pending_count if self._count_known else -1)
        self._unsettled += 1
        if self._unsettled >= _SETTLE_EVERY:
            self._settle()
        self._pending_wait = 0.0
        self._pending_wait_cpu = 0.0
        self._pending_count = 0
        self._count_known = True
        if len(self._ends) >= 2 * self._max:
            self._trim()
        if not self._cuda:
            self._maybe_start_cuda()
            if not self._cuda:
                return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self._stream)
        self._pending.append((self._first + len(self._ends) - 1, self._step_start, end))
        self._step_start = None
        if len(self._ends) % _RESOLVE_EVERY == 0:
            self._resolve(block=False)

    def _reading(self) -> tuple[float, float, int]:
        demand, delay = self._clock.read()
        return demand - delay, delay, self._clock.generation

    def _settle(self) -> None:
        """Give the steps since the last schedstat reading their CPU figures.

        One reading every ``_SETTLE_EVERY`` steps (a ``pread`` costs a few microseconds;
        ``time.thread_time()`` around each batch costs less): the time the loop's thread
        waited for a CPU in between is spread evenly over those steps, and the CPU time
        each spent waiting for data is scaled by the interval's wait-for-a-CPU per second
        run, into what it demanded (running, plus waiting for a CPU). Without schedstat, or
        read from another thread, the delays stay unknown and the wait CPU is CPU time.
        """
        pending, self._unsettled = self._unsettled, 0
        if pending <= 0:
            return
        run, delay, generation = reading = self._reading()
        run0, delay0, generation0 = self._last_reading
        self._last_reading = reading
        if generation == generation0 and not math.isnan(delay + delay0):
            per_step = max(0.0, delay - delay0) / pending
            queued = max(0.0, delay - delay0) / (run - run0) if run > run0 else 0.0
            # The interval's steps still held (a trim may have dropped its first ones).
            for i in range(max(0, len(self._ends) - pending), len(self._ends)):
                self._delays[i] = per_step
                self._wait_cpus[i] *= 1 + queued

    def _trim(self) -> None:
        cut = len(self._ends) - self._max
        self._dropped_end = self._ends[cut - 1]
        del self._ends[:cut], self._waits[:cut], self._counts[:cut]
        del self._wait_cpus[:cut], self._delays[:cut]
        self._first += cut
        busy = self._gpu_busy
        while busy and (oldest := next(iter(busy))) < self._first:  # keys come in step order
            del busy[oldest]

    def _resolve(self, *, block: bool) -> None:
        if block and self._pending:
            self._pending[-1][2].synchronize()
        while self._pending and self._pending[0][2].query():
            index, start, end = self._pending.popleft()
            if start is not None:
                self._gpu_busy[index] = start.elapsed_time(end) / 1e3

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
        if self._cuda:
            self._resolve(block=True)
        if self._state == "running":
            self._settle()
        first, timeline = self._timeline()
        sampler = self._sampler
        if self._device is not None:
            device = str(self._device)
        else:
            device = (
                f"cuda:{sampler.device_index}"
                if sampler and sampler.device_index is not None
                else "auto"
            )
        samples, dropped_samples = sampler.snapshot() if sampler else ([], 0)
        cuda_index = sampler.device_index if self._cuda and sampler else None
        report = analyse(
            timeline,
            samples,
            device=device,
            gpu_present=bool(sampler and sampler.gpu_present),
            cuda_used=self._cuda,
            cpus=self._cpus,
            warmup_steps=self._warmup,
            dropped_steps=first,
            dropped_samples=dropped_samples,
            wait_measured=self._iterated,
            precision=_precision_in_use(),
            setup=loop_setup(self._loader_now(), cuda_index, **self._measured(timeline, samples)),
            measure=functools.partial(_probed, probe=self._state != "running"),
        )
        return dataclasses.replace(report, loader_changes=self._loader_changes())

    def _loader_changes(self) -> tuple[LoaderChange, ...]:
        """The adaptive loader's changes, placed on the watch's clock."""
        return tuple(
            LoaderChange(
                step=step,
                time=max(0.0, float(c.time) - self._wall0),
                old=(int(c.old[0]), c.old[1]),
                new=(int(c.new[0]), c.new[1]),
                reason=str(c.reason),
                why=str(c.why),
            )
            for step, c in self._retunes
        )

    def _measured(self, timeline: list[StepRecord], samples: list[Sample]) -> dict[str, Any]:
        """What the watch measures for the predictions beyond the timeline: batches per
        step, and (once) what a worker hand-over would cost a loop that loads in its own
        thread while it waits for data. The probe runs a worker for about a second, so
        only once the watch has stopped: a report made inside the loop would put that
        second into the loop's step (it uses a measurement made before, if any)."""
        steps = self._first + len(self._ends)
        out: dict[str, Any] = {"batches_per_step": self._items / steps if steps else None}
        kept = timeline[max(0, self._warmup - self._first) :]
        total = sum(s.duration for s in kept)
        waits = total > 0 and sum(s.wait for s in kept) >= SAWTOOTH_WAIT * total
        if waits and self._loads_in_thread(samples) and self._layout and self._layout_batch:
            probe = self._state != "running"
            # The loop's own time between two batches: the probe pauses that long before
            # each receive (a receive after a step costs more than one in a tight loop).
            own = statistics.median(s.duration - s.wait for s in kept)
            pause = max(0.0, own) / max(1.0, out["batches_per_step"] or 1.0)
            handover = measure_handover(
                self._layout, self._layout_batch, pause_s=pause, probe=probe
            )
            if handover is not None:
                out["handover_receive_s"] = handover.receive_s
                out["handover_produce_s"] = handover.produce_s
        return out

    def _loader_now(self) -> dict[str, Any]:
        """The settings of the loader ``w.iter()`` was given, as they are now (an adaptive
        loader's change them while it runs), or as they were then if it is gone."""
        loader = self._loader_ref()
        return self._loader if loader is None else loader_facts(loader)

    def _loads_in_thread(self, samples: list[Sample]) -> bool:
        """The loop loads in its own thread: a DataLoader with ``num_workers=0``, or an
        iterable of another kind while this process's children used under a tenth of a
        core (more would be workers behind it: a prefetcher around a DataLoader, say)."""
        facts = self._loader_now()
        if "num_workers" in facts:
            return not facts["num_workers"]
        workers = [x.workers_cpu for x in samples if x.workers_cpu is not None]
        return not workers or sum(workers) / len(workers) < 10.0

    def _timeline(self) -> tuple[int, list[StepRecord]]:
        """The number of the first step kept, and the kept steps as :class:`StepRecord` s."""
        extra = max(0, len(self._ends) - self._max)  # held beyond max_records: not reported
        first = self._first + extra
        previous = self._ends[extra - 1] if extra else self._dropped_end
        timeline = []
        steps = zip(
            self._ends[extra:], self._waits[extra:], self._counts[extra:],
            self._wait_cpus[extra:], self._delays[extra:], strict=True,
        )  # fmt: skip
        for i, (end, wait_s, count, wait_cpu, delay) in enumerate(steps, start=first):
            duration = end - previous
            timeline.append(
                StepRecord(
                    index=i,
                    start=previous,
                    wait=min(wait_s, duration),
                    compute=max(0.0, duration - wait_s),
                    samples=None if count < 0 else count,
                    gpu_busy=self._gpu_busy.get(i),
                    wait_cpu=wait_cpu,
                    cpu_delay=None if math.isnan(delay) else max(0.0, delay),
                )
            )
            previous = end
        return first, timeline


def _probed(f: Figures, *, probe: bool) -> LoopSetup | None:
    """The judged figures' setup with what the predictions' probes measured (the crowding
    of torch's threads, bf16 on a CPU, a non-blocking save's), or None where none applies.
    ``probe=False`` (a report made inside the loop) only uses earlier measurements: a
    probe's second would land in the loop's step. Too few steps for a verdict: no probe
    (there is nothing to predict)."""
    if f.measured_steps < MIN_STEPS:
        return None
    setup = None
    for measure in (with_crowding, with_cpu_bf16, with_save_cost):
        found = measure(f, probe=probe)
        if found is not None:
            setup = found
            f = dataclasses.replace(f, setup=found)
    return setup


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
        interval: seconds between background samples of GPU and CPU use.
        warmup_steps: leading steps left out of the verdict (loader start-up, autotuning).
        max_records: the most recent steps, and background samples, kept for the report;
            older ones are dropped (and counted) so a run of any length uses bounded memory:
            a step costs 40 bytes (about 146 under CUDA; up to twice this many are held), a
            sample about 200 (250 with a GPU).

    Returns:
        A :class:`Watch`: use it as a context manager, or call ``w.start()`` before the
        loop and ``w.stop()`` (which returns the report) after it.

    Raises:
        ValueError: ``interval`` is not a finite number > 0 (at most
            ``threading.TIMEOUT_MAX``), ``warmup_steps`` not an int >= 0,
            ``max_records`` not an int >= 1, or ``device`` is invalid (not CPU or CUDA).
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
