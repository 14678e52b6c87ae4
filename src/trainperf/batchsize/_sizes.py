"""The batch sizes the tuner may try: :class:`SizeSpace`.

The integers in ``[min_size, max_size]``, or, with ``global_batch``, the divisors of
``global_batch / world_size`` there (so that ``accumulation_steps`` makes up the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SizeSpace"]


@dataclass(frozen=True)
class SizeSpace:
    """The batch sizes the tuner may try.

    Attributes:
        min_size: the smallest.
        max_size: the largest (None: no bound but memory).
        per_rank: with ``global_batch``, ``global_batch / world_size``: only its divisors
            are allowed.

    Example:
        >>> s = SizeSpace(1, None, 96)
        >>> s.first(), s.up(16), s.up(32), s.up(96), s.between(32, 96)
        (1, 32, 96, None, 48)
        >>> SizeSpace(1, 512).up(256), SizeSpace(1, 512).between(128, 256)
        (512, 192)
    """

    min_size: int
    max_size: int | None
    per_rank: int | None = None

    @property
    def top(self) -> int | None:
        """The largest allowed size, None when unbounded."""
        bounds = [b for b in (self.max_size, self.per_rank) if b is not None]
        return min(bounds) if bounds else None

    def allowed(self, n: int) -> bool:
        """True when ``n`` may be tried."""
        top = self.top
        if n < self.min_size or (top is not None and n > top):
            return False
        return self.per_rank is None or self.per_rank % n == 0

    def _divisors(self) -> list[int] | None:
        """The allowed sizes with ``global_batch`` (its divisors in range), else None."""
        if self.per_rank is None:
            return None
        return [d for d in _divisors(self.per_rank) if self.allowed(d)]

    def accumulation(self, n: int) -> int:
        """The steps of size ``n`` that make up the per-rank batch (1 without one).

        Example:
            >>> SizeSpace(1, None, per_rank=64).accumulation(16), SizeSpace(1, 64).accumulation(16)
            (4, 1)
        """
        return 1 if self.per_rank is None else self.per_rank // n

    def first(self) -> int | None:
        """The smallest allowed size (None when there is none)."""
        sizes = self._divisors()
        if sizes is None:
            return self.min_size if self.allowed(self.min_size) else None
        return sizes[0] if sizes else None

    def up(self, n: int, factor: int = 2) -> int | None:
        """The next size of the growth: the smallest allowed one >= ``factor * n``, else
        the largest allowed one above ``n``; None at the top."""
        sizes = self._divisors()
        if sizes is None:
            top = self.top
            if top is not None and n >= top:
                return None
            return factor * n if top is None else min(factor * n, top)
        above = [s for s in sizes if s > n]
        if not above:
            return None
        grown = [s for s in above if s >= factor * n]
        return grown[0] if grown else above[-1]

    def between(self, lo: int, hi: int) -> int | None:
        """The allowed size strictly between ``lo`` and ``hi`` nearest their midpoint (the
        smaller on a tie), None when there is none."""
        mid = (lo + hi) / 2
        sizes = self._divisors()
        if sizes is None:
            inside = [n for n in (math.floor(mid), math.ceil(mid)) if lo < n < hi]
            inside = [n for n in inside if self.allowed(n)]
        else:
            inside = [s for s in sizes if lo < s < hi]
        if not inside:
            return None
        return min(inside, key=lambda s: (abs(s - mid), s))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
