"""Timed windows: how a steady-state rate is read from repeated measurements.

A rate measured once is at the mercy of whatever else the host did during it, so both
tuners time several back-to-back windows, stop once the last ones agree
(:func:`settled`: within ``target_spread`` of their median, after at least
``min_windows``), and report the median of the last three (:class:`WindowTiming`). How many
batches and seconds a window holds is a :class:`WindowPolicy`.

Used by the ``loader`` tuner (:mod:`trainperf.loader._windows`, which times a DataLoader's
batches; ``extra_skip`` and ``buffer_multiple`` are its own) and the ``batchsize`` tuner
(:mod:`trainperf.batchsize._probe`, which times training steps).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["DEFAULT_POLICY", "WindowPolicy", "WindowTiming", "settled"]


@dataclass(frozen=True)
class WindowPolicy:
    """How one configuration is timed (see :mod:`trainperf.loader._windows` for why).

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
    """The windows of one measurement.

    Attributes:
        rates: samples per second of each completed window, in order.
        batches: batches inside completed windows.
        skipped: batches dropped before the first window.
        budget_hit: the deadline stopped the timing.

    Example:
        >>> t = WindowTiming((90.0, 100.0, 104.0, 98.0), 8, 0, False)
        >>> t.samples_per_s, round(t.spread, 3)
        (100.0, 0.06)
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


def settled(timing: WindowTiming, policy: WindowPolicy) -> bool:
    """Enough windows (``policy.min_windows``), and the last ones agree within
    ``policy.target_spread``.

    Example:
        >>> p = WindowPolicy(min_windows=2, target_spread=0.05)
        >>> settled(WindowTiming((100.0,), 1, 0, False), p)
        False
        >>> settled(WindowTiming((100.0, 102.0), 2, 0, False), p)
        True
        >>> settled(WindowTiming((100.0, 120.0), 2, 0, False), p)
        False
    """
    spread = timing.spread
    return (
        len(timing.rates) >= policy.min_windows
        and spread is not None
        and spread <= policy.target_spread
    )
