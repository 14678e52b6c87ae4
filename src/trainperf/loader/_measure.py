"""Steady-state throughput of one DataLoader configuration, surviving broken workers.

Why not simply time ``N`` batches: workers start, and while the main process waits for the
first batch every worker is already producing; up to ``num_workers * prefetch_factor``
batches then arrive at once. A window that counts them reports a rate no pipeline can keep
up (on a 16-core host, 4,425 images/s for a setting whose steady state is about 2,000). So
each measurement

1. records the start-up (``iter()`` to the first batch) on its own,
2. drops the next ``num_workers * prefetch_factor + 2`` batches (everything that could have
   been buffered during start-up),
3. times back-to-back windows of at least ``4 * num_workers * prefetch_factor`` batches and
   a quarter of a second, and repeats them until the last ones agree within 5 % (or the
   budget or a window cap is reached), reporting the median.

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

Worker memory grows after the measurement: a forked worker shares its parent's pages until
it writes to them, and merely reading a Python object writes to it (its reference count),
so a dataset of many Python objects is copied page by page into every worker over an epoch
(a list of objects measured 18 MiB per worker after a few seconds, 97 MiB after an epoch);
tensor and array buffers are never written and stay shared. The private memory of the
workers is therefore read twice, after the first batch and at the end, and the growth per
sample in between is projected over the dataset (:func:`project_worker_uss`). A full
garbage collection also writes to every Python container object, copying their pages at
once; it would come at a random moment in a worker's life, so each worker runs one as it
starts (before the caller's ``worker_init_fn``) and the first reading already includes it.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainperf.loader._cache import length
from trainperf.loader._faults import (
    WorkerProcesses,
    budget_cut_reason,
    classify_fault,
    close_iterator,
    main_private_bytes,
    start_method,
    thread_busy_seconds,
)
from trainperf.loader._report import CandidateResult, FaultKind

__all__ = [
    "DEFAULT_POLICY",
    "WindowPolicy",
    "WindowTiming",
    "batch_bytes",
    "measure",
    "project_worker_uss",
    "time_windows",
]

Clock = Callable[[], float]
MiB = 1 << 20


class _DeadlineReached(Exception):
    """A wait for a batch reached the deadline (raised by ``next_batch``)."""


class _CollectFirst:
    """``worker_init_fn`` that runs a full garbage collection, then the caller's own."""

    def __init__(self, init: Callable[[int], object] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        gc.collect()
        if self.init is not None:
            self.init(worker_id)


@dataclass(frozen=True)
class WindowPolicy:
    """How one configuration is timed (see the module docstring for why).

    Attributes:
        extra_skip: batches dropped after the buffer, on top of ``workers * prefetch``.
        buffer_multiple: a window is at least this many times the prefetch buffer.
        min_window_batches: and at least this many batches.
        min_window_s: and at least this long.
        min_windows: windows to time before the spread may stop the measurement.
        max_windows: windows after which it stops regardless.
        target_spread: stop once (max - min) / median of the last 3 windows is below this.
    """

    extra_skip: int = 2
    buffer_multiple: int = 4
    min_window_batches: int = 4
    min_window_s: float = 0.25
    min_windows: int = 2
    max_windows: int = 5
    target_spread: float = 0.05

    def skip_batches(self, num_workers: int, prefetch_factor: int | None) -> int:
        """Batches dropped after the first one: the prefetch buffer plus ``extra_skip``."""
        return num_workers * (prefetch_factor or 0) + self.extra_skip

    def window_batches(self, num_workers: int, prefetch_factor: int | None) -> int:
        """Minimum batches in one timed window."""
        buffer = num_workers * (prefetch_factor or 0)
        return max(self.min_window_batches, self.buffer_multiple * buffer)


DEFAULT_POLICY = WindowPolicy()


@dataclass(frozen=True)
class WindowTiming:
    """Raw result of :func:`time_windows`.

    Attributes:
        rates: samples per second of each completed window, in order.
        batches: batches inside completed windows.
        skipped: batches dropped before the first window.
        budget_hit: the deadline stopped the timing.
    """

    rates: tuple[float, ...]
    batches: int
    skipped: int
    budget_hit: bool

    @property
    def samples_per_s(self) -> float | None:
        """Median of the last (up to) three windows: the settled ones."""
        return statistics.median(self.rates[-3:]) if self.rates else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median over the last (up to) three windows."""
        last = self.rates[-3:]
        if not last:
            return None
        med = statistics.median(last)
        return (max(last) - min(last)) / med if med > 0 else math.inf


def time_windows(
    next_batch: Callable[[], int],
    *,
    skip: int,
    window_batches: int,
    policy: WindowPolicy = DEFAULT_POLICY,
    clock: Clock = time.perf_counter,
    deadline: float = math.inf,
    on_batch: Callable[[float], None] | None = None,
    on_first_window: Callable[[], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> WindowTiming:
    """Drop ``skip`` batches, then time windows until they agree or the deadline passes.

    ``next_batch`` fetches one batch and returns how many samples it held; it may raise
    ``_DeadlineReached`` when the deadline passes while it waits. A window that the
    deadline cuts short is discarded.

    Example:
        >>> t = [0.0]
        >>> def clock(): return t[0]
        >>> def next_batch():   # every batch of 8 samples takes 0.1 s
        ...     t[0] += 0.1
        ...     return 8
        >>> timing = time_windows(next_batch, skip=2, window_batches=4, clock=clock)
        >>> round(timing.samples_per_s), timing.skipped, len(timing.rates)
        (80, 2, 2)
    """
    skipped = 0
    rates: list[float] = []
    batches = 0
    try:
        while skipped < skip:
            if clock() >= deadline:
                return WindowTiming((), 0, skipped, True)
            next_batch()
            skipped += 1
        if on_first_window is not None:
            on_first_window()
        start = clock()
        while True:
            count = samples = 0
            now = start
            while count < window_batches or now - start < policy.min_window_s:
                if now >= deadline:
                    return WindowTiming(tuple(rates), batches, skipped, True)
                samples += next_batch()
                count += 1
                now = clock()
                if on_batch is not None:
                    on_batch(now)
            if sync is not None:
                sync()
                now = clock()
            rates.append(samples / max(now - start, 1e-9))
            batches += count
            start = now
            timing = WindowTiming(tuple(rates), batches, skipped, False)
            spread = timing.spread
            if (
                len(rates) >= policy.min_windows
                and spread is not None
                and spread <= policy.target_spread
            ):
                return timing
            if len(rates) >= policy.max_windows:
                return timing
    except _DeadlineReached:
        return WindowTiming(tuple(rates), batches, skipped, True)


def _leaves(obj: Any, depth: int = 0) -> list[Any]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if depth > 8 or isinstance(obj, (str, bytes)):
        return []
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _leaves(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v, depth + 1)]
    return []


def batch_bytes(batch: Any) -> int:
    """Bytes of tensor and array data in a (nested) batch.

    Example:
        >>> batch_bytes({"x": torch.zeros(4, 3), "y": [torch.zeros(4, dtype=torch.int64), "id"]})
        80
    """
    total = 0
    for leaf in _leaves(batch):
        total += leaf.nbytes if isinstance(leaf, np.ndarray) else leaf.element_size() * leaf.numel()
    return total


def _samples_in(batch: Any, batch_size: int) -> int:
    """Samples in a batch: the first tensor's leading size when it is plausible."""
    for leaf in _leaves(batch):
        if leaf.ndim >= 1:
            n = int(leaf.shape[0])
            return n if 1 <= n <= batch_size else batch_size
        break
    return batch_size


def project_worker_uss(
    late: int,
    growth: int,
    samples_between: float,
    samples_per_worker: int | None,
    parent_private: int,
    noise: int = MiB,
) -> int:
    """Private memory one worker is expected to reach over a run, from two readings.

    The growth between the readings beyond ``noise`` (allocator churn, batches in flight)
    is taken as pages copied from the parent, at a rate per sample that is kept for every
    sample the worker will load. The rate only falls as the copied pages accumulate, so
    this overestimates; and it is capped at the parent's private memory, since a worker
    cannot copy more than there is. Tensor-backed datasets grow by less than ``noise``
    and keep their measured size.

    Args:
        late: the worker's private memory at the second reading, in bytes.
        growth: how much it grew since the first reading, in bytes.
        samples_between: samples the worker loaded between the two readings.
        samples_per_worker: samples one worker loads over the run; None when unknown (the
            growth is then bounded only by ``parent_private``).
        parent_private: the main process's private anonymous memory, in bytes.
        noise: growth up to this much is not copying.

    Returns:
        The projected private memory, in bytes (at least ``late``).

    Example:
        >>> MiB = 2**20
        >>> # 41 MiB grown over 10,000 samples: 4 KiB copied per sample beyond 1 MiB of
        >>> # noise; over 50,000 samples that is 200 MiB more.
        >>> project_worker_uss(50 * MiB, 41 * MiB, 10_000, 50_000, 2048 * MiB) // MiB
        250
        >>> # Never more than the parent holds.
        >>> project_worker_uss(50 * MiB, 41 * MiB, 10_000, 10**7, 300 * MiB) // MiB
        350
        >>> # A tensor-backed dataset: half a MiB of churn is not growth.
        >>> project_worker_uss(12 * MiB, MiB // 2, 10_000, 10**7, 2048 * MiB) // MiB
        12
    """
    copied = max(0, growth - noise)
    if copied == 0 or samples_between <= 0:
        return late
    if samples_per_worker is None:
        return late + parent_private
    return late + int(min(copied / samples_between * samples_per_worker, parent_private))


def _projected_uss(
    first: tuple[int, dict[int, int]] | None,
    last: tuple[int, dict[int, int]],
    *,
    num_workers: int,
    batch_bytes: int,
    samples_per_worker: int | None,
) -> int | None:
    """:func:`project_worker_uss` from two readings ``(samples received, {pid: uss})``.

    The growth is the smallest among the workers read twice (a worker that was still
    starting at the first reading grew for another reason); the level is the largest.
    """
    samples, uss = last
    if not uss:
        return None
    late = max(uss.values())
    if first is None:
        return late
    samples0, uss0 = first
    grown = [uss[pid] - uss0[pid] for pid in uss if pid in uss0]
    if not grown:
        return late
    return project_worker_uss(
        late,
        min(grown),
        (samples - samples0) / num_workers,
        samples_per_worker,
        main_private_bytes(),
        # A batch or two held in a worker's shared memory count as its own until sent.
        noise=MiB + 2 * batch_bytes,
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
        one worker is projected to reach over the run (see :func:`project_worker_uss`).

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
    cfg: dict[str, Any] = {
        "num_workers": num_workers,
        "prefetch_factor": prefetch_factor,
        "pin_memory": pin_memory,
    }
    remaining = deadline - t0
    if remaining <= 0.05:
        return CandidateResult(
            **cfg,
            status="skipped",
            fault="budget",
            reason="the time budget ran out before it could start",
        )
    kwargs = dict(loader_kwargs)
    kwargs.pop("timeout", None)
    kwargs.pop("persistent_workers", None)
    timeout_s = 0.0
    if num_workers > 0:
        # DataLoader needs a timeout to start with; fetch() sets each wait's own.
        timeout_s = min(hang_timeout_s, remaining)
        kwargs.update(prefetch_factor=prefetch_factor, persistent_workers=True, timeout=timeout_s)
        kwargs["worker_init_fn"] = _CollectFirst(kwargs.get("worker_init_fn"))
    else:
        kwargs.pop("multiprocessing_context", None)
    cuda = device is not None and device.type == "cuda"
    workers = WorkerProcesses()
    state: dict[str, Any] = {
        "bytes": None,
        "startup": None,
        "last": t0,
        "cpu0": None,
        "samples": 0,
        "uss0": None,
    }
    it: Any = None
    loader: Any = None
    timing: WindowTiming | None = None
    fault: FaultKind | None = None
    reason: str | None = None
    worker_cpu = main_cpu = None
    uss: int | None = None
    try:
        with warnings.catch_warnings():
            # torch repeats its generic advice (pickling, worker counts) for every
            # configuration; the report states the actual fault instead.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.utils\.data")
            loader = DataLoader(
                dataset,
                batch_size=batch_size,
                num_workers=num_workers,
                pin_memory=pin_memory,
                **kwargs,
            )
            it = iter(loader)

            def next_of(iterator: Any) -> Any:
                if num_workers == 0:
                    return next(iterator)
                wait = min(hang_timeout_s, deadline - time.perf_counter())
                if wait <= 0.001:
                    raise _DeadlineReached
                # The budget is a hard limit, so no wait may outlast it: the iterator reads
                # its timeout before each wait (a private attribute; without it the wait is
                # the one DataLoader started with).
                settable = hasattr(iterator, "_timeout")
                if settable:
                    iterator._timeout = wait
                try:
                    return next(iterator)
                except RuntimeError as e:
                    cut = (wait if settable else timeout_s) < hang_timeout_s
                    if cut and "timed out after" in str(e).lower():
                        raise _DeadlineReached from e
                    raise

            def fetch() -> Any:
                nonlocal it
                try:
                    return next_of(it)
                except StopIteration:
                    it = iter(loader)  # persistent workers: same processes, next epoch
                    try:
                        return next_of(it)
                    except StopIteration:
                        raise ValueError(
                            f"the DataLoader yields no batch (batch_size={batch_size}, "
                            f"drop_last={kwargs.get('drop_last', False)!r}, "
                            f"dataset of {len(dataset) if hasattr(dataset, '__len__') else '?'}"
                            f" samples)"
                        ) from None

            def next_batch() -> int:
                batch = fetch()
                if cuda:
                    from trainperf.device import to_device

                    to_device(batch, device, non_blocking=pin_memory)  # type: ignore[arg-type]
                n = _samples_in(batch, batch_size)
                state["samples"] += n
                return n

            first = fetch()
            state["startup"] = time.perf_counter() - t0
            state["bytes"] = batch_bytes(first)
            state["samples"] = _samples_in(first, batch_size)
            del first
            if num_workers > 0:
                workers.scan()
                workers.sample_rss()
                # Before the skipped batches, which absorb the pause this reading causes.
                state["uss0"] = (state["samples"], workers.uss_by_pid())

            def on_first_window() -> None:
                state["cpu0"] = (time.perf_counter(), workers.busy_seconds(), thread_busy_seconds())

            def on_batch(now: float) -> None:
                if now - state["last"] >= 0.2:
                    state["last"] = now
                    if num_workers > 0:
                        workers.sample_rss()
                    if on_tick is not None:
                        on_tick()

            def sync() -> None:
                torch.cuda.synchronize(device)

            timing = time_windows(
                next_batch,
                skip=policy.skip_batches(num_workers, prefetch_factor),
                window_batches=policy.window_batches(num_workers, prefetch_factor),
                policy=policy,
                deadline=deadline,
                on_batch=on_batch,
                on_first_window=on_first_window,
                sync=sync if cuda else None,
            )
            if state["cpu0"] is not None:
                wall0, wcpu0, mcpu0 = state["cpu0"]
                wall = max(time.perf_counter() - wall0, 1e-9)
                main_cpu = (thread_busy_seconds() - mcpu0) / wall
                if num_workers > 0:
                    worker_cpu = (workers.busy_seconds() - wcpu0) / wall
    except _DeadlineReached as e:
        # Only the first batch gets here (time_windows stops quietly on later ones): the
        # pool delivered nothing in the time the budget left it.
        fault, reason = "hang", budget_cut_reason(remaining)
        traceback.clear_frames(e.__traceback__)
    except Exception as e:
        if num_workers == 0 or (isinstance(e, ValueError) and "yields no batch" in str(e)):
            raise
        inflight = (
            None
            if state["bytes"] is None
            else state["bytes"] * num_workers * (prefetch_factor or 0)
        )
        fault, reason = classify_fault(
            e,
            start_method=start_method(loader_kwargs),
            timeout_s=hang_timeout_s,
            inflight_bytes=inflight,
            shm_free=shm_free,
        )
        # The traceback's frames hold the iterator; clearing them lets it go now.
        traceback.clear_frames(e.__traceback__)
    finally:
        if num_workers > 0 and fault is None:
            uss = _projected_uss(
                state["uss0"],
                (state["samples"], workers.uss_by_pid()),
                num_workers=num_workers,
                batch_bytes=state["bytes"] or 0,
                # The whole dataset: a worker kept across shuffled epochs meets every
                # sample, and even one epoch's share of random samples touches most pages
                # (each holds many objects).
                samples_per_worker=length(dataset),
            )
        if num_workers > 0:
            workers.scan()
            # After any fault, killing first is what keeps a hung worker from costing a
            # 5-second join; healthy workers lose nothing. A graceful stop waits for each
            # worker to finish the batch in hand, so it is only tried when that ends
            # before the deadline.
            rate = timing.samples_per_s if timing is not None else None
            batch_s = num_workers * batch_size / rate if rate else math.inf
            kill_first = fault is not None or time.perf_counter() + batch_s >= deadline
            close_iterator(it, workers, kill_first=kill_first)
        it = loader = None
    elapsed = time.perf_counter() - t0
    common: dict[str, Any] = {
        **cfg,
        "startup_s": state["startup"],
        "worker_peak_rss": (workers.peak_rss or None) if num_workers > 0 else None,
        "worker_uss": uss,
        "batch_bytes": state["bytes"],
        "elapsed_s": elapsed,
    }
    if fault is not None:
        return CandidateResult(**common, status="failed", fault=fault, reason=reason)
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
        worker_cpu=worker_cpu,
        main_cpu=main_cpu,
    )
