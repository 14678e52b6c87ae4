"""The adaptive loader's rules: what one epoch's figures say ``num_workers`` should become.

Pure functions of what :class:`trainperf.loader.AdaptiveDataLoader` measured over an epoch
(:class:`EpochFigures`): the time the loop waited in ``__next__``, the time between calls
(the step), the CPU the main process, its loading thread and the workers used, how busy the
usable CPUs were, and the usable CPUs now. In the order they are applied (:func:`decide`):

- ``memory``: the current count no longer fits the memory or ``/dev/shm`` → the most
  workers that do, at a shallower ``prefetch_factor`` if that keeps more of them (the fit
  is the one-off tuner's own rule, passed in as ``fits``);
- ``cpus``: the usable CPUs changed and the workers now need more cores than are left →
  the count that fits;
- ``oversubscribed``: the usable CPUs are (nearly) all busy, the step slowed down and the
  loop is not input-bound (it waits for data under ``INPUT_BOUND_SHARE`` of the time) →
  fewer workers (a loop that waits would only wait longer; and the two rules never both
  apply, so they do not undo each other check after check);
- ``input-bound``: the loop waited for data a significant share of the time and cores are
  free for what a worker costs (I/O-latency workers cost almost none) → the count that
  keeps up with the step, within those cores, ``max_workers`` and memory;
- ``prefetch``: still input-bound and the CPUs measured not full, but no worker can be
  added (cores, ``max_workers`` or memory) → ``prefetch_factor`` ``DEEP_PREFETCH``, so
  that uneven batches do not leave workers idle (the one-off tuner's refinement), tried
  once (the loader passes ``max_prefetch``); on full CPUs (or CPUs it could not read)
  more batches in flight would only hold memory.

After an ``input-bound`` or ``prefetch`` increase, :func:`increase_paid` judges the first
figures measured with the new setting against those that led to it: an increase that
neither raised the samples per second by ``MIN_GAIN`` nor lowered the wait share by
``MIN_WAIT_DROP`` did not pay (the wait left is not the workers', e.g. the main process's
own cost per batch). The loader then holds the setting, or goes back (``no-gain``) when the
previous one was as fast, and adds no workers beyond it, and no deeper prefetch, until the
usable CPUs change. A pool that is not kept between epochs starts again at every epoch, so
its start-up counts in that judgement, spread over the epoch's batches (:func:`amortized`):
a short epoch that more workers only slow down goes back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "INPUT_BOUND_SHARE",
    "Change",
    "EpochFigures",
    "Reason",
    "amortized",
    "cores_per_worker",
    "decide",
    "increase_paid",
    "increased",
    "needed_workers",
    "rates",
    "worker_cores_left",
]

Reason = Literal[
    "memory", "cpus", "oversubscribed", "input-bound", "prefetch", "no-gain", "hang", "failed"
]

INPUT_BOUND_SHARE = 0.10
"""Share of the loop's time spent waiting for data above which more workers are tried."""

BUSY_SHARE = 0.90
"""Share of the usable CPUs' time busy (all processes) at which the host is full."""

STEP_SLOWED = 1.20
"""A step this many times its fastest epoch's is slowed down."""

MIN_GAIN = 0.05
"""Rise in samples per second (share) an increase in workers must bring to pay."""

MIN_WAIT_DROP = 0.05
"""Drop in the wait share (of the loop's time) that also makes an increase pay."""

DEEP_PREFETCH = 4
"""The ``prefetch_factor`` the ``prefetch`` rule tries (DataLoader's default is 2)."""


@dataclass(frozen=True)
class EpochFigures:
    """What an adaptive loader measured over one epoch (or the part of it that ran).

    Attributes:
        num_workers: the workers the epoch ran with.
        prefetch_factor: their ``prefetch_factor`` (None without workers).
        batches: batches yielded.
        samples: samples yielded (``batches`` times ``batch_size`` when the size is known).
        wait_s: seconds the loop spent inside ``__next__``, the first batch excluded.
        step_s: seconds between a batch's return and the next ``__next__`` call.
        startup_s: seconds to the first batch (worker start-up plus one batch).
        load_cpu_s: CPU seconds of the main process (all its threads) inside ``__next__``,
            the first batch excluded (the loading itself with ``num_workers=0``).
        step_cpu_s: CPU seconds of the main process between ``__next__`` calls (the step).
        worker_cores: cores the workers used (CPU seconds over wall seconds), None without
            workers or when they could not be read.
        host_busy: share of the usable CPUs' time that was busy, every process counted
            (None when unknown).
        cpus: usable CPUs at the epoch's end.
        memory_available: bytes of memory available at the epoch's end.
    """

    num_workers: int
    prefetch_factor: int | None
    batches: int
    samples: int
    wait_s: float
    step_s: float
    startup_s: float
    load_cpu_s: float
    step_cpu_s: float
    worker_cores: float | None
    host_busy: float | None
    cpus: int
    memory_available: int

    @property
    def timed(self) -> int:
        """Batches whose wait is counted (the first is start-up)."""
        return max(1, self.batches - 1)

    @property
    def wait_share(self) -> float:
        """Share of the loop's time spent waiting for data.

        Example:
            >>> figures(wait_s=3.0, step_s=1.0).wait_share
            0.75
        """
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    @property
    def step_per_batch(self) -> float:
        """Seconds of step per batch."""
        return self.step_s / self.timed

    @property
    def samples_per_s(self) -> float:
        """Samples per second over the epoch, start-up included."""
        wall = self.wait_s + self.step_s + self.startup_s
        return self.samples / wall if wall > 0 else 0.0

    @property
    def loop_samples_per_s(self) -> float:
        """Samples per second once running: the first batch (start-up) left out, so that
        a window that started a new pool compares with one that did not.

        Example:
            >>> figures(batches=11, samples=110, wait_s=0.5, step_s=0.5).loop_samples_per_s
            100.0
        """
        wall = self.wait_s + self.step_s
        if wall <= 0 or self.batches < 2:
            return 0.0
        return self.samples * (self.batches - 1) / self.batches / wall

    @property
    def step_cores(self) -> float:
        """Cores the step used while it ran (the main process's CPU between ``__next__``
        calls), at most the usable CPUs. A step under 1 % of the loop's time is timed as
        1 % of it: over a few microseconds, any other thread's CPU would look like cores.

        Example:
            >>> figures(step_s=2.0, step_cpu_s=1.0).step_cores
            0.5
            >>> round(figures(wait_s=10.0, step_s=1e-5, step_cpu_s=1e-3).step_cores, 4)  # noise
            0.01
        """
        floor = 0.01 * (self.wait_s + self.step_s)
        if self.step_s <= 0 or floor <= 0:
            return 0.0
        return min(float(self.cpus), self.step_cpu_s / max(self.step_s, floor))

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe."""
        return dataclasses.asdict(self)


def figures(**kw: Any) -> EpochFigures:
    """:class:`EpochFigures` with defaults for the fields not given (for examples and tests):
    one worker-less epoch of 101 batches of 10 samples, 1 s waiting, 1 s of step, 4 CPUs."""
    base: dict[str, Any] = {
        "num_workers": 0,
        "prefetch_factor": None,
        "batches": 101,
        "samples": 1010,
        "wait_s": 1.0,
        "step_s": 1.0,
        "startup_s": 0.01,
        "load_cpu_s": 0.0,
        "step_cpu_s": 0.0,
        "worker_cores": None,
        "host_busy": 0.2,
        "cpus": 4,
        "memory_available": 64 << 30,
    }
    return EpochFigures(**{**base, **kw})


@dataclass(frozen=True)
class Change:
    """A new setting and why: what :func:`decide` returns."""

    num_workers: int
    prefetch_factor: int | None
    reason: Reason
    why: str


def cores_per_worker(f: EpochFigures) -> float:
    """Cores one worker uses: the workers' measured cores divided among them, or, without
    workers, the iterating thread's CPU share while it loaded (at least 0.01, at most 1).

    Example:
        >>> cores_per_worker(figures(num_workers=4, worker_cores=2.0))
        0.5
        >>> cores_per_worker(figures(wait_s=2.0, load_cpu_s=0.1))  # sleeps: I/O latency
        0.05
    """
    if f.num_workers > 0 and f.worker_cores is not None:
        share = f.worker_cores / f.num_workers
    elif f.num_workers == 0 and f.wait_s > 0:
        share = f.load_cpu_s / f.wait_s
    else:
        share = 1.0
    return min(1.0, max(0.01, share))


def worker_cores_left(f: EpochFigures) -> float:
    """Cores left for workers: the usable CPUs less the step's cores and what other
    processes on them used (the busy share beyond this loader's own use).

    Example:
        >>> # 4 CPUs, all busy; the step used 1 core, the workers 1: a hog used 2.
        >>> worker_cores_left(figures(num_workers=2, worker_cores=1.0, host_busy=1.0,
        ...                           wait_s=0.0, step_s=1.0, step_cpu_s=1.0))
        1.0
    """
    wall = max(f.wait_s + f.step_s, 1e-9)
    ours = (f.step_cpu_s + f.load_cpu_s) / wall + (f.worker_cores or 0.0)
    others = 0.0 if f.host_busy is None else max(0.0, f.host_busy * f.cpus - ours)
    return max(0.0, f.cpus - max(f.step_cores, 0.1) - others)


def needed_workers(f: EpochFigures) -> int:
    """Workers that would keep up with the step (10 % headroom): one batch's loading time
    over one step's. Loading time per batch is the wait with ``num_workers=0``, and ``n``
    times the loop's time per batch with ``n`` workers that could not keep up.

    Example:
        >>> needed_workers(figures(wait_s=4.0, step_s=1.0))  # loading takes 4x the step
        5
        >>> needed_workers(figures(num_workers=2, wait_s=1.0, step_s=1.0))
        5
    """
    step = max(f.step_per_batch, 1e-4)
    if f.num_workers == 0:
        load = f.wait_s / f.timed
    else:
        load = f.num_workers * (f.wait_s + f.step_s) / f.timed
    return max(1, math.ceil(1.1 * load / step - 1e-9))


def _cpu_cap(f: EpochFigures, max_workers: int) -> int:
    n = math.floor((worker_cores_left(f) + 0.5) / cores_per_worker(f))
    return max(0, min(max_workers, n))


def _largest_fitting(n: int, pf: int | None, fits: Callable[[int, int | None], bool]) -> int:
    while n > 0 and not fits(n, pf or 2):
        n -= 1
    return n


def _most_fitting(
    n: int, pf: int | None, fits: Callable[[int, int | None], bool]
) -> tuple[int, int | None]:
    """The most workers, at most ``n``, that fit at ``pf`` or a shallower prefetch (the
    deepest that keeps that many). Fewer batches in flight may keep every worker.

    Example:
        >>> fits = lambda n, pf: n * (pf + 1) <= 12  # 12 batches fit
        >>> _most_fitting(4, 4, fits)  # 4 x 5 do not; 4 x 3 do, at prefetch 2
        (4, 2)
        >>> _most_fitting(8, 2, fits)  # 4 workers fit at prefetch 2, 6 at prefetch 1
        (6, 1)
    """
    best: tuple[int, int | None] = (0, None)
    for depth in range(pf or 2, 0, -1):
        m = _largest_fitting(n, depth, fits)
        if m > best[0]:
            best = (m, depth)
        if m == n:
            break
    return best


def _setting(n: int, pf: int | None) -> str:
    return f"{n} workers" + (f" at prefetch {pf}" if n and pf is not None and pf != 2 else "")


def increased(before: EpochFigures, f: EpochFigures) -> bool:
    """Whether ``f`` runs with more workers than ``before``, or as many with deeper prefetch."""
    if f.num_workers != before.num_workers:
        return f.num_workers > before.num_workers
    return (f.prefetch_factor or 0) > (before.prefetch_factor or 0)


def increase_paid(before: EpochFigures, after: EpochFigures) -> Literal["paid", "hold", "back"]:
    """What an increase (workers or prefetch) did: ``before`` led to it, ``after`` ran with it.

    ``"paid"``: samples per second rose by ``MIN_GAIN`` or the wait share fell by
    ``MIN_WAIT_DROP``; otherwise ``"back"`` when the previous count was as fast (fewer
    workers for the same rate), else ``"hold"``.

    Example:
        >>> before = figures(wait_s=1.0, step_s=1.0)  # 500 samples/s, waiting half the time
        >>> increase_paid(before, figures(num_workers=2, wait_s=0.1, step_s=1.0))
        'paid'
        >>> increase_paid(before, figures(num_workers=3, wait_s=0.98, step_s=1.0))
        'hold'
        >>> increase_paid(before, figures(num_workers=3, wait_s=1.2, step_s=1.0))
        'back'
    """
    rate, was = after.loop_samples_per_s, before.loop_samples_per_s
    if rate >= (1 + MIN_GAIN) * was or after.wait_share <= before.wait_share - MIN_WAIT_DROP:
        return "paid"
    return "back" if was >= rate else "hold"


def amortized(f: EpochFigures, epoch_batches: int | None) -> EpochFigures:
    """``f`` with its pool's start-up counted as waiting for data, spread over an epoch of
    ``epoch_batches`` batches: what a pool that is not kept between epochs (it starts again
    at every epoch) costs the loop. ``epoch_batches`` None (the pool is kept), no workers, or
    a start-up no longer than a batch: ``f`` as it is.

    Example:
        >>> # 8 workers, restarted for each epoch of 2 batches, take 0.25 s to start up:
        >>> f = figures(num_workers=8, batches=2, samples=16, wait_s=0.001, step_s=0.001,
        ...             startup_s=0.25)
        >>> round(f.loop_samples_per_s), round(amortized(f, 2).loop_samples_per_s)
        (4000, 63)
        >>> amortized(f, None) is f
        True
    """
    if not epoch_batches or f.num_workers == 0 or f.batches < 2:
        return f
    per_batch = (f.wait_s + f.step_s) / f.timed
    extra = (f.startup_s - per_batch) * f.timed / epoch_batches
    return f if extra <= 0 else dataclasses.replace(f, wait_s=f.wait_s + extra)


def rates(f: EpochFigures) -> str:
    """The measured rates in one phrase, for the change log.

    Example:
        >>> rates(figures(wait_s=3.0, step_s=1.0, samples=400, startup_s=0.0))
        '100 samples/s, waited for data 75 % of the time, 4 usable CPUs 20 % busy'
    """
    return (
        f"{f.samples_per_s:,.0f} samples/s, waited for data {100 * f.wait_share:.0f} % of the "
        f"time, {f.cpus} usable CPUs"
        + ("" if f.host_busy is None else f" {100 * f.host_busy:.0f} % busy")
    )


def decide(
    f: EpochFigures,
    *,
    previous_cpus: int,
    fastest_step_per_batch: float,
    max_workers: int,
    fits: Callable[[int, int | None], bool],
    before: EpochFigures | None = None,
    max_prefetch: int = DEEP_PREFETCH,
    epoch_batches: int | None = None,
) -> Change | None:
    """The setting the next epoch should run with, or None to keep this one.

    Args:
        f: the epoch's figures.
        previous_cpus: usable CPUs when the current setting was chosen.
        fastest_step_per_batch: the fastest step per batch of any epoch so far.
        max_workers: the most workers ever used.
        fits: whether ``(num_workers, prefetch_factor)`` fits memory and ``/dev/shm``.
        before: the figures that led to the ``input-bound`` or ``prefetch`` increase ``f``
            is the first measure of (None: ``f`` follows no increase); one that did not pay
            (:func:`increase_paid`) goes back (``no-gain``) or is held.
        max_prefetch: the deepest ``prefetch_factor`` the ``prefetch`` rule may set
            (the current one or less: it adds none).
        epoch_batches: the batches of an epoch when the pool starts again at every epoch
            (not kept between epochs): the increase is judged with its start-up spread
            over them (:func:`amortized`); None: the pool is kept.

    Example:
        >>> fits = lambda n, pf: True
        >>> c = decide(figures(wait_s=4.0, step_s=1.0), previous_cpus=4,
        ...            fastest_step_per_batch=0.01, max_workers=8, fits=fits)
        >>> c.num_workers, c.reason
        (5, 'input-bound')
        >>> decide(figures(wait_s=0.01, step_s=1.0), previous_cpus=4,
        ...        fastest_step_per_batch=0.01, max_workers=8, fits=fits) is None
        True
    """
    n, pf = f.num_workers, f.prefetch_factor
    pf_next = pf if n > 0 else 2
    if n > 0 and not fits(n, pf):
        new, depth = _most_fitting(n, pf, fits)
        return Change(new, depth, "memory", f"{_setting(n, pf)} no longer fit memory")
    cap = _cpu_cap(f, max_workers)
    cores = cores_per_worker(f) * n
    if n > 0 and f.cpus < previous_cpus and cap < n:
        new = max(1 if f.cpus > 1 else 0, cap)
        if new < n:
            return Change(
                new, pf if new else None, "cpus",
                f"usable CPUs {previous_cpus} → {f.cpus}; {n} workers used {cores:.1f} cores",
            )  # fmt: skip
    busy = f.host_busy is not None and f.host_busy >= BUSY_SHARE
    slowed = f.step_per_batch > STEP_SLOWED * fastest_step_per_batch
    if n > 0 and busy and slowed and f.wait_share < INPUT_BOUND_SHARE:
        new = max(1, min(n - 1, cap, needed_workers(f)))
        if new < n:
            times = f.step_per_batch / fastest_step_per_batch
            return Change(
                new, pf, "oversubscribed",
                f"the CPUs are full and the step is {times:.2f}x its fastest; {n} workers "
                f"used {cores:.1f} cores",
            )  # fmt: skip
    verdict: str = "paid"
    if before is not None and increased(before, f):
        was_f, now_f = amortized(before, epoch_batches), amortized(f, epoch_batches)
        verdict = increase_paid(was_f, now_f)
    if verdict == "back" and before is not None:
        was = _setting(before.num_workers, before.prefetch_factor)
        return Change(
            before.num_workers, before.prefetch_factor, "no-gain",
            f"{_setting(n, pf)} gave {now_f.loop_samples_per_s:,.0f} samples/s, {was} "
            f"gave {was_f.loop_samples_per_s:,.0f}" + _restarts(now_f, f),
        )  # fmt: skip
    # A full host still takes workers that mostly wait: the cap counts what they cost.
    if verdict == "paid" and f.wait_share >= INPUT_BOUND_SHARE and cap > n:
        new = _largest_fitting(min(cap, max(n + 1, needed_workers(f))), pf_next, fits)
        if new > n:
            return Change(
                new, pf_next, "input-bound",
                f"{needed_workers(f)} workers would keep up with the step; one uses "
                f"{cores_per_worker(f):.2f} cores, {worker_cores_left(f):.1f} are free for "
                f"workers",
            )  # fmt: skip
    return _deeper(f, verdict, max_prefetch, fits)


def _restarts(now: EpochFigures, f: EpochFigures) -> str:
    """What the no-gain message adds when the pool's start-up at each epoch was counted."""
    return "" if now is f else " (start-up included: the pool starts again every epoch)"


def _deeper(
    f: EpochFigures, verdict: str, max_prefetch: int, fits: Callable[[int, int | None], bool]
) -> Change | None:
    """The ``prefetch`` rule: an input-bound loop that gets no more workers, on CPUs that
    are not full, tries a deeper prefetch once.

    Example:
        >>> c = _deeper(figures(num_workers=8, prefetch_factor=2), "paid", 4, lambda n, pf: True)
        >>> c.num_workers, c.prefetch_factor, c.reason
        (8, 4, 'prefetch')
        >>> _deeper(figures(num_workers=8, prefetch_factor=2), "paid", 2, lambda n, pf: True)
    """
    n, pf = f.num_workers, f.prefetch_factor or 2
    depth = min(max_prefetch, DEEP_PREFETCH)
    if n == 0 or verdict != "paid" or f.wait_share < INPUT_BOUND_SHARE or depth <= pf:
        return None
    full = f.host_busy is None or f.host_busy >= BUSY_SHARE  # unknown: no trial
    if full or not fits(n, depth):
        return None
    return Change(
        n, depth, "prefetch",
        f"no more workers to add at {n}; {depth} batches a worker in flight (was {pf}) "
        "keep them busy through uneven batches",
    )  # fmt: skip
