"""trainperf.loader._windows: steady-state windows (warm-up and prefetch burst excluded)."""

from __future__ import annotations

from typing import Any

import pytest

from trainperf.loader import WindowPolicy
from trainperf.loader._windows import DeadlineReached, time_windows

BS = 8


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduled_batches(clock: FakeClock, arrivals: list[float]) -> Any:
    """next_batch() that advances the fake clock to each batch's arrival time."""
    it = iter(arrivals)

    def next_batch() -> int:
        clock.t = max(clock.t, next(it))
        return BS

    return next_batch


def test_warm_up_batches_are_excluded_from_the_rate() -> None:
    clock = FakeClock()
    # Two slow first batches (1 s each), then 0.01 s per batch: steady state is 800/s.
    arrivals = [1.0, 2.0] + [2.0 + 0.01 * i for i in range(1, 500)]
    timing = time_windows(scheduled_batches(clock, arrivals), skip=2, window_batches=4, clock=clock)
    assert timing.skipped == 2
    assert timing.samples_per_s == pytest.approx(800, rel=1e-6)
    assert timing.spread == pytest.approx(0, abs=1e-9)


def test_prefetch_burst_after_start_up_is_skipped_and_a_naive_window_overstates() -> None:
    workers, prefetch = 4, 2
    policy = WindowPolicy()
    # Start-up 1 s; meanwhile the pool filled its buffer, delivered at once; then the
    # steady state is one batch per 0.025 s (40 batches/s = 320 samples/s).
    buffered = workers * prefetch
    arrivals = [1.0] * (1 + buffered) + [1.0 + 0.025 * i for i in range(1, 2000)]
    skip = policy.skip_batches(workers, prefetch)
    window = policy.window_batches(workers, prefetch)
    assert skip == buffered + policy.extra_skip
    assert window == policy.buffer_multiple * buffered

    clock = FakeClock()
    next_batch = scheduled_batches(clock, arrivals)
    next_batch()  # the first batch, as measure() takes it for start-up
    timing = time_windows(next_batch, skip=skip, window_batches=window, clock=clock)
    assert timing.samples_per_s == pytest.approx(320, rel=0.01)
    assert timing.batches >= window * 2

    # The same data timed naively: two buffers' worth of batches from the first one.
    naive_rate = BS * 2 * buffered / (arrivals[2 * buffered] - arrivals[0])
    assert naive_rate > 1.5 * 320


def test_windows_repeat_until_they_agree_or_the_cap() -> None:
    clock = FakeClock()
    # Alternating fast and slow windows never agree within 5 %.
    t, arrivals = 0.0, []
    for i in range(2000):
        t += 0.01 if (i // 30) % 2 == 0 else 0.03
        arrivals.append(t)
    policy = WindowPolicy(min_window_s=0.0, max_windows=4)
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=0, window_batches=30, policy=policy, clock=clock
    )
    assert len(timing.rates) == 4
    assert timing.spread is not None and timing.spread > 0.5


def test_a_window_lasts_at_least_min_window_s() -> None:
    clock = FakeClock()
    arrivals = [0.001 * i for i in range(1, 5000)]
    policy = WindowPolicy(min_window_s=0.5, min_windows=2)
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=0, window_batches=4, policy=policy, clock=clock
    )
    assert timing.batches >= 2 * 499  # two windows of >= 0.5 s at 1 ms per batch


def test_deadline_discards_a_partial_window() -> None:
    clock = FakeClock()
    arrivals = [0.1 * i for i in range(1, 100)]
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=2, window_batches=50, clock=clock, deadline=1.0
    )
    assert timing.budget_hit
    assert timing.rates == ()
    assert timing.samples_per_s is None


def test_a_wait_cut_by_the_deadline_ends_the_timing_with_the_windows_so_far() -> None:
    clock = FakeClock()
    arrivals = iter([0.01 * i for i in range(1, 60)])

    def next_batch() -> int:
        t = next(arrivals, None)
        if t is None:  # the workers stall; the wait for the next batch reaches the deadline
            clock.t = 5.0
            raise DeadlineReached
        clock.t = t
        return BS

    policy = WindowPolicy(min_window_s=0.0, min_windows=10, max_windows=10)
    timing = time_windows(
        next_batch, skip=2, window_batches=10, policy=policy, clock=clock, deadline=5.0
    )
    assert timing.budget_hit
    assert len(timing.rates) == 5
    assert timing.samples_per_s == pytest.approx(800)
