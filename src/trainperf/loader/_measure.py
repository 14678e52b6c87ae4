"""Steady-state throughput of one DataLoader configuration, surviving broken workers.

:func:`measure` builds the DataLoader, takes the first batch on its own (the start-up), then
hands the batches to :func:`~trainperf.loader._windows.time_windows`, which drops the
prefetch burst and times windows until they agree (why: :mod:`trainperf.loader._windows`).
Alongside, it reads what the workers cost: their CPU demand during the windows, and their
private memory after the first batch and at the end, projected over the run
(:mod:`trainperf.loader._memory`).

Short datasets are cycled: workers are kept alive across epochs (``persistent_workers``) so
a window never contains a worker restart, and the clock keeps running over the epoch
boundary, whose small refill gap is a real cost of training too.

Faults are caught per configuration: a worker that crashes or is killed, a dataset that
raises in a worker, a hang (DataLoader ``timeout``), a dataset that cannot be pickled for
``spawn``, and ``/dev/shm`` running out. The iterator is shut down explicitly (an exception's
traceback keeps it alive in a reference cycle, and garbage collection of a cycle breaks
the queues it needs to stop its workers cleanly), hung workers are killed first, and the
process table is checked afterwards so no worker outlives the measurement.

The deadline is a hard limit: every wait for a batch is cut to the time left (the hang
timeout only when that is shorter), and workers that could not stop gracefully before it
are killed. A pool that delivers no batch at all before the deadline is reported as a
possible hang, since the tuner cannot tell a hang from a budget too short to start it.
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
from torch.utils.data import DataLoader

from trainperf.loader._batches import batch_bytes, samples_in
from trainperf.loader._cache import length
from trainperf.loader._faults import (
    WorkerProcesses,
    budget_cut_reason,
    classify_fault,
    close_iterator,
    start_method,
    thread_busy_seconds,
)
from trainperf.loader._memory import CollectFirst, UssReading, projected_uss
from trainperf.loader._report import CandidateResult, FaultKind
from trainperf.loader._windows import (
    DEFAULT_POLICY,
    DeadlineReached,
    WindowPolicy,
    WindowTiming,
    time_windows,
)

__all__ = ["measure"]


@dataclass(frozen=True)
class _Spec:
    """What one measurement was asked to do."""

    dataset: Any
    batch_size: int
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    deadline: float
    hang_timeout_s: float
    cuda_device: torch.device | None  # where each batch is copied, as training would

    def config(self) -> dict[str, Any]:
        """The :class:`CandidateResult` fields that name the configuration."""
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "pin_memory": self.pin_memory,
        }


def _loader_kwargs(
    loader_kwargs: Mapping[str, Any], spec: _Spec, remaining: float
) -> tuple[dict[str, Any], float]:
    """The DataLoader arguments for this measurement, and the timeout it starts with."""
    kwargs = dict(loader_kwargs)
    kwargs.pop("timeout", None)
    kwargs.pop("persistent_workers", None)
    if spec.num_workers == 0:
        kwargs.pop("multiprocessing_context", None)
        return kwargs, 0.0
    # DataLoader needs a timeout to start with; each wait for a batch then sets its own.
    timeout_s = min(spec.hang_timeout_s, remaining)
    kwargs.update(prefetch_factor=spec.prefetch_factor, persistent_workers=True, timeout=timeout_s)
    kwargs["worker_init_fn"] = CollectFirst(kwargs.get("worker_init_fn"))
    return kwargs, timeout_s


class _Batches:
    """The batches of one DataLoader, every wait cut to the deadline. An epoch that ends
    starts the next one (persistent workers: the same processes)."""

    def __init__(self, spec: _Spec, kwargs: dict[str, Any], timeout_s: float) -> None:
        self.spec = spec
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.loader: Any = None
        self.it: Any = None
        self.samples = 0  # received so far, the first batch included

    def start(self) -> None:
        """Build the DataLoader and its iterator (which starts the workers)."""
        spec = self.spec
        self.loader = DataLoader(
            spec.dataset,
            batch_size=spec.batch_size,
            num_workers=spec.num_workers,
            pin_memory=spec.pin_memory,
            **self.kwargs,
        )
        self.it = iter(self.loader)

    def _next_in_time(self) -> Any:
        spec = self.spec
        if spec.num_workers == 0:
            return next(self.it)
        wait = min(spec.hang_timeout_s, spec.deadline - time.perf_counter())
        if wait <= 0.001:
            raise DeadlineReached
        # The budget is a hard limit, so no wait may outlast it: the iterator reads its
        # timeout before each wait (a private attribute; without it the wait is the one
        # DataLoader started with).
        settable = hasattr(self.it, "_timeout")
        if settable:
            self.it._timeout = wait
        try:
            return next(self.it)
        except RuntimeError as e:
            cut = (wait if settable else self.timeout_s) < spec.hang_timeout_s
            if cut and "timed out after" in str(e).lower():
                raise DeadlineReached from e
            raise

    def fetch(self) -> Any:
        """The next batch, from the next epoch when this one is done.

        Raises:
            ValueError: the loader yields no batch at all.
            DeadlineReached: the deadline passed while waiting.
        """
        try:
            return self._next_in_time()
        except StopIteration:
            self.it = iter(self.loader)
            try:
                return self._next_in_time()
            except StopIteration:
                raise ValueError(self._no_batch()) from None

    def _no_batch(self) -> str:
        dataset = self.spec.dataset
        return (
            f"the DataLoader yields no batch (batch_size={self.spec.batch_size}, "
            f"drop_last={self.kwargs.get('drop_last', False)!r}, "
            f"dataset of {len(dataset) if hasattr(dataset, '__len__') else '?'}"
            f" samples)"
        )

    def next_batch(self) -> int:
        """Fetch a batch, copy it to the CUDA device if any, and count its samples."""
        batch = self.fetch()
        device = self.spec.cuda_device
        if device is not None:
            from trainperf.device import to_device

            to_device(batch, device, non_blocking=self.spec.pin_memory)
        n = samples_in(batch, self.spec.batch_size)
        self.samples += n
        return n

    def sync(self) -> None:
        """Wait for the copies queued on the CUDA device."""
        torch.cuda.synchronize(self.spec.cuda_device)

    def release(self) -> None:
        """Drop the iterator and the loader (after :func:`close_iterator` stopped them)."""
        self.it = self.loader = None


@dataclass
class _Readings:
    """What one measurement reads besides the rate, filled in as it goes."""

    workers: WorkerProcesses
    num_workers: int
    on_tick: Callable[[], None] | None
    last_tick: float
    startup_s: float | None = None
    batch_bytes: int | None = None
    first_uss: UssReading | None = None
    cpu_start: tuple[float, float, float] | None = None  # wall, workers' and main busy s
    worker_cpu: float | None = None
    main_cpu: float | None = None

    def windows_start(self) -> None:
        """Start the CPU clocks: wall time, the workers' and this thread's busy seconds."""
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
        """Cores the workers and the main thread demanded over the windows."""
        if self.cpu_start is None:
            return
        wall0, workers0, main0 = self.cpu_start
        wall = max(time.perf_counter() - wall0, 1e-9)
        self.main_cpu = (thread_busy_seconds() - main0) / wall
        if self.num_workers > 0:
            self.worker_cpu = (self.workers.busy_seconds() - workers0) / wall


def _first_batch(batches: _Batches, readings: _Readings, t0: float) -> None:
    """Take the first batch: the start-up time, a batch's bytes, the first memory reading."""
    first = batches.fetch()
    readings.startup_s = time.perf_counter() - t0
    readings.batch_bytes = batch_bytes(first)
    batches.samples = samples_in(first, batches.spec.batch_size)
    del first
    if readings.num_workers > 0:
        readings.workers.scan()
        readings.workers.sample_rss()
        # Before the skipped batches, which absorb the pause this reading causes.
        readings.first_uss = (batches.samples, readings.workers.uss_by_pid())


def _time(batches: _Batches, readings: _Readings, policy: WindowPolicy) -> WindowTiming:
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
    spec: _Spec,
    readings: _Readings,
    loader_kwargs: Mapping[str, Any],
    shm_free: int | None,
) -> tuple[FaultKind, str]:
    inflight = (
        None
        if readings.batch_bytes is None
        else readings.batch_bytes * spec.num_workers * (spec.prefetch_factor or 0)
    )
    return classify_fault(
        error,
        start_method=start_method(loader_kwargs),
        timeout_s=spec.hang_timeout_s,
        inflight_bytes=inflight,
        shm_free=shm_free,
    )


def _kill_first(spec: _Spec, timing: WindowTiming | None, fault: FaultKind | None) -> bool:
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
    batches: _Batches,
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
        workers.scan()
        close_iterator(batches.it, workers, kill_first=_kill_first(spec, timing, fault))
    batches.release()
    return uss


def _result(
    spec: _Spec,
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
    policy: WindowPolicy = DEFAULT_POLICY,
    on_tick: Callable[[], None] | None = None,
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
        deadline: ``time.perf_counter()`` value by which to stop (a hard limit: no wait for a
            batch runs past it; stopping the workers may take a few milliseconds more).
        hang_timeout_s: seconds without a batch that count as a hang (each wait is cut to
            the time left before ``deadline`` when that is shorter).
        device: a CUDA device to copy each batch to (timed, as training would), else None.
        shm_free: free ``/dev/shm`` bytes, quoted if it runs out.
        policy: window sizes and stopping rule.
        on_tick: called every ~0.2 s (progress display).

    Returns:
        The :class:`CandidateResult`; with workers, its ``worker_uss`` is the private memory
        one worker is projected to reach over the run (see
        :func:`~trainperf.loader._memory.project_worker_uss`).

    Raises:
        ValueError: the loader yields no batch at all.

    Example:
        >>> import time
        >>> from torch.utils.data import TensorDataset
        >>> r = measure(TensorDataset(torch.zeros(64, 3)), 8, {}, num_workers=0,
        ...             prefetch_factor=None, pin_memory=False, deadline=time.perf_counter() + 5)
        >>> r.status, r.samples_per_s > 0, r.batch_bytes
        ('ok', True, 96)
    """
    t0 = time.perf_counter()
    spec = _Spec(
        dataset,
        batch_size,
        num_workers,
        prefetch_factor,
        pin_memory,
        deadline,
        hang_timeout_s,
        cuda_device=device if device is not None and device.type == "cuda" else None,
    )
    remaining = deadline - t0
    if remaining <= 0.05:
        return CandidateResult(
            **spec.config(),
            status="skipped",
            fault="budget",
            reason="the time budget ran out before it could start",
        )
    batches = _Batches(spec, *_loader_kwargs(loader_kwargs, spec, remaining))
    readings = _Readings(WorkerProcesses(), num_workers, on_tick, last_tick=t0)
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
        if num_workers == 0 or (isinstance(e, ValueError) and "yields no batch" in str(e)):
            raise
        fault = _worker_fault(e, spec, readings, loader_kwargs, shm_free)
        # The traceback's frames hold the iterator; clearing them lets it go now.
        traceback.clear_frames(e.__traceback__)
    finally:
        uss = _stop(batches, readings, timing, None if fault is None else fault[0])
    return _result(spec, readings, uss, timing, fault, time.perf_counter() - t0)
