"""Steady-state throughput of one DataLoader configuration, surviving broken workers.

:func:`measure` builds the DataLoader (:mod:`trainperf.loader._fetch`: its arguments, and
every wait for a batch cut to the deadline), takes the first batch on its own (the start-up), then
hands the batches to :func:`~trainperf.loader._windows.time_windows`, which drops the
prefetch burst and times windows until they agree (why: :mod:`trainperf.loader._windows`).
Alongside, it reads what the workers cost: their CPU demand during the windows, and their
private memory after the first batch and at the end, projected over the run
(:mod:`trainperf.loader._memory`).

Short datasets are cycled: workers are kept alive across epochs (``persistent_workers``) so
a window never contains a worker restart, and the clock keeps running over the epoch
boundary, whose small refill gap is a real cost of training too.

Faults are caught per configuration: a worker that crashes, a worker SIGKILLed (most likely
by the out-of-memory killer: a ``memory`` fault quoting the workers' memory), a dataset that
raises in a worker, a hang (DataLoader ``timeout``), a dataset that cannot be pickled for
``spawn``, and ``/dev/shm`` running out. The iterator is shut down explicitly (an
exception's traceback keeps it alive in a reference cycle, and garbage collection of a
cycle breaks the queues it needs to stop its workers cleanly), hung workers are killed
first, and the process table is checked afterwards so no worker outlives the measurement.
Every worker also dies with this process (:class:`trainperf.DieWithParent`), so a tuner
killed with SIGKILL leaves none behind.

With workers the deadline is a hard limit: every wait for a batch is cut to the time left
(the hang timeout only when that is shorter), and workers that could not stop gracefully
before it are killed. A pool that delivers no batch at all before the deadline is reported
as a possible hang, since the tuner cannot tell a hang from a budget too short to start it.
With ``num_workers=0`` the batch is loaded in this process, and nothing can interrupt it
safely (a thread left running would go on using the dataset while training starts), so a
batch is only started when the last one says it ends before the deadline: the first one,
or one slower than the one before, may run past it.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainperf._utils.batches import batch_bytes, samples_in
from trainperf._utils.steal import StealMeter, undo_steal
from trainperf._utils.validate import non_negative_int, positive_int, positive_number
from trainperf.loader._adapt_init import InitFailed, init_reason
from trainperf.loader._cache import length
from trainperf.loader._faults import (
    budget_cut_reason,
    classify_fault,
    oom_figures,
    start_method,
)
from trainperf.loader._fetch import Batches, Spec, loader_kwargs_for
from trainperf.loader._memory import UssReading, projected_uss
from trainperf.loader._report import CandidateResult, FaultKind
from trainperf.loader._windows import (
    DEFAULT_POLICY,
    DeadlineReached,
    WindowPolicy,
    WindowTiming,
    time_windows,
)
from trainperf.loader._workers import (
    WorkerProcesses,
    child_signals_held,
    close_iterator,
    sigkilled_workers,
    thread_busy_seconds,
)

__all__ = ["measure"]


@dataclass
class _Readings:
    """What one measurement reads besides the rate, filled in as it goes."""

    workers: WorkerProcesses
    num_workers: int
    on_tick: Callable[[], None] | None
    last_tick: float
    on_first_batch: Callable[[Any], None] | None = None
    startup_s: float | None = None
    batch_bytes: int | None = None
    first_uss: UssReading | None = None
    cpu_start: tuple[float, float, float] | None = None  # wall, workers' and main busy s
    steal: StealMeter | None = None
    worker_cpu: float | None = None
    main_cpu: float | None = None

    def windows_start(self) -> None:
        """Start the CPU clocks: wall time, the workers' and this thread's busy seconds, and
        the host's stolen time."""
        self.steal = StealMeter()
        self.cpu_start = (time.perf_counter(), self.workers.busy_seconds(), thread_busy_seconds())

    def batch_arrived(self, now: float) -> None:
        """Every ~0.2 s: the workers' resident memory, and a progress tick."""
        if now - self.last_tick >= 0.2:
            self.last_tick = now
            if self.num_workers > 0:
                self.workers.sample_rss()
            if self.on_tick is not None:
                self.on_tick()

    def windows_end(self) -> None:
        """Cores the workers and the main thread demanded over the windows: busy seconds
        per second, over the share of the time the hypervisor left this machine (on a VM
        whose CPUs are shared, stolen time is in neither a thread's run time nor its wait:
        :mod:`trainperf._utils.steal`)."""
        if self.cpu_start is None:
            return
        wall0, workers0, main0 = self.cpu_start
        wall = max(time.perf_counter() - wall0, 1e-9)
        stolen = None if self.steal is None else self.steal.share()
        self.main_cpu = undo_steal((thread_busy_seconds() - main0) / wall, stolen)
        if self.num_workers > 0:
            self.worker_cpu = undo_steal((self.workers.busy_seconds() - workers0) / wall, stolen)


def _first_batch(batches: Batches, readings: _Readings, t0: float) -> None:
    """Take the first batch: the start-up time, a batch's bytes, the first memory reading."""
    first = batches.fetch()
    readings.startup_s = time.perf_counter() - t0
    readings.batch_bytes = batch_bytes(first)
    batches.samples = samples_in(first, batches.spec.batch_size)
    if readings.on_first_batch is not None:
        readings.on_first_batch(first)
    del first
    if readings.num_workers > 0:
        readings.workers.scan(batches.it)
        readings.workers.sample_rss()
        # Before the skipped batches, which absorb the pause this reading causes.
        readings.first_uss = (batches.samples, readings.workers.uss_by_pid())


def _time(batches: Batches, readings: _Readings, policy: WindowPolicy) -> WindowTiming:
    spec = batches.spec
    return time_windows(
        batches.next_batch,
        skip=policy.skip_batches(spec.num_workers, spec.prefetch_factor),
        window_batches=policy.window_batches(spec.num_workers, spec.prefetch_factor),
        policy=policy,
        deadline=spec.deadline,
        on_batch=readings.batch_arrived,
        on_first_window=readings.windows_start,
        sync=None if spec.cuda_device is None else batches.sync,
    )


def _worker_fault(
    error: Exception,
    batches: Batches,
    readings: _Readings,
    loader_kwargs: Mapping[str, Any],
) -> tuple[FaultKind, str]:
    if isinstance(error, InitFailed):  # the caller's worker_init_fn, not the dataset
        return "error", init_reason(loader_kwargs.get("worker_init_fn"), error)
    spec = batches.spec
    inflight = (
        None
        if readings.batch_bytes is None
        else readings.batch_bytes * spec.num_workers * (spec.prefetch_factor or 0)
    )
    first_uss = readings.first_uss
    figures = oom_figures(
        spec.num_workers,
        workers_rss=readings.workers.peak_rss or None,
        worker_uss=max(first_uss[1].values()) if first_uss and first_uss[1] else None,
        memory_available=spec.memory_available,
    )
    return classify_fault(
        error,
        start_method=start_method(loader_kwargs),
        timeout_s=spec.hang_timeout_s,
        inflight_bytes=inflight,
        shm_free=spec.shm_free,
        sigkilled=bool(sigkilled_workers(batches.it, error)),
        memory_figures=figures,
    )


def _kill_first(spec: Spec, timing: WindowTiming | None, fault: FaultKind | None) -> bool:
    """Whether to kill the workers before the join.

    After any fault, killing first is what keeps a hung worker from costing a 5-second
    join; healthy workers lose nothing. A graceful stop waits for each worker to finish the
    batch in hand, so it is only tried when that ends before the deadline.
    """
    if fault is not None:
        return True
    rate = timing.samples_per_s if timing is not None else None
    batch_s = spec.num_workers * spec.batch_size / rate if rate else math.inf
    return time.perf_counter() + batch_s >= spec.deadline


def _stop(
    batches: Batches,
    readings: _Readings,
    timing: WindowTiming | None,
    fault: FaultKind | None,
) -> int | None:
    """Read the workers' memory a last time (unless they failed), then stop them.

    Returns:
        The private memory one worker is projected to reach, or None.
    """
    spec, workers = batches.spec, readings.workers
    uss = None
    if spec.num_workers > 0 and fault is None:
        uss = projected_uss(
            readings.first_uss,
            (batches.samples, workers.uss_by_pid()),
            num_workers=spec.num_workers,
            batch_bytes=readings.batch_bytes or 0,
            # The whole dataset: a worker kept across shuffled epochs meets every sample,
            # and even one epoch's share of random samples touches most pages (each holds
            # many objects).
            samples_per_worker=length(spec.dataset),
        )
    if spec.num_workers > 0:
        workers.scan(batches.it)
        close_iterator(batches.it, workers, kill_first=_kill_first(spec, timing, fault))
    batches.release()
    return uss


def _result(
    spec: Spec,
    readings: _Readings,
    uss: int | None,
    timing: WindowTiming | None,
    fault: tuple[FaultKind, str] | None,
    elapsed_s: float,
) -> CandidateResult:
    peak = readings.workers.peak_rss or None
    common: dict[str, Any] = {
        **spec.config(),
        "startup_s": readings.startup_s,
        "worker_peak_rss": peak if spec.num_workers > 0 else None,
        "worker_uss": uss,
        "batch_bytes": readings.batch_bytes,
        "elapsed_s": elapsed_s,
    }
    if fault is not None:
        return CandidateResult(**common, status="failed", fault=fault[0], reason=fault[1])
    if timing is None or not timing.rates:
        return CandidateResult(
            **common,
            status="failed",
            fault="budget",
            reason="the time budget ran out before one steady-state window was timed",
        )
    return CandidateResult(
        **common,
        status="ok",
        samples_per_s=timing.samples_per_s,
        spread=timing.spread,
        windows=len(timing.rates),
        batches=timing.batches,
        worker_cpu=readings.worker_cpu,
        main_cpu=readings.main_cpu,
    )


def measure(
    dataset: Any,
    batch_size: int,
    loader_kwargs: Mapping[str, Any],
    *,
    num_workers: int,
    prefetch_factor: int | None,
    pin_memory: bool,
    deadline: float,
    hang_timeout_s: float = 30.0,
    device: torch.device | None = None,
    shm_free: int | None = None,
    memory_available: int | None = None,
    policy: WindowPolicy = DEFAULT_POLICY,
    on_tick: Callable[[], None] | None = None,
    on_first_batch: Callable[[Any], None] | None = None,
) -> CandidateResult:
    """Measure one configuration's steady-state samples/s (see the module docstring).

    With ``num_workers=0`` exceptions from the dataset propagate: there is no worker to
    blame and nothing to fall back to. With workers they become a failed result.

    Args:
        dataset: the dataset.
        batch_size: samples per batch.
        loader_kwargs: the caller's other DataLoader arguments (``timeout`` and
            ``persistent_workers`` are set here; a ``worker_init_fn`` runs after the
            worker's first garbage collection).
        num_workers: worker processes.
        prefetch_factor: batches in flight per worker (None when ``num_workers=0``).
        pin_memory: copy batches to page-locked memory.
        deadline: ``time.perf_counter()`` value by which to stop. With workers no wait for a
            batch runs past it (stopping them may take a few milliseconds more); with
            ``num_workers=0`` a batch is loaded in this process, which nothing interrupts,
            so a batch is not started when the previous one says it would end after the
            deadline, and the first batch (or one slower than the one before) may run past
            it.
        hang_timeout_s: seconds without a batch that count as a hang (each wait is cut to
            the time left before ``deadline`` when that is shorter).
        device: a CUDA device to copy each batch to (timed, as training would), else None.
        shm_free: free ``/dev/shm`` bytes, quoted if it runs out.
        memory_available: available memory in bytes, quoted if a worker is SIGKILLed (a
            ``memory`` fault: most likely the out-of-memory killer).
        policy: window sizes and stopping rule.
        on_tick: called every ~0.2 s (progress display).
        on_first_batch: called with the first batch, outside the timed windows (the tuner
            checks that workers could send it back: :mod:`trainperf.loader._picklable`).

    Returns:
        The :class:`CandidateResult`; with workers, its ``worker_uss`` is the private memory
        one worker is projected to reach over the run (see
        :func:`~trainperf.loader._memory.project_worker_uss`).

    Raises:
        ValueError: the loader yields no batch at all; ``batch_size`` or ``prefetch_factor``
            (None allowed) is not an int >= 1, ``num_workers`` not an int >= 0, or
            ``hang_timeout_s`` not a positive number of seconds (NumPy's integers and
            floats are taken, as the Python numbers they equal).

    Example:
        >>> import time
        >>> from torch.utils.data import TensorDataset
        >>> r = measure(TensorDataset(torch.zeros(64, 3)), 8, {}, num_workers=0,
        ...             prefetch_factor=None, pin_memory=False, deadline=time.perf_counter() + 5)
        >>> r.status, r.samples_per_s > 0, r.batch_bytes
        ('ok', True, 96)
    """
    t0 = time.perf_counter()
    spec = Spec(
        dataset,
        # As Python numbers (a NumPy scalar converted): DataLoader refuses a NumPy
        # batch_size, and the result's to_dict() must stay JSON-safe.
        positive_int("batch_size", batch_size),
        non_negative_int("num_workers", num_workers),
        positive_int("prefetch_factor", prefetch_factor, none_ok=True),
        pin_memory,
        deadline,
        positive_number("hang_timeout_s", hang_timeout_s, unit="seconds"),
        cuda_device=device if device is not None and device.type == "cuda" else None,
        shm_free=shm_free,
        memory_available=memory_available,
    )
    remaining = deadline - t0
    if remaining <= 0.05:
        return CandidateResult(
            **spec.config(),
            status="skipped",
            fault="budget",
            reason="the time budget ran out before it could start",
        )
    batches = Batches(spec, *loader_kwargs_for(loader_kwargs, spec, remaining))
    readings = _Readings(
        WorkerProcesses(), spec.num_workers, on_tick, last_tick=t0, on_first_batch=on_first_batch
    )
    timing: WindowTiming | None = None
    fault: tuple[FaultKind, str] | None = None
    try:
        with warnings.catch_warnings():
            # torch repeats its generic advice (pickling, worker counts) for every
            # configuration; the report states the actual fault instead.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.utils\.data")
            batches.start()
            _first_batch(batches, readings, t0)
            timing = _time(batches, readings, policy)
            readings.windows_end()
    except DeadlineReached as e:
        # Only the first batch gets here (time_windows stops quietly on later ones): the
        # pool delivered nothing in the time the budget left it.
        fault = ("hang", budget_cut_reason(remaining))
        traceback.clear_frames(e.__traceback__)
    except Exception as e:
        if spec.num_workers == 0 or (isinstance(e, ValueError) and "yields no batch" in str(e)):
            raise
        with child_signals_held():  # other workers may die while this one is looked at
            fault = _worker_fault(e, batches, readings, loader_kwargs)
        # The traceback's frames hold the iterator; clearing them lets it go now.
        traceback.clear_frames(e.__traceback__)
    finally:
        with child_signals_held():
            uss = _stop(batches, readings, timing, None if fault is None else fault[0])
    return _result(spec, readings, uss, timing, fault, time.perf_counter() - t0)
