"""Timed windows: how the steady state of one DataLoader configuration is timed.

Why not simply time ``N`` batches: workers start, and while the main process waits for the
first batch every worker is already producing; up to ``num_workers * prefetch_factor``
batches then arrive at once. A window that counts them reports a rate no pipeline can keep
up (on a 16-core host, 4,425 images/s for a setting whose steady state is about 2,000). So
each measurement (:func:`trainperf.loader.measure`)

1. records the start-up (``iter()`` to the first batch) on its own,
2. drops the next ``num_workers * prefetch_factor + 2`` batches (everything that could have
   been buffered during start-up),
3. times back-to-back windows of at least ``4 * num_workers * prefetch_factor`` batches and
   a quarter of a second, and repeats them until the last ones agree within 5 % (or the
   budget or a window cap is reached), reporting the median.

Steps 2 and 3 are :func:`time_windows`, sized by a :class:`WindowPolicy`; it knows nothing of
DataLoaders (it calls ``next_batch``), so its tests run on a fake clock. The policy, the
windows' figures and the "settled" rule live in :mod:`trainperf._utils.windows`, shared with
the batch-size tuner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from trainperf._utils.windows import DEFAULT_POLICY, WindowPolicy, WindowTiming, settled

__all__ = [
    "DEFAULT_POLICY",
    "Clock",
    "DeadlineReached",
    "WindowPolicy",
    "WindowTiming",
    "time_windows",
]

Clock = Callable[[], float]


class DeadlineReached(Exception):
    """A wait for a batch reached the deadline (raised by ``next_batch``)."""


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
    :class:`DeadlineReached` when the deadline passes while it waits. A window that the
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
            if settled(timing, policy) or len(rates) >= policy.max_windows:
                return timing
    except DeadlineReached:
        return WindowTiming(tuple(rates), batches, skipped, True)
