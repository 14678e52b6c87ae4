"""trainperf._utils.windows: the windows' figures and when they have settled."""

from __future__ import annotations

import math

import pytest

from trainperf._utils.windows import WindowPolicy, WindowTiming, settled


def timing(*rates: float) -> WindowTiming:
    return WindowTiming(rates, len(rates), 0, False)


def test_the_figures_are_the_median_and_spread_of_the_last_three_windows() -> None:
    t = timing(10.0, 200.0, 100.0, 96.0, 104.0)
    assert t.samples_per_s == 100.0
    assert t.spread == pytest.approx(0.08)
    assert timing().samples_per_s is None and timing().spread is None
    assert timing(0.0, 0.0).spread == math.inf


def test_settled_needs_enough_windows_within_the_target() -> None:
    p = WindowPolicy(min_windows=3, target_spread=0.05)
    assert not settled(timing(100.0, 101.0), p)  # too few windows
    assert settled(timing(100.0, 101.0, 102.0), p)
    assert not settled(timing(100.0, 101.0, 110.0), p)  # 10 % apart
    assert settled(timing(50.0, 100.0, 101.0, 102.0), p)  # only the last three count


def test_the_policy_sizes_a_dataloaders_windows() -> None:
    p = WindowPolicy()
    assert p.skip_batches(4, 2) == 10 and p.skip_batches(0, None) == 2
    assert p.window_batches(4, 2) == 32 and p.window_batches(0, None) == 4
