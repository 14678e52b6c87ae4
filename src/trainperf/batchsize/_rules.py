"""The search's rules, each a pure function of measured figures
(:mod:`trainperf.batchsize._search` drives them): whether a larger size rises, looks flat
or grows in proportion, whether a measurement needs confirming, the peak and the cost a
size is predicted to have, why it is skipped, which size is chosen, and which midpoints
refinement tries.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainperf._utils.format import format_bytes
from trainperf.batchsize._report import BatchSizeCandidate
from trainperf.batchsize._sizes import SizeSpace

__all__ = [
    "MIN_GAIN",
    "REFINE_GRID",
    "REFINE_RATIO",
    "SHORTLIST_WITHIN",
    "choose",
    "growth_factor",
    "looks_flat",
    "needs_confirming",
    "predicted_peak",
    "probe_cost",
    "refinement_targets",
    "rising",
    "skip_reason",
]

MIN_GAIN = 0.01
"""A larger size must be at least this much faster (or more than the spread) to count."""
REFINE_GRID = 1.5
"""Two sizes that both ran are refined only while more than this far apart (hi / lo): the
grid of powers of two and their midpoints. Finer steps near the optimum change samples/s by
less than a probe's noise, and each costs a probe."""
REFINE_RATIO = 1.25
"""A size and a failing one above it (out of memory, past the headroom) are refined while
at least this far apart: a binary search for the largest size that fits."""
SHORTLIST_WITHIN = 0.4
"""Sizes whose own probe came within this of the fastest (or within the fastest's spread, if
wider) are measured against it at the end: on a busy host probes taken at different moments
differ by this much."""


def rising(best: BatchSizeCandidate, new: BatchSizeCandidate) -> bool:
    """True when ``new`` is faster than ``best`` by more than the measurements' spread
    (and at least :data:`MIN_GAIN`).

    Example:
        >>> a = BatchSizeCandidate(64, "ok", samples_per_s=1000.0, spread=0.02)
        >>> rising(a, BatchSizeCandidate(128, "ok", samples_per_s=1100.0, spread=0.03))
        True
        >>> rising(a, BatchSizeCandidate(128, "ok", samples_per_s=1025.0, spread=0.03))
        False
    """
    if best.samples_per_s is None or new.samples_per_s is None:
        return False
    noise = max(best.spread or 0.0, new.spread or 0.0, MIN_GAIN)
    return new.samples_per_s > best.samples_per_s * (1.0 + noise)


def looks_flat(best: BatchSizeCandidate, new: BatchSizeCandidate) -> bool:
    """True when ``new``'s own figure is not above ``best``'s by :data:`MIN_GAIN`: worth
    measuring the two in alternation before the growth stops. A figure above it but within
    the spread lets the growth go on without that (a larger size tried costs time, not the
    choice: the final alternation judges the fastest).

    Example:
        >>> a = BatchSizeCandidate(64, "ok", samples_per_s=1000.0, spread=0.3)
        >>> looks_flat(a, BatchSizeCandidate(128, "ok", samples_per_s=1005.0, spread=0.3))
        True
        >>> looks_flat(a, BatchSizeCandidate(128, "ok", samples_per_s=1100.0, spread=0.3))
        False
    """
    return (new.samples_per_s or 0.0) <= (best.samples_per_s or 0.0) * (1.0 + MIN_GAIN)


def growth_factor(prev: BatchSizeCandidate, new: BatchSizeCandidate) -> int:
    """4 when throughput grew almost in proportion to the size from ``prev`` to ``new``
    (by at least the size ratio to the power 0.8), else 2.

    Example:
        >>> one = BatchSizeCandidate(1, "ok", samples_per_s=100.0)
        >>> growth_factor(one, BatchSizeCandidate(2, "ok", samples_per_s=190.0))
        4
        >>> growth_factor(one, BatchSizeCandidate(2, "ok", samples_per_s=150.0))
        2
    """
    if not prev.samples_per_s or not new.samples_per_s or new.batch_size <= prev.batch_size:
        return 2
    gain = new.samples_per_s / prev.samples_per_s
    return 4 if gain >= (new.batch_size / prev.batch_size) ** 0.8 else 2


def needs_confirming(c: BatchSizeCandidate, target_spread: float) -> bool:
    """True when ``c``'s windows did not settle within ``target_spread``.

    Example:
        >>> needs_confirming(BatchSizeCandidate(8, "ok", samples_per_s=1.0, spread=0.3), 0.05)
        True
    """
    return c.ok and c.spread is not None and c.spread > target_spread


def predicted_peak(
    measured: Sequence[BatchSizeCandidate], size: int, baseline: int
) -> float | None:
    """Peak memory expected at ``size``, from the peaks measured so far.

    A straight line through the two largest sizes with a measured peak (memory grows with
    the batch: activations; the rest is fixed: weights, gradients, optimizer state). With a
    single one, proportional to its growth over ``baseline`` (the memory before probing),
    which overestimates: the fixed part is counted as growing too. None when nothing was
    measured.

    Example:
        >>> m = [BatchSizeCandidate(32, "ok", peak_memory=1300), BatchSizeCandidate(64, "ok",
        ...      peak_memory=1600)]
        >>> predicted_peak(m, 128, 1000), predicted_peak(m[:1], 64, 1000)
        (2200.0, 1600.0)
    """
    points = sorted(
        {c.batch_size: c.peak_memory for c in measured if c.peak_memory is not None}.items()
    )
    if not points:
        return None
    n1, p1 = points[-1]
    if len(points) == 1:
        return baseline + max(0, p1 - baseline) * size / n1
    n0, p0 = points[-2]
    slope = max(0.0, (p1 - p0) / (n1 - n0))
    return p1 + slope * (size - n1)


def probe_cost(
    last: BatchSizeCandidate | None,
    size: int,
    *,
    warmup_steps: int,
    min_windows: int,
    window_s: float,
) -> float:
    """Seconds a probe of ``size`` is expected to take, from the last measured one.

    A step's time is taken to grow in proportion to the batch (an overestimate: larger
    batches use the hardware better); the probe runs ``warmup_steps`` steps and then at
    least ``min_windows`` windows of ``window_s`` (or one step, if longer). 0.0 when
    nothing was measured yet.

    Example:
        >>> last = BatchSizeCandidate(64, "ok", samples_per_s=640.0)   # 0.1 s per step
        >>> probe_cost(last, 128, warmup_steps=2, min_windows=2, window_s=0.25)
        0.9
    """
    if last is None or not last.samples_per_s:
        return 0.0
    step_s = last.batch_size / last.samples_per_s * size / last.batch_size
    return round(warmup_steps * step_s + min_windows * max(step_s, window_s), 6)


def skip_reason(
    size: int,
    predicted: float | None,
    usable: float | None,
    cost_s: float,
    time_left_s: float,
) -> str | None:
    """Why ``size`` is not run, or None when it is.

    Example:
        >>> skip_reason(256, 9e9, 8e9, 1.0, 30.0)
        'predicted peak 8.4 GiB is past the 7.5 GiB usable'
        >>> skip_reason(256, 1e9, 8e9, 12.0, 5.0)
        'would take about 12.0 s, 5.0 s left of the budget'
        >>> skip_reason(256, None, None, 1.0, 5.0) is None
        True
    """
    if predicted is not None and usable is not None and predicted > usable:
        return f"predicted peak {format_bytes(predicted)} is past the {format_bytes(usable)} usable"
    if cost_s > time_left_s:
        return f"would take about {cost_s:.1f} s, {max(time_left_s, 0.0):.1f} s left of the budget"
    return None


def choose(results: Sequence[BatchSizeCandidate]) -> BatchSizeCandidate | None:
    """The fastest size measured within the headroom (the smaller on a tie), else None.

    Example:
        >>> rs = [BatchSizeCandidate(64, "ok", samples_per_s=900.0),
        ...       BatchSizeCandidate(128, "ok", samples_per_s=950.0),
        ...       BatchSizeCandidate(256, "oom")]
        >>> choose(rs).batch_size
        128
    """
    ok = [c for c in results if c.ok]
    if not ok:
        return None
    return max(ok, key=lambda c: (c.samples_per_s or 0.0, -c.batch_size))


def refinement_targets(
    results: Sequence[BatchSizeCandidate], space: SizeSpace, best: BatchSizeCandidate
) -> list[int]:
    """Sizes to try between ``best`` and its neighbours (see the module docstring).

    Example:
        >>> rs = [BatchSizeCandidate(n, "ok", samples_per_s=r)
        ...       for n, r in ((64, 800.0), (128, 1000.0), (256, 990.0))]
        >>> refinement_targets(rs, SizeSpace(1, 1024), rs[1])
        [96, 192]
    """
    tried = {c.batch_size for c in results}
    below = max((c for c in results if c.batch_size < best.batch_size),
                key=lambda c: c.batch_size, default=None)  # fmt: skip
    above = min((c for c in results if c.batch_size > best.batch_size),
                key=lambda c: c.batch_size, default=None)  # fmt: skip
    out: list[int] = []
    for lo, hi in ((below, best), (best, above)):
        if lo is None or hi is None or not _gap_wide(lo, hi):
            continue
        mid = space.between(lo.batch_size, hi.batch_size)
        if mid is not None and mid not in tried:
            out.append(mid)
    return out


def _gap_wide(lo: BatchSizeCandidate, hi: BatchSizeCandidate) -> bool:
    """Whether the gap between two neighbours has a midpoint worth a probe: wider than
    :data:`REFINE_GRID` where both ran, at least :data:`REFINE_RATIO` where one failed."""
    ratio = hi.batch_size / lo.batch_size
    if lo.ok and hi.ok:
        return ratio > REFINE_GRID
    return ratio >= REFINE_RATIO
