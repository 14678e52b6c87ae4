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
   midpoint is tried, while the two are more than :data:`REFINE_GRID` apart (the sweep's
   grid of powers of two and midpoints); when one becomes the best, its new neighbours are
   refined in turn, and when the one above fails (out of memory, past the headroom, or
   predicted so), the gap up to it is halved again while at least :data:`REFINE_RATIO`
   apart: a binary search for the largest size that fits.
3. **Final alternation** (:meth:`Search.final`). The sizes whose probes came within
   :data:`SHORTLIST_WITHIN` of the fastest, or within its spread if wider (three at most),
   are measured against it in
   alternating windows, and their figures rescaled to its own (:func:`rescaled`), so the
   choice among them does not depend on when each was probed; a size alternated with it
   before (where the growth stopped) keeps that figure and is not measured again. Without
   ``compare`` (or without time for it), **confirmation** instead: when the fastest size's
   windows did not settle, it is measured again and the second measurement counts; at most
   twice.
4. **Choice** (:func:`choose`): the fastest size measured within the headroom; never a
   size that was not run, nor one that ran out of memory in an alternation (``compare``
   names it, :class:`~trainperf.batchsize._compare.AlternationOOM`; it is marked ``oom``
   with the error as its reason, a note says so, and the growth stops there).

Allowed sizes (:class:`SizeSpace`) are the integers in ``[min_size, max_size]``, or, with
``global_batch``, the divisors of ``global_batch / world_size`` there. Every rule is a pure
function of measured figures (:mod:`trainperf.batchsize._rules`); :class:`Search` drives
them with an injected ``probe`` and ``compare``, so the tests run on synthetic throughput
and memory curves (and drifting hosts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainperf.batchsize._compare import (
    AlternationOOM,
    Comparison,
    compare_cost,
    outgrows,
    rescaled,
    shortlist,
    undecided,
)
from trainperf.batchsize._report import BatchSizeCandidate
from trainperf.batchsize._rules import (
    MIN_GAIN,
    REFINE_GRID,
    REFINE_RATIO,
    SHORTLIST_WITHIN,
    choose,
    growth_factor,
    looks_flat,
    needs_confirming,
    predicted_peak,
    probe_cost,
    refinement_targets,
    rising,
    skip_reason,
)
from trainperf.batchsize._sizes import SizeSpace

__all__ = [
    "MIN_GAIN",
    "REFINE_GRID",
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

_MAX_ROUNDS = 6


ProbeFn = Callable[[int], BatchSizeCandidate]
"""``probe(batch_size) -> BatchSizeCandidate``: run one size and report it."""
CompareFn = Callable[[Sequence[BatchSizeCandidate], int], Comparison | AlternationOOM | None]
"""``compare(candidates, rounds) -> Comparison | AlternationOOM | None``: measure sizes in
alternation; :class:`AlternationOOM` names the size that ran out of memory there."""


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
        budget_cut: the budget stopped something: a size not tried or not measured again,
            an alternation not run or ended early (a probe's own cut is in its reason).
        measured_twice: the sizes measured a second time.
        compared: the sets of sizes measured in alternation.
        comparisons: their measurements (each size's figure was rescaled by them).
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
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    measured_twice: set[int] = field(default_factory=set)
    budget_cut: bool = False

    def _last_measured(self) -> BatchSizeCandidate | None:
        measured = [c for c in self.results if c.samples_per_s]
        return max(measured, key=lambda c: c.batch_size, default=None)

    def _skip(self, size: int) -> str | None:
        predicted = predicted_peak([c for c in self.results if c.probed], size, self.baseline)
        usable = self.usable()
        cost = probe_cost(
            self._last_measured(),
            size,
            warmup_steps=self.warmup_steps,
            min_windows=self.min_windows,
            window_s=self.window_s,
        )
        reason = skip_reason(size, predicted, usable, cost, self.time_left())
        if reason is not None and skip_reason(size, predicted, usable, cost, math.inf) is None:
            self.budget_cut = True  # the time left alone stopped it
        return reason

    def attempt(self, size: int) -> BatchSizeCandidate:
        """Run ``size``, or record why not; the first size is always run."""
        if self.results:
            reason = self._skip(size)
            if reason is not None:
                c = BatchSizeCandidate(
                    size, "skipped", accumulation_steps=self.space.accumulation(size),
                    reason=reason,
                )  # fmt: skip
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
        best, c = self._current(best), self._current(c)
        if not (best.ok and c.ok):
            return self._oom_stop(best, c)
        if (
            cmp is not None
            and not outgrows(cmp, best.batch_size, c.batch_size, MIN_GAIN)
            and undecided(cmp, c.batch_size)
        ):
            more = self._alternate([best, c])  # the stop waits for more rounds
            best, c = self._current(best), self._current(c)
            if not (best.ok and c.ok):
                return self._oom_stop(best, c)
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

    def _oom_stop(
        self, best: BatchSizeCandidate, c: BatchSizeCandidate
    ) -> tuple[BatchSizeCandidate, BatchSizeCandidate, bool]:
        """One of the two ran out of memory in their alternation: the growth stops (a
        failing ``c`` gets the growth's note; a failing ``best`` its own here)."""
        if c.ok:
            self.notes.append(f"growth stopped at {c.batch_size}: {best.batch_size} {best.reason}")
            return c, c, True
        return best, c, True

    def _replace(self, old: BatchSizeCandidate, new: BatchSizeCandidate) -> BatchSizeCandidate:
        self.results[self.results.index(old)] = new
        return new

    def _current(self, c: BatchSizeCandidate) -> BatchSizeCandidate:
        """``c``'s size as :attr:`results` holds it now (marked ``oom`` by an alternation,
        say)."""
        return next((r for r in self.results if r.batch_size == c.batch_size), c)

    def _mark_oom(self, oom: AlternationOOM, sizes: Sequence[BatchSizeCandidate]) -> None:
        """The size that ran out of memory in an alternation becomes ``oom``: never chosen."""
        c = next(c for c in sizes if c.batch_size == oom.size)
        others = ", ".join(str(o.batch_size) for o in sizes if o is not c)
        failed = dataclasses.replace(
            self._current(c), status="oom", samples_per_s=None, spread=None, reason=oom.reason
        )
        self._replace(self._current(c), failed)
        self.notes.append(
            f"{c.batch_size} ran out of memory while measured in alternation with {others} "
            f"({oom.reason}): not chosen"
        )

    def _alternate(self, sizes: Sequence[BatchSizeCandidate]) -> Comparison | None:
        """``sizes`` measured in alternation, or None (no ``compare``, no time for it, or a
        size ran out of memory: that size is then marked ``oom``)."""
        if self.compare is None:
            return None
        cost = compare_cost(sizes, self.compare_rounds, self.window_s)
        if cost > self.time_left():
            self.budget_cut = True
            self.notes.append(
                f"no time left to measure {', '.join(str(c.batch_size) for c in sizes)} in "
                f"alternation (about {cost:.1f} s)"
            )
            return None
        self.compared.append(frozenset(c.batch_size for c in sizes))
        cmp = self.compare(sizes, self.compare_rounds)
        if isinstance(cmp, AlternationOOM):
            self._mark_oom(cmp, sizes)
            return None
        if cmp is not None:
            self.comparisons.append(cmp)
            self.budget_cut |= len(cmp.rounds) < self.compare_rounds  # the deadline ended it
        return cmp

    def _alternated_with(self, size: int) -> set[int]:
        """The sizes already measured in alternation with ``size`` (their figures are on one
        scale: a ratio measured within rounds holds whenever it was measured)."""
        return {n for cmp in self.comparisons if size in cmp.sizes for n in cmp.sizes}

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
        known = self._alternated_with(ref.batch_size)
        fresh = [c for c in others if c.batch_size not in known]
        if not fresh:
            return True  # each was alternated with the fastest already
        cmp = self._alternate([ref, *fresh])
        if cmp is None:
            return False
        for c in fresh:
            self._replace(c, rescaled(c, cmp, ref))
        ratios = ", ".join(f"{n}: {100 * cmp.ratio(n):.1f} %" for n in cmp.sizes)
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
        # Its new figure is on no alternation's scale: the final one must measure it again.
        self.comparisons = [cmp for cmp in self.comparisons if c.batch_size not in cmp.sizes]
        self.compared = [done for done in self.compared if c.batch_size not in done]
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
