"""A lasting change in step time (``monitor/_shift.py``): found where it is, and only there."""

from __future__ import annotations

import random

import pytest

from trainperf.monitor._shift import MAX_BINS, Shift, find_shift


def noisy(n: int, level: float, seed: int, spread: float = 0.1) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_a_doubling_halfway_is_found_at_its_step() -> None:
    shift = find_shift(noisy(50, 0.010, 1) + noisy(50, 0.020, 2), first=2)
    assert shift is not None and shift.step == 52
    assert shift.before_s == pytest.approx(0.010, rel=0.1)
    assert shift.after_s == pytest.approx(0.020, rel=0.1)
    assert shift.ratio == pytest.approx(2.0, rel=0.2)


def test_a_loop_that_gets_faster_is_a_change_too() -> None:
    shift = find_shift(noisy(40, 0.030, 3) + noisy(60, 0.010, 4))
    assert shift is not None and shift.step == 40 and shift.ratio < 1


def test_no_change_in_a_steady_noisy_or_stalling_loop() -> None:
    assert find_shift(noisy(100, 0.010, 5, spread=0.4)) is None
    stalls = [0.2 if i % 10 == 9 else 0.01 for i in range(100)]  # a checkpoint every 10 steps
    assert find_shift(stalls) is None
    assert find_shift([0.01, 0.05] * 50) is None  # alternating: no lasting change


def test_a_change_smaller_than_half_again_is_not_one() -> None:
    assert find_shift([0.010] * 50 + [0.0149] * 50) is None
    assert find_shift([0.010] * 50 + [0.0151] * 50) is not None


def test_each_side_needs_a_fifth_of_the_steps_and_ten_steps() -> None:
    assert find_shift([0.01] * 85 + [0.02] * 15) is None  # 15 %: a tail, not a regime
    found = find_shift([0.01] * 80 + [0.02] * 20)
    assert found is not None and found.step == 80
    assert find_shift([0.01] * 10 + [0.02] * 9) is None  # under 20 steps: too few
    assert find_shift([0.01] * 10 + [0.02] * 10) == Shift(10, 0.01, 0.02)


def test_a_long_run_is_judged_on_binned_medians() -> None:
    n = MAX_BINS * 50  # 50 steps a bin
    shift = find_shift([0.01] * (n // 2) + [0.03] * (n // 2), first=7)
    assert shift is not None and shift.step == 7 + n // 2


def test_a_change_that_does_not_last_is_not_a_regime() -> None:
    # Slow for the middle third only: neither side of any cut is mostly one level.
    assert find_shift([0.01] * 40 + [0.03] * 40 + [0.01] * 40) is None


def test_the_bursts_of_two_workers_are_judged_on_runs_of_steps() -> None:
    # Two workers keep up, then the doubled cost makes them deliver a batch every two steps:
    # one step takes it at once, the next waits. Step by step, half the steps after the
    # change look like the ones before it; runs of four steps do not.
    before = [0.010, 0.012] * 20
    after = [0.008, 0.025] * 20
    shift = find_shift(before + after)
    assert shift is not None and abs(shift.step - 40) <= 2
    assert shift.ratio == pytest.approx(0.0165 / 0.011, rel=0.05)


def test_a_side_that_drifts_is_not_a_level() -> None:
    # Flat, then a steady climb from 1.5x to 3x: the medians differ 2x and every run after
    # the cut is above the middle, but the second side's halves differ 1.4x: a trend (or
    # contention wandering), not a second level.
    ramp = [0.015 * 2 ** (i / 39) for i in range(40)]
    assert find_shift([0.01] * 40 + ramp) is None
    # The same jump to a level that holds is a change.
    assert find_shift([0.01] * 40 + [0.021] * 40) is not None
