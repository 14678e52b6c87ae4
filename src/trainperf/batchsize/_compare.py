"""Sizes measured against each other in alternation, so that the host's drift hits each alike.

A probe measures one size at a time, and on a shared host the load changes between probes
far more than within one: on the 2-core CI machine a sweep measured ResNet-18 at 30.9
samples/s at batch 8 and 16.5 at batch 16, seconds apart, then 47.5 at 32. Comparing two
probes compares two moments as much as two sizes. So where a decision hangs on which of a
few sizes is faster (whether the growth stops, and the final choice), the tuner runs them
in **alternating windows**: one window of each size per round, the order reversed every
other round (``A B``, ``B A``, ``A B``: a load that rises or falls steadily costs each size
the same), and compares each size with the first (the reference) *within* each round. The
figure is the median over the rounds of that ratio (:class:`Comparison`), so a load spike
during one round moves no more than that round's ratio.

Every rule here is a pure function of the windows' rates; the prober
(:meth:`trainperf.batchsize._probe.Prober.compare`) runs the windows.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from trainperf.batchsize._report import BatchSizeCandidate

__all__ = [
    "UNDECIDED_SPREAD",
    "AlternationOOM",
    "Comparison",
    "compare_cost",
    "outgrows",
    "rescaled",
    "round_order",
    "shortlist",
    "undecided",
]

UNDECIDED_SPREAD = 0.1
"""Rounds whose ratios spread wider than this leave a "not faster" verdict open."""


def round_order(sizes: Sequence[int], r: int) -> list[int]:
    """The order of round ``r``: as given in even rounds, reversed in odd ones.

    Example:
        >>> round_order([32, 64], 0), round_order([32, 64], 1), round_order([8, 16, 24], 1)
        ([32, 64], [64, 32], [24, 16, 8])
    """
    return list(sizes) if r % 2 == 0 else list(reversed(sizes))


@dataclass(frozen=True)
class AlternationOOM:
    """A size that ran out of memory while measured in alternation (on any rank).

    Attributes:
        size: the batch size whose step, batch or window raised.
        reason: the error's first line (or "out of memory on another rank").

    Example:
        >>> AlternationOOM(64, "CUDA out of memory").size
        64
    """

    size: int
    reason: str


@dataclass(frozen=True)
class Comparison:
    """The windows of sizes measured in alternation.

    Attributes:
        sizes: the sizes compared; the first is the reference.
        rounds: each round's samples/s, one per size in ``sizes`` order (whatever order
            the round ran them in).

    Example:
        >>> c = Comparison((32, 64), ((100.0, 110.0), (50.0, 56.0), (98.0, 107.0)))
        >>> round(c.ratio(64), 3), c.ratio(32), c.leader()
        (1.1, 1.0, 64)
        >>> round(c.samples_per_s(64), 1), round(c.ratio_spread(64), 3)
        (107.8, 0.026)
    """

    sizes: tuple[int, ...]
    rounds: tuple[tuple[float, ...], ...]

    def _ratios(self, size: int) -> list[float]:
        i = self.sizes.index(size)
        return [r[i] / r[0] for r in self.rounds if r[0] > 0 and math.isfinite(r[i])]

    def ratio(self, size: int) -> float:
        """Median over the rounds of ``size``'s rate over the reference's in that round
        (nan without a round)."""
        ratios = self._ratios(size)
        return statistics.median(ratios) if ratios else math.nan

    def ratio_spread(self, size: int) -> float:
        """(max - min) / median of those ratios: how far the rounds disagree."""
        ratios = self._ratios(size)
        if not ratios:
            return math.nan
        return (max(ratios) - min(ratios)) / statistics.median(ratios)

    def samples_per_s(self, size: int) -> float:
        """``size``'s figure on the reference's scale: the reference's median rate times
        the size's median ratio."""
        ref = [r[0] for r in self.rounds]
        return statistics.median(ref) * self.ratio(size) if ref else math.nan

    def leader(self) -> int:
        """The size with the highest ratio (the smaller on a tie)."""
        return max(self.sizes, key=lambda n: (_or_zero(self.ratio(n)), -n))


def _or_zero(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def outgrows(c: Comparison, best: int, new: int, min_gain: float) -> bool:
    """True when ``new`` beat ``best`` by more than ``min_gain`` in their alternating rounds
    (the growth goes on), judged on the median ratio of the rounds.

    Example:
        >>> c = Comparison((32, 64), ((100.0, 104.0), (100.0, 103.0), (100.0, 80.0)))
        >>> outgrows(c, 32, 64, 0.01), outgrows(c, 32, 64, 0.05)
        (True, False)
    """
    r_best, r_new = c.ratio(best), c.ratio(new)
    if math.isnan(r_best) or math.isnan(r_new) or r_best <= 0:
        return False
    return r_new > r_best * (1.0 + min_gain)


def undecided(c: Comparison, size: int, spread: float = UNDECIDED_SPREAD) -> bool:
    """True when ``size``'s ratios over the rounds spread wider than ``spread``: its median
    may be off by more than the gain in question, so a verdict that would stop the growth
    waits for more rounds.

    Example:
        >>> c = Comparison((4, 8), ((100.0, 100.0), (100.0, 125.0), (100.0, 96.0)))
        >>> undecided(c, 8), undecided(Comparison((4, 8), ((1.0, 1.0), (1.0, 1.02))), 8)
        (True, False)
    """
    s = c.ratio_spread(size)
    return not math.isnan(s) and s > spread


def shortlist(rates: Sequence[tuple[int, float]], *, within: float, most: int) -> list[int]:
    """The sizes worth measuring against the fastest in alternation: the fastest (first)
    and up to ``most - 1`` others whose own probe was within ``within`` of it (faster
    ones first), by each probe's figure.

    Example:
        >>> shortlist([(16, 80.0), (32, 100.0), (64, 95.0), (8, 40.0)], within=0.3, most=3)
        [32, 64, 16]
        >>> shortlist([(16, 80.0), (32, 100.0)], within=0.1, most=3)
        [32]
    """
    ranked = sorted(rates, key=lambda nr: (-nr[1], nr[0]))
    if not ranked:
        return []
    top = ranked[0][1]
    return [n for n, r in ranked if r >= top * (1.0 - within)][:most]


def compare_cost(sizes: Sequence[BatchSizeCandidate], rounds: int, window_s: float) -> float:
    """Seconds a comparison of ``sizes`` is expected to take: one untimed step of each (an
    overestimate on the CPU, where none runs), then ``rounds`` windows of each (``window_s``,
    or one step if longer).

    Example:
        >>> cs = [BatchSizeCandidate(n, "ok", samples_per_s=100.0) for n in (10, 50)]
        >>> compare_cost(cs, 3, 0.25)   # steps of 0.1 s and 0.5 s
        2.85
    """
    total = 0.0
    for c in sizes:
        step_s = c.batch_size / c.samples_per_s if c.samples_per_s else 0.0
        total += step_s + rounds * max(step_s, window_s)
    return round(total, 6)


def rescaled(
    c: BatchSizeCandidate, cmp: Comparison, reference: BatchSizeCandidate
) -> BatchSizeCandidate:
    """``c`` with its figure from a comparison: the reference's own figure times ``c``'s
    median ratio to it in the alternating rounds (so figures stay on the probes' scale),
    and the ratios' spread as its spread.

    Example:
        >>> ref = BatchSizeCandidate(32, "ok", samples_per_s=200.0, spread=0.3)
        >>> new = BatchSizeCandidate(64, "ok", samples_per_s=150.0, spread=0.2)
        >>> cmp = Comparison((32, 64), ((100.0, 110.0), (50.0, 55.0), (90.0, 99.0)))
        >>> r = rescaled(new, cmp, ref)
        >>> round(r.samples_per_s, 1), round(r.spread, 3), r.reason
        (220.0, 0.0, 'alternated with 32 (3 rounds): 110.0 % of its samples/s')
    """
    if c.batch_size == reference.batch_size:
        return c
    ratio = cmp.ratio(c.batch_size) / cmp.ratio(reference.batch_size)
    note = (
        f"alternated with {reference.batch_size} ({len(cmp.rounds)} rounds): "
        f"{100 * ratio:.1f} % of its samples/s"
    )
    return dataclasses.replace(
        c,
        samples_per_s=(reference.samples_per_s or 0.0) * ratio,
        spread=cmp.ratio_spread(c.batch_size),
        reason=note if c.reason is None else f"{c.reason}; {note}",
    )
