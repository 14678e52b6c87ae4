"""The search: grow geometrically, then refine around the best size. Not a sweep.

1. **Growth.** From the smallest allowed size, each next size is the smallest allowed one
   at least twice as large, or four times while throughput still grows almost in
   proportion to the size (:func:`growth_factor`: the per-step overhead dominates there, so
   the optimum is further up). A size whose probe does not raise throughput by more than
   the measurement's spread (:func:`rising`), and is not even :data:`MIN_GAIN` above the
   best so far (:func:`looks_flat`), is measured against that best in alternating windows
   (:mod:`trainperf.batchsize._compare`: probes taken seconds apart on a shared host
   differ by more than the sizes do); the growth stops unless it beat the best there by
   more than :data:`MIN_GAIN` (rounds that disagree, :func:`undecided`, get as many again
   first). It also stops at a size that runs out of
   memory or peaks past the headroom, that is predicted to peak past the headroom
   (:func:`predicted_peak`: a straight line through the two largest measured peaks), or
   that would not finish in the time left (:func:`probe_cost`).
2. **Refinement.** Between the best size and each of its neighbours (the nearest sizes
   considered below and above, whatever their status), the allowed size nearest the
   midpoint is tried, while the two are at least 25 % apart; when one becomes the best,
   its new neighbours are refined in turn, and when the one above fails (out of memory,
   past the headroom, or predicted so), the gap up to it is halved again: a binary search
   for the largest size that fits.
3. **Final alternation** (:meth:`Search.final`). The sizes whose probes came within
   :data:`SHORTLIST_WITHIN` of the fastest, or within its spread if wider (three at most),
   are measured against it in
   alternating windows, and their figures rescaled to its own (:func:`rescaled`), so the
   choice among them does not depend on when each was probed. Without ``compare`` (or
   without time for it), **confirmation** instead: when the fastest size's windows did not
   settle, it is measured again and the second measurement counts; at most twice.
4. **Choice** (:func:`choose`): the fastest size measured within the headroom; never a
   size that was not run.

Allowed sizes (:class:`SizeSpace`) are the integers in ``[min_size, max_size]``, or, with
``global_batch``, the divisors of ``global_batch / world_size`` there. Every rule is a pure
function of measured figures; :class:`Search` drives them with an injected ``probe`` and
``compare``, so the tests run on synthetic throughput and memory curves (and drifting hosts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainperf._utils.format import format_bytes
from trainperf.batchsize._compare import (
    Comparison,
    compare_cost,
    outgrows,
    rescaled,
    shortlist,
    undecided,
)
from trainperf.batchsize._report import BatchSizeCandidate
from trainperf.batchsize._sizes import SizeSpace

__all__ = [
    "MIN_GAIN",
    "REFINE_RATIO",
    "SHORTLIST_WITHIN",
    "Search",
    "SizeSpace",
    "choose",
    "growth_factor",
    "looks_flat",
    "needs_confirming",
    "probe_cost",
    "predicted_peak",
    "refinement_targets",
    "rising",
    "skip_reason",
]

MIN_GAIN = 0.01
"""A larger size must be at least this much faster (or more than the spread) to count."""
REFINE_RATIO = 1.25
"""Two sizes at least this far apart (hi / lo) have a midpoint worth trying."""
SHORTLIST_WITHIN = 0.4
"""Sizes whose own probe came within this of the fastest (or within the fastest's spread, if
wider) are measured against it at the end: on a busy host probes taken at different moments
differ by this much."""
_MAX_ROUNDS = 6


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
    below = [c.batch_size for c in results if c.batch_size < best.batch_size]
    above = [c.batch_size for c in results if c.batch_size > best.batch_size]
    out: list[int] = []
    for lo, hi in (
        (max(below, default=None), best.batch_size),
        (best.batch_size, min(above, default=None)),
    ):
        if lo is None or hi is None or hi < REFINE_RATIO * lo:
            continue
        mid = space.between(lo, hi)
        if mid is not None and mid not in tried:
            out.append(mid)
    return out


ProbeFn = Callable[[int], BatchSizeCandidate]
"""``probe(batch_size) -> BatchSizeCandidate``: run one size and report it."""
CompareFn = Callable[[Sequence[BatchSizeCandidate], int], Comparison | None]
"""``compare(candidates, rounds) -> Comparison | None``: measure sizes in alternation."""


@dataclass
class Search:
    """One tuning run: growth, then refinement (see the module docstring).

    Attributes:
        space: the allowed sizes.
        probe: runs one size (owns the measurement, the memory and OOM recovery).
        time_left: seconds left of the budget (agreed between ranks under DDP).
        usable: the most a size may peak at, in bytes (None when not measured); read
            before each size, since the limit can shrink.
        baseline: the memory before probing, for :func:`predicted_peak`.
        warmup_steps, min_windows, window_s: the probe's shape, for :func:`probe_cost`.
        target_spread: the windows' spread past which the best size is measured again.
        compare: measures sizes against each other in alternating windows
            (:mod:`trainperf.batchsize._compare`); None: decisions use each probe's own
            figure, and an unsettled one is measured again instead.
        compare_rounds: rounds of a comparison.
        results: every size considered, in order.
        notes: why the growth stopped, what the budget cut.
        measured_twice: the sizes measured a second time.
        compared: the sets of sizes measured in alternation.
    """

    space: SizeSpace
    probe: ProbeFn
    time_left: Callable[[], float]
    usable: Callable[[], float | None]
    baseline: int = 0
    warmup_steps: int = 2
    min_windows: int = 2
    window_s: float = 0.25
    target_spread: float = 0.05
    compare: CompareFn | None = None
    compare_rounds: int = 3
    results: list[BatchSizeCandidate] = field(default_factory=list)
    compared: list[frozenset[int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured_twice: set[int] = field(default_factory=set)

    def _last_measured(self) -> BatchSizeCandidate | None:
        measured = [c for c in self.results if c.samples_per_s]
        return max(measured, key=lambda c: c.batch_size, default=None)

    def _skip(self, size: int) -> str | None:
        return skip_reason(
            size,
            predicted_peak([c for c in self.results if c.probed], size, self.baseline),
            self.usable(),
            probe_cost(
                self._last_measured(),
                size,
                warmup_steps=self.warmup_steps,
                min_windows=self.min_windows,
                window_s=self.window_s,
            ),
            self.time_left(),
        )

    def attempt(self, size: int) -> BatchSizeCandidate:
        """Run ``size``, or record why not; the first size is always run."""
        if self.results:
            reason = self._skip(size)
            if reason is not None:
                c = BatchSizeCandidate(size, "skipped", reason=reason)
                self.results.append(c)
                return c
        c = self.probe(size)
        self.results.append(c)
        return c

    def grow(self) -> None:
        """Double until throughput, memory, an OOM, the space or the budget stops it."""
        size = self.space.first()
        best: BatchSizeCandidate | None = None
        prev: BatchSizeCandidate | None = None
        while size is not None:
            c = self.attempt(size)
            if not c.ok:
                self.notes.append(f"growth stopped at {size}: {c.status} ({c.reason})")
                return
            if best is not None and not rising(best, c) and self._doubtful(best, c):
                best, c, stop = self._second_look(best, c)
                if not c.ok:
                    self.notes.append(f"growth stopped at {size}: {c.status} ({c.reason})")
                    return
                if stop:
                    return
            if best is None or (c.samples_per_s or 0.0) > (best.samples_per_s or 0.0):
                best = c
            factor = 2 if prev is None else growth_factor(prev, c)
            prev = c
            size = self.space.up(size, factor)
        self.notes.append("growth reached the largest allowed size")

    def _doubtful(self, best: BatchSizeCandidate, c: BatchSizeCandidate) -> bool:
        """Not faster by more than the spread: without ``compare`` that takes a second look;
        with it, only a figure that looks flat does (:func:`looks_flat`), and not at the
        largest allowed size, where the growth ends anyway (the final alternation judges
        the two)."""
        if self.compare is None:
            return True
        return looks_flat(best, c) and self.space.up(c.batch_size) is not None

    def _second_look(
        self, best: BatchSizeCandidate, c: BatchSizeCandidate
    ) -> tuple[BatchSizeCandidate, BatchSizeCandidate, bool]:
        """``c`` did not rise over ``best`` by its probe: before the growth stops, the two
        are measured in alternation (or, without ``compare``, an unsettled figure is
        measured again). Returns ``(best, c, stop)``, ``stop`` with its note written."""
        cmp = self._alternate([best, c])
        if (
            cmp is not None
            and not outgrows(cmp, best.batch_size, c.batch_size, MIN_GAIN)
            and undecided(cmp, c.batch_size)
        ):
            more = self._alternate([best, c])  # the stop waits for more rounds
            if more is not None:
                cmp = Comparison(cmp.sizes, cmp.rounds + more.rounds)
        if cmp is not None:
            c = self._replace(c, rescaled(c, cmp, best))
            if outgrows(cmp, best.batch_size, c.batch_size, MIN_GAIN):
                return best, c, False
            self.notes.append(
                f"growth stopped at {c.batch_size}: in {len(cmp.rounds)} rounds alternating "
                f"with {best.batch_size}, it ran at {100 * cmp.ratio(c.batch_size):.1f} % of "
                f"{best.batch_size}'s samples/s (not {100 * MIN_GAIN:.0f} % faster)"
            )
            return best, c, True
        # A stop decided on an unsettled figure (either one) is noise: measure again.
        if self._unsettled(best):
            best = self._measure_again(best)
        if self._unsettled(c):
            c = self._measure_again(c)
        if not c.ok:
            return best, c, True
        if not best.ok:  # the best ran out of memory on its second run
            best = c
        if rising(best, c):
            return best, c, False
        self.notes.append(
            f"growth stopped at {c.batch_size}: {c.samples_per_s:,.1f} samples/s is not "
            f"faster than {best.batch_size}'s {best.samples_per_s:,.1f} by more than "
            f"the spread"
        )
        return best, c, True

    def _replace(self, old: BatchSizeCandidate, new: BatchSizeCandidate) -> BatchSizeCandidate:
        self.results[self.results.index(old)] = new
        return new

    def _alternate(self, sizes: Sequence[BatchSizeCandidate]) -> Comparison | None:
        """``sizes`` measured in alternation, or None (no ``compare``, no time for it, or a
        size ran out of memory on its second run)."""
        if self.compare is None:
            return None
        cost = compare_cost(sizes, self.compare_rounds, self.window_s)
        if cost > self.time_left():
            self.notes.append(
                f"no time left to measure {', '.join(str(c.batch_size) for c in sizes)} in "
                f"alternation (about {cost:.1f} s)"
            )
            return None
        self.compared.append(frozenset(c.batch_size for c in sizes))
        return self.compare(sizes, self.compare_rounds)

    def final(self) -> bool:
        """The sizes whose own figures came within :data:`SHORTLIST_WITHIN` of the fastest,
        or within its spread if wider (a lucky outlier's figure is wide), three at most,
        measured against it in alternation, their figures rescaled to its own. False when
        that could not be done (no ``compare``, no time)."""
        ok = [c for c in self.results if c.ok]
        top = choose(ok)
        within = max(SHORTLIST_WITHIN, 0.0 if top is None else (top.spread or 0.0))
        sizes = shortlist(
            [(c.batch_size, c.samples_per_s or 0.0) for c in ok], within=min(within, 0.9), most=3
        )
        if len(sizes) < 2:
            return False
        if any(set(sizes) <= done for done in self.compared):
            return True  # these were alternated already: no new figure since
        by_size = {c.batch_size: c for c in ok}
        ref, *others = (by_size[n] for n in sizes)
        cmp = self._alternate([ref, *others])
        if cmp is None:
            return False
        for c in others:
            self._replace(c, rescaled(c, cmp, ref))
        ratios = ", ".join(f"{n}: {100 * cmp.ratio(n):.1f} %" for n in sizes)
        self.notes.append(
            f"the fastest sizes alternated for {len(cmp.rounds)} rounds ({ratios} of "
            f"{ref.batch_size}'s samples/s)"
        )
        return True

    def refine(self) -> None:
        """Try midpoints around the best size while they improve on it, or while the one
        above it fails (the gap to the memory limit shrinks)."""
        for _ in range(_MAX_ROUNDS):
            best = choose(self.results)
            if best is None:
                return
            targets = refinement_targets(self.results, self.space, best)
            if not targets:
                return
            tried = [self.attempt(t) for t in targets]
            above_failed = any(c.batch_size > best.batch_size and not c.ok for c in tried)
            new = choose(self.results)
            if new is None or (new.batch_size == best.batch_size and not above_failed):
                return

    def _unsettled(self, c: BatchSizeCandidate) -> bool:
        """Worth measuring again: unsettled, not measured twice yet, and time left for it."""
        return (
            needs_confirming(c, self.target_spread)
            and c.batch_size not in self.measured_twice
            and self._skip(c.batch_size) is None
        )

    def _measure_again(self, c: BatchSizeCandidate) -> BatchSizeCandidate:
        """Probe ``c``'s size again; the second measurement replaces the first."""
        self.measured_twice.add(c.batch_size)
        again = self.probe(c.batch_size)
        first = f"measured twice: the first run's windows spread {100 * (c.spread or 0):.0f} %"
        note = f"{first} ({c.samples_per_s:,.1f} samples/s)"
        reason = note if again.reason is None else f"{again.reason}; {note}"
        again = dataclasses.replace(again, reason=reason)
        self.results[self.results.index(c)] = again
        return again

    def confirm(self) -> None:
        """Measure the best size again while its windows did not settle (at most twice);
        the second measurement replaces the first."""
        for _ in range(2):
            best = choose(self.results)
            if best is None or not self._unsettled(best):
                return
            self._measure_again(best)

    def run(self) -> BatchSizeCandidate | None:
        """Growth, refinement, the fastest sizes alternated (or, without ``compare``, the
        best confirmed), and the choice (None when no size fits)."""
        self.grow()
        self.refine()
        if not self.final():
            self.confirm()
        return choose(self.results)
