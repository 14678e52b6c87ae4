"""A lasting change in step time (a regime change): :func:`find_shift`, a pure function.

A loop whose per-sample cost changes part-way (an epoch's augmentation gets heavier, the
data moves from page cache to disk, other jobs land on the host) is two loops in one: the
average of both describes neither, and a DataLoader tuned for the first goes stale in the
second. ``analyse`` judges the loop as it runs *now*: where :func:`find_shift` finds a
lasting change, the verdict and its predictions cover the steps since the change.

The test is on medians, so stalls (a checkpoint every N steps) and noise do not make a
change: the steps are grouped into runs of at least ``MIN_BIN`` steps (DataLoader workers
deliver in bursts, so that single steps alternate between short and long: two workers,
one short step and one long) and at most ``MAX_BINS`` runs, each run is represented by
its median, and a change is a cut between runs where the runs' median after it is at least
``SHIFT_RATIO`` times the median before it (or at most 1 / ``SHIFT_RATIO``), each side
holds at least ``MIN_PHASE_SHARE`` of the runs and ``MIN_PHASE_STEPS`` steps, and at least
``CONSISTENT`` of the runs on each side lie on their own side of the two medians'
geometric mean, and neither side drifts (the medians of its first and second halves differ
by less than the fourth root of the change: contention that wanders up and down, or a
loop that slows steadily, is not two levels). The cut is then placed at the step, within
a run of it, that splits the steps themselves best.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CONSISTENT", "MAX_BINS", "MIN_BIN", "MIN_PHASE_SHARE", "MIN_PHASE_STEPS",
           "SHIFT_RATIO", "Shift", "find_shift"]  # fmt: skip

SHIFT_RATIO = 1.5
MIN_PHASE_STEPS = 10
MIN_PHASE_SHARE = 0.2
MAX_BINS = 100
MIN_BIN = 4
CONSISTENT = 0.8


@dataclass(frozen=True)
class Shift:
    """A lasting change in step time.

    Attributes:
        step: the number of the first step after the change.
        before_s: the median step time before it.
        after_s: the median step time since.
    """

    step: int
    before_s: float
    after_s: float

    @property
    def ratio(self) -> float:
        """``after_s / before_s``: above 1 the loop got slower."""
        return self.after_s / self.before_s if self.before_s > 0 else math.inf


def _bins(durations: Sequence[float]) -> tuple[list[float], int]:
    size = max(MIN_BIN, -(-len(durations) // MAX_BINS))
    values = [statistics.median(durations[i : i + size]) for i in range(0, len(durations), size)]
    return values, size


def _score(values: Sequence[float], cut: int) -> tuple[float, float, float] | None:
    """``(consistency, before, after)`` of a cut, None when its medians differ too little."""
    before, after = statistics.median(values[:cut]), statistics.median(values[cut:])
    if before <= 0 or after <= 0:
        return None
    if max(after / before, before / after) < SHIFT_RATIO:
        return None
    mid = math.sqrt(before * after)
    rise = after > before
    left = sum((v < mid) == rise for v in values[:cut]) / cut
    right = sum((v > mid) == rise for v in values[cut:]) / (len(values) - cut)
    if min(left, right) < CONSISTENT:
        return None
    jump = max(after / before, before / after)
    if max(_drift(values[:cut]), _drift(values[cut:])) > jump**0.25:
        return None  # a side that drifts as it goes: a wander, not two levels
    return (left * cut + right * (len(values) - cut)) / len(values), before, after


def _drift(values: Sequence[float]) -> float:
    """How far a side's level moves within it: the ratio of the medians of its first and
    second halves (1.0 for a side too short to halve)."""
    if len(values) < 4:
        return 1.0
    half = len(values) // 2
    a, b = statistics.median(values[:half]), statistics.median(values[half:])
    if a <= 0 or b <= 0:
        return 1.0
    return max(a / b, b / a)


def find_shift(durations: Sequence[float], first: int = 0) -> Shift | None:
    """The lasting change in step time, if the steps (numbered from ``first``) show one.

    Args:
        durations: the measured steps' durations, in order.
        first: the number of the first of them.

    Returns:
        The :class:`Shift` that separates the runs best, or None when there is none.

    Example:
        >>> find_shift([0.01] * 30 + [0.02] * 30, first=2)
        Shift(step=32, before_s=0.01, after_s=0.02)
        >>> find_shift([0.01, 0.05] * 30) is None  # alternating: no lasting change
        True
    """
    if len(durations) < 2 * MIN_PHASE_STEPS:
        return None
    values, size = _bins(durations)
    # Runs are coarse: a side may hold a run fewer than the minimum here, and the placed cut
    # is held to it below.
    lo = max(1, MIN_PHASE_STEPS // size, math.ceil(MIN_PHASE_SHARE * len(values)) - 1)
    best: tuple[float, int, float, float] | None = None
    for cut in range(lo, len(values) - lo + 1):
        found = _score(values, cut)
        if found is None:
            continue
        consistency, before, after = found
        if best is None or consistency > best[0]:
            best = (consistency, cut, before, after)
    if best is None:
        return None
    _, cut, before, after = best
    step = _place(durations, cut * size, size, before, after)
    shortest = min(step, len(durations) - step)
    if shortest < max(MIN_PHASE_STEPS, MIN_PHASE_SHARE * len(durations)):
        return None  # placed on the steps themselves, one side is a tail, not a regime
    return Shift(first + step, before, after)


def _place(durations: Sequence[float], at: int, size: int, before: float, after: float) -> int:
    """The step, within a run of ``at``, that best splits the steps by the two medians:
    the fewest steps before it on the new side of their geometric mean, and after it on
    the old (the earliest on a tie)."""
    mid, rise = math.sqrt(before * after), after > before
    new = [(d > mid) == rise for d in durations]
    lo, hi = max(1, at - size), min(len(durations) - 1, at + size)
    wrong = sum(new[:lo]) + sum(not x for x in new[lo:])
    best, best_wrong = lo, wrong
    for i in range(lo, hi):  # moving the cut past step i
        wrong += 1 if new[i] else -1
        if wrong < best_wrong:
            best, best_wrong = i + 1, wrong
    return best
